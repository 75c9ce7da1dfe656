"""fourbit.engines.vllm against a transformers reference on a tiny dense Llama (float32)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_settings import engine_settings

DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False, initializer_range=0.1)  # peaked, so positions matter


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("vllm_engine") / "llama"
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DIMS)).float().eval()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_engine_cache")


WINDOWS = [
    torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(1)).tolist(),
    torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(2)).tolist(),
    [7],  # nothing to score
    torch.randint(0, 512, (33,), generator=torch.Generator().manual_seed(3)).tolist(),
]


# What prompt_logprobs and greedy are given here: the engine's float32, a small KV cache.
OPTIONS = {"dtype": "float32", "kv_cache_bytes": 32 << 20}


def _reference_logprobs(model, ids):
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]  # [L, V]
    return logits.float().log_softmax(-1)  # row t-1 scores token t


@pytest.mark.slow
def test_score_windows_matches_transformers(model_dir, reference, cache_root):
    from fourbit.engines.vllm import prompt_logprobs
    from fourbit.engines.vllm.lifecycle import inductor_cache

    stats = {}
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    out = prompt_logprobs(model_dir, WINDOWS, cache_root=cache_root, stats=stats, **OPTIONS)
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == before  # environment restored
    # vLLM's own caches in the checkpoint's folder; inductor's in the one every engine shares
    assert (cache_root / "vllm").is_dir() and not (cache_root / "inductor").exists()
    assert any(inductor_cache().iterdir())
    assert stats["engine_init_s"] > 0
    assert stats["tokens"] == sum(len(w) for w in WINDOWS if len(w) > 1)
    assert len(out) == len(WINDOWS)
    empty = {"nll_sum": 0.0, "tokens": 0, "token_logprobs": []}
    assert out[2] == empty
    for w, r in zip(WINDOWS, out, strict=True):
        if len(w) < 2:
            continue
        ref = _reference_logprobs(reference, w)
        want = ref[torch.arange(len(w) - 1), torch.tensor(w[1:])]  # log p(w[t] | w[:t]), t = 1..L-1
        got = torch.tensor(r["token_logprobs"], dtype=torch.float32)
        assert r["tokens"] == len(w) - 1
        assert (got - want).abs().max() <= 1e-4
        assert r["nll_sum"] == pytest.approx(-want.double().sum().item(), abs=1e-3)
    # the reference is far from uniform, so an off-by-one position would show
    assert max(max(r["token_logprobs"], default=-99) for r in out) > -3.0


@pytest.mark.slow
def test_kept_logits_are_the_whole_distributions_vllm_scored(model_dir, reference, cache_root):
    """fourbit.engines.vllm.distributions: a window's logits kept from inside vLLM give the
    reference's log-softmax over the whole vocabulary at every position, the engine's own
    logprobs at the actual tokens, and leave the engine as it was."""
    from fourbit.engines.vllm import open_llm
    from fourbit.engines.vllm.distributions import keeping_logits, window_logits
    from fourbit.engines.vllm.score import logprobs_on

    window = WINDOWS[0]
    with open_llm(model_dir, max_model_len=len(window) + 1, cache_root=cache_root,
                  **OPTIONS) as llm:
        with keeping_logits(llm) as kept:
            scored, logits = window_logits(llm, kept, window)
            assert kept == []  # each window's chunks are taken, none left for the next
        (plain,) = logprobs_on(llm, [window], token_logprobs=True)
        sampler = llm.collective_rpc(lambda worker: vars(worker.model_runner.sampler))[0]
    assert "compute_logprobs" not in sampler  # the wrapper is gone
    assert plain["token_logprobs"] == scored["token_logprobs"]
    assert logits.shape == (len(window) - 1, DIMS["vocab_size"]) and logits.dtype == torch.float32
    ref = _reference_logprobs(reference, window)[:-1]  # [L-1, V]
    assert (logits.log_softmax(-1) - ref).abs().max() <= 1e-4


@pytest.mark.slow
def test_greedy_matches_transformers(model_dir, reference, cache_root):
    from fourbit.engines.vllm import greedy

    prompts = [WINDOWS[0][:20], WINDOWS[1], WINDOWS[2]]
    got = greedy(model_dir, prompts, 12, cache_root=cache_root, **OPTIONS)
    for p, g in zip(prompts, got, strict=True):
        ids = list(p)
        with torch.inference_mode():
            for _ in range(12):
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert g == ids[len(p):]


@pytest.mark.slow
def test_engine_registry_convention(model_dir, cache_root):
    """The ppl step calls the registered engine's score_windows(checkpoint, windows,
    settings, threads) and runtime() (fourbit.engines.base.Engine)."""
    from fourbit.engines import get_engine
    from fourbit.engines.vllm import prompt_logprobs

    engine = get_engine("vllm")
    settings = {**engine_settings("vllm", dtype="float32", kv_cache_gib=1 / 32),
                "cache_root": str(cache_root)}
    threads = torch.get_num_threads()
    out = engine.score_windows(model_dir, WINDOWS[:2], settings, 1)
    assert torch.get_num_threads() == threads
    assert [set(r) for r in out] == [{"nll_sum", "tokens"}] * 2
    direct = prompt_logprobs(model_dir, WINDOWS[:2], cache_root=cache_root, **OPTIONS)
    assert [r["nll_sum"] for r in out] == pytest.approx([r["nll_sum"] for r in direct], abs=1e-4)
    assert engine.runtime(model_dir, settings).endswith(", dense")


def test_rejects_empty_input(model_dir):
    from fourbit.engines.vllm import greedy, prompt_logprobs

    with pytest.raises(ValueError):
        prompt_logprobs(model_dir, [], **OPTIONS)
    with pytest.raises(ValueError):
        greedy(model_dir, [[]], 4, **OPTIONS)


def test_settings_come_whole_from_the_schema():
    """No key the schema fills has a fallback here: a missing one is an error naming it,
    an unknown one too; what the schema fills is what the engine runs with."""
    from fourbit.engines.vllm import VllmSettings, runtime

    full = engine_settings("vllm")
    settings = VllmSettings.from_engine(full, plugin=True)
    assert settings.dtype == "float32" and settings.kv_cache_bytes == 1 << 30  # the schema's
    assert settings.cache_root is None and settings.quantization == "auto"
    partial = {key: value for key, value in full.items() if key != "dtype"}
    with pytest.raises(ValueError, match=r"lack \['dtype'\].*fourbit.schema.block"):
        VllmSettings.from_engine(partial, plugin=True)
    native = VllmSettings.from_engine(engine_settings("vllm_native"), plugin=False)
    assert native.dtype == "bfloat16" and native.quant == {} and native.quantization is None
    with pytest.raises(ValueError, match=r"engines.vllm_native settings: unknown key\(s\) \['quant'\]"):
        VllmSettings.from_engine(full, plugin=False)  # vLLM's own kernel takes no plugin knobs
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['kv_cache_bytes'\]"):
        VllmSettings.from_engine({**full, "kv_cache_bytes": 1 << 20}, plugin=True)
    with pytest.raises(ValueError, match="lack"):
        runtime("unused", partial)  # every public entry builds the object first


def test_vllm_native_is_the_vllm_engine_with_vllms_own_kernel(tmp_path):
    """VllmNativeEngine changes only the settings its functions get: vLLM's kernel, and
    for a call that opens an engine, a check that this node has it."""
    from fourbit.engines.vllm import VllmEngine, VllmSettings
    from fourbit.engines.vllm_native import VllmNativeEngine

    given = engine_settings("vllm")
    assert VllmEngine().settings_to_run(given, tmp_path) is given  # built by each function
    native = engine_settings("vllm_native")
    (tmp_path / "config.json").write_text("{}")  # a dense checkpoint: no kernel asked for
    for settings in (VllmNativeEngine().settings_to_describe(native),
                     VllmNativeEngine().settings_to_run(native, tmp_path)):
        assert settings == VllmSettings.from_engine(native, plugin=False)


def test_inductor_cache_is_per_cpu_capability(tmp_path):
    """Code inductor generated for one vector ISA must not load where ATen runs another:
    the shared folder's name follows ATen's capability (here forced to two that every x86
    host here has, so the test means the same on AVX2 and AVX-512 hosts)."""
    script = "from fourbit.engines.vllm.lifecycle import inductor_cache; print(inductor_cache())"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}

    def folder(capability):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True, env={**env, "ATEN_CPU_CAPABILITY": capability})
        return Path(run.stdout.strip())

    avx2, default = folder("avx2"), folder("default")
    assert avx2.parent == default.parent == tmp_path / "fourbit" / "torchinductor"
    assert avx2.name.endswith("-avx2") and default.name.endswith("-default")
    assert avx2 != default


def test_engines_share_one_model_info_cache(tmp_path, monkeypatch):
    """Every engine's VLLM_CACHE_ROOT/modelinfos is the one shared folder, so no process
    starts vLLM's class-inspecting subprocess for a class another engine already saw; a
    folder an older engine filled is replaced by the link."""
    from fourbit.engines.vllm import lifecycle

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    filled = tmp_path / "b" / "vllm" / "modelinfos"
    filled.mkdir(parents=True)
    (filled / "vllm-model_executor-models-llama-LlamaForCausalLM.json").write_text("{}")
    for arm in ("a", "b", "a"):  # the second "a" finds its link made
        with lifecycle._engine_env(tmp_path / arm):
            assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / arm / "vllm")
    shared = lifecycle.model_info_cache()
    assert shared.parent == tmp_path / "home" / "fourbit" / "vllm-modelinfos"
    for arm in ("a", "b"):
        link = tmp_path / arm / "vllm" / "modelinfos"
        assert link.is_symlink() and link.resolve() == shared.resolve()
    assert list(shared.iterdir()) == []  # the stale folder's file went with it
