import copy

import pytest

from fourbit import hashing
from fourbit.config import ConfigError, Study

BASE = {
    "model": {"source": "builtin", "preset": "tiny"},
    "corpus": {"source": "builtin"},
    "arms": [
        {"name": "a", "quant": {"method": "cpu_int4", "group_size": 128}},
        {"name": "b", "quant": {"method": "cpu_int4", "group_size": 64}},
    ],
}


def study(config=BASE):
    return Study.from_config(copy.deepcopy(config))


def test_arm_id_is_name_and_hash_of_quant():
    ids = list(study().arms)
    assert ids[0].startswith("a-") and len(ids[0]) == len("a-") + hashing.HASH_CHARS


def test_key_order_does_not_change_the_hash():
    reordered = copy.deepcopy(BASE)
    reordered["arms"][0]["quant"] = {"group_size": 128, "method": "cpu_int4"}
    assert list(study(reordered).arms) == list(study().arms)


def test_spelled_out_defaults_hash_like_omitted_ones():
    explicit = copy.deepcopy(BASE)
    explicit["arms"][0]["quant"].update(bits=4, sym=False, shrink_steps=20, quantize_head=True)
    assert list(study(explicit).arms) == list(study().arms)


def test_changing_one_arm_changes_only_its_id():
    changed = copy.deepcopy(BASE)
    changed["arms"][1]["quant"]["shrink_steps"] = 5
    before, after = list(study().arms), list(study(changed).arms)
    assert before[0] == after[0] and before[1] != after[1]


def test_scheme_version_is_inside_the_payload(monkeypatch):
    before = list(study().arms)
    monkeypatch.setattr(hashing, "SCHEME_VERSION", hashing.SCHEME_VERSION + 1)
    assert not set(before) & set(study().arms)


def test_misspelt_quant_key_names_the_key_and_the_allowed_ones():
    bad = copy.deepcopy(BASE)
    bad["arms"][0]["quant"]["gruop_size"] = 64
    with pytest.raises(ConfigError, match=r"arms\[0\]\.quant.*'gruop_size'.*allowed keys: .*group_size"):
        study(bad)


def test_unknown_method_lists_the_known_ones():
    bad = copy.deepcopy(BASE)
    bad["arms"][0]["quant"]["method"] = "cpu_int5"
    with pytest.raises(ConfigError, match="cpu_int5.*allowed: .*cpu_int4"):
        study(bad)


def test_bad_value_names_the_allowed_values():
    bad = copy.deepcopy(BASE)
    bad["arms"][0]["quant"]["group_size"] = 96
    with pytest.raises(ConfigError, match=r"group_size.*allowed: 32, 64, 128"):
        study(bad)


def test_an_embedding_width_is_4_or_8_bits_and_hashed_into_the_arm():
    bad = copy.deepcopy(BASE)
    bad["arms"][0]["quant"] = {"method": "gptq", "group_size": 128, "quantize_embedding": 6}
    with pytest.raises(ConfigError, match=r"quantize_embedding: 6 is not one of.*allowed: True, 8"):
        study(bad)
    ids = set()
    for table in ({}, {"quantize_embedding": True}, {"quantize_embedding": 8}):
        arms = copy.deepcopy(BASE)
        arms["arms"][0]["quant"] = {"method": "gptq", "group_size": 128, **table}
        ids.add(list(study(arms).arms)[0])
    assert len(ids) == 3


def test_duplicate_arm_is_refused():
    bad = copy.deepcopy(BASE)
    bad["arms"].append(copy.deepcopy(BASE["arms"][0]))
    with pytest.raises(ConfigError, match=r"arms\[2\]\.name: 'a' is already the name of arms\[0\]"):
        study(bad)


def test_two_arms_of_one_name_are_refused_even_with_different_quant():
    bad = copy.deepcopy(BASE)
    bad["arms"][1]["name"] = "a"  # group 64, where arms[0] is group 128: ids would differ
    with pytest.raises(ConfigError, match=r"'a' is already the name of arms\[0\]; every arm needs its own name"):
        study(bad)


def refused_with(blocks: dict, message: str) -> None:
    """BASE with ``blocks`` set is refused before any job, with ``message``."""
    with pytest.raises(ConfigError, match=message):
        study({**copy.deepcopy(BASE), **blocks})


@pytest.mark.parametrize(("runtimes", "message"), [
    ({"variants": ["vllm float16 w4a8"]},
     r"bench.runtimes.variants: unknown variant\(s\) \['vllm float16 w4a8'\].*'vllm bfloat16 w4a8'"),
    ({"arms": ["a", "zz"]}, r"bench.runtimes.arms: \['zz'\] are not arms of this config; its arms are"),
    ({"variants": []}, r"bench.runtimes.variants"),
    # vLLM's own kernels are engines of their own, scored, not variants of the plugin's
    ({"variants": ["vllm_native bfloat16 cpu_gemm_wna16"]}, r"unknown variant\(s\)"),
])
def test_runtime_variants_name_known_variants_and_arms_before_any_job(runtimes, message):
    refused_with({"bench": {"runtimes": runtimes}}, message)
    good = copy.deepcopy(BASE)
    good["bench"] = {"runtimes": {"arms": ["a"], "variants": ["vllm bfloat16 w4a8_group"]}}
    good["engines"] = {"vllm": {}}
    assert study(good).config["bench"]["runtimes"]["arms"] == ["a"]
    del good["engines"]  # the reference engine alone: no arm has variants to time
    with pytest.raises(ConfigError, match=r"bench.runtimes.arms: \['a'\] run on no engine with "
                                          r"runtime variants \(engines: vllm\)"):
        study(good)


@pytest.mark.parametrize(("runtime", "message"), [
    (["vllm bfloat16 w4a8_group", "vllm float16 w4a8"],
     r"serve.runtime: unknown variant\(s\) \['vllm float16 w4a8'\].*'vllm bfloat16 w4a8'"),
    ([], r"serve.runtime"),
    ("fastest", r"serve.runtime"),
])
def test_serve_runtime_names_known_variants_before_any_job(runtime, message):
    refused_with({"serve": {"runtime": runtime}}, message)
    good = copy.deepcopy(BASE)
    assert study(good).config["serve"]["runtime"] == "as_scored"  # the schema's default
    good["serve"] = {"runtime": ["vllm bfloat16 w4a8_group", "vllm float32 w4a8_group"]}
    with pytest.raises(ConfigError, match=r"serve.runtime names runtime variants, but no engine of this "
                                          r"study has them \(engines: vllm\)"):
        study(good)  # the reference engine alone
    good["engines"] = {"vllm": {}}
    assert study(good).config["serve"]["runtime"][0] == "vllm bfloat16 w4a8_group"


def test_model_identity_follows_the_model_not_the_arms():
    other = copy.deepcopy(BASE)
    other["arms"] = other["arms"][:1]
    assert study(other).model_id == study().model_id
    preset = copy.deepcopy(BASE)
    preset["model"]["preset"] = "default"
    assert study(preset).model_id != study().model_id


def test_path_model_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    bad = copy.deepcopy(BASE)
    bad["model"] = {"source": "path", "path": str(tmp_path)}
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        study(bad)


def test_each_engine_scores_the_arms_it_can_run(monkeypatch):
    from fourbit.engines import vllm_native

    monkeypatch.setattr(vllm_native, "kernel_missing", lambda: None)
    config = copy.deepcopy(BASE)
    config["engines"] = {"vllm": {}, "vllm_native": {}, "llamacpp": {}}
    config["arms"] = [
        {"name": "plain", "quant": {"method": "cpu_int4"}},
        {"name": "gs", "quant": {"method": "gptq", "sym": True}},
        {"name": "ga", "quant": {"method": "gptq", "sym": False}},
        {"name": "q4", "quant": {"method": "llamacpp", "type": "Q4_K_M"}},
    ]
    s = study(config)
    names = {e.name: [s.arms[a].name for a in s.arms_for(e)] for e in s.engines.values()}
    assert names == {"vllm": ["plain", "gs", "ga"], "vllm_native": ["gs"], "llamacpp": ["q4"]}
    assert [e.name for e in s.runnable_engines] == ["llamacpp", "vllm", "vllm_native"]


def test_an_engine_this_host_cannot_run_gets_no_jobs_and_a_reason(monkeypatch):
    from fourbit.engines import vllm_native

    monkeypatch.setattr(vllm_native, "kernel_missing", lambda: "no avx512f here")
    config = copy.deepcopy(BASE)
    config["engines"] = {"vllm": {}, "vllm_native": {}}
    config["arms"] = [{"name": "gs", "quant": {"method": "gptq", "sym": True}}]
    s = study(config)
    native = s.engines["vllm_native"]
    assert s.arms_for(native) == [] and native not in s.runnable_engines
    assert s.summary()["engines"][native.id]["unavailable"] == "no avx512f here"


def test_vllm_native_refuses_float32_before_any_job():
    config = copy.deepcopy(BASE)
    config["engines"] = {"vllm_native": {"dtype": "float32"}}
    with pytest.raises(ConfigError, match="float32"):
        study(config)


def test_a_vllm_native_job_on_a_node_without_the_kernel_stops_naming_it(monkeypatch, tmp_path):
    from fourbit.engines import vllm_native

    monkeypatch.setattr(vllm_native, "kernel_missing", lambda: "no avx512f here")
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "gptq"}}')
    with pytest.raises(RuntimeError, match="cannot run on this node .*no avx512f here"):
        vllm_native.VllmNativeEngine().score_windows(tmp_path, [[1, 2]], {}, 1)


# --- Shapes, architectures and names checked while the DAG is built ---------------------

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402
from conftest import mounted_tmpfs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile")]
# A 135M-like model (hidden 576, 9 / 3 heads, vocab 49152), two layers: 576 is not a
# multiple of 128, 1536 is.
WIDE_576 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
}
G128 = {"name": "g128", "quant": {"method": "cpu_int4", "group_size": 128}}
G64 = {"name": "g64", "quant": {"method": "cpu_int4", "group_size": 64}}


def synthetic_576(tmp_path, **overrides) -> dict:
    arch = tmp_path / "wide576.json"
    arch.write_text(json.dumps({**WIDE_576, **overrides}))
    return {"source": "synthetic", "architecture": str(arch)}


def dry_run(workdir: Path, config: dict, env: dict | None = None) -> subprocess.CompletedProcess:
    """``snakemake -n`` on ``config``: the real workflow's DAG, no job run."""
    path = workdir / "study.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [*SNAKEMAKE, "-n", "--directory", str(workdir), "--configfile", str(path), "--cores", "1",
         "results/report.md"],
        capture_output=True, text=True, timeout=600, env=env,
    )


def scheduled_jobs(output: str) -> dict[str, int]:
    """Job counts from Snakemake's 'Job stats' table of a dry run."""
    table = output.split("Job stats:")[1].split("\n\n")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "total"}


def scheduled_arms(output: str) -> set[str]:
    return set(re.findall(r"wildcards:.*\barm=([a-z0-9_.]+)-[0-9a-f]{10}", output))


@pytest.mark.slow
def test_an_arm_whose_group_does_not_fit_the_model_gets_no_job_and_its_reason(tmp_path):
    config = {"model": synthetic_576(tmp_path), "corpus": {"source": "builtin"},
              "engines": {"vllm": {}}, "arms": [G128, G64]}
    run = dry_run(tmp_path, config)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "not run: arm g128 (cpu_int4, group_size 128" in run.stderr
    assert "model.layers.{0-1}.self_attn.q_proj: K=576 is not a multiple of group_size 128" in run.stderr
    assert "group sizes that fit every matrix: 32, 64" in run.stderr
    assert scheduled_arms(run.stdout) == {"g64"}
    assert scheduled_jobs(run.stdout)["quantize"] == 1
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_a_local_576_wide_model_is_checked_before_any_job(tmp_path):
    from conftest import save_tiny_llama, save_tiny_tokenizer

    save_tiny_llama(tmp_path / "m", tied=True, hidden=576, intermediate=1152, layers=1, vocab=512)
    save_tiny_tokenizer(tmp_path / "m")
    arms = [
        {"name": "gptq128", "quant": {"method": "gptq", "group_size": 128}},
        {"name": "gptq128_dense", "quant": {"method": "gptq", "group_size": 128, "fallback": "dense"}},
        {"name": "rtn64", "quant": {"method": "rtn", "group_size": 64}},
    ]
    config = {"model": {"source": "path", "path": str(tmp_path / "m")}, "corpus": {"source": "builtin"},
              "arms": arms}
    run = dry_run(tmp_path, config)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "not run: arm gptq128 (gptq, group_size 128, format gptq)" in run.stderr
    assert "arm gptq128_dense" not in run.stderr
    assert scheduled_arms(run.stdout) == {"gptq128_dense", "rtn64"}


@pytest.mark.slow
def test_an_hf_model_is_checked_from_its_pinned_config_before_the_download(tmp_path):
    from conftest import hub_cache

    revision = "0123456789abcdef0123456789abcdef01234567"
    hub = hub_cache(tmp_path, "models--org--wide", revision, {"config.json": json.dumps(WIDE_576).encode()})
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HOME": str(hub.parent), "HF_HUB_OFFLINE": "1"}
    config = {"model": {"source": "hf", "repo_id": "org/wide", "revision": revision},
              "corpus": {"source": "builtin"}, "arms": [G128, G64]}
    run = dry_run(tmp_path, config, env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "not run: arm g128" in run.stderr and scheduled_arms(run.stdout) == {"g64"}
    assert scheduled_jobs(run.stdout)["download"] == 1


@pytest.mark.slow
def test_duplicate_arm_names_fail_the_dry_run_naming_them(tmp_path):
    config = {"model": {"source": "builtin", "preset": "tiny"}, "corpus": {"source": "builtin"},
              "arms": [G128, {**G64, "name": "g128"}]}
    run = dry_run(tmp_path, config)
    assert run.returncode != 0
    assert "arms[1].name: 'g128' is already the name of arms[0]" in run.stdout + run.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_an_unknown_synthetic_architecture_fails_the_dry_run_naming_the_shipped_ones(tmp_path):
    config = {"model": {"source": "synthetic", "architecture": "qwen9-7b"}, "corpus": {"source": "builtin"},
              "arms": [G64]}
    run = dry_run(tmp_path, config)
    assert run.returncode != 0
    assert ("model.architecture 'qwen9-7b': not a shipped name (llama-3.2-1b, qwen2.5-0.5b, "
            "smollm-135m, smollm-360m)") in run.stdout + run.stderr
    assert not (tmp_path / "results").exists()


def test_refused_arms_are_in_the_study_summary_with_their_reason(tmp_path):
    s = study({**BASE, "model": synthetic_576(tmp_path), "arms": [G128, G64]})
    assert [a.name for a in s.arms.values()] == ["g64"]
    (refused,) = s.summary()["refused_arms"]
    assert refused["name"] == "g128" and refused["id"].startswith("g128-")
    assert "K=576 is not a multiple of group_size 128" in refused["reason"]


def test_a_study_none_of_whose_arms_fit_stops(tmp_path):
    with pytest.raises(ConfigError, match="no arm of the config can run on this model"):
        study({**BASE, "model": synthetic_576(tmp_path), "arms": [G128]})


def test_fallback_is_part_of_the_arm_id(tmp_path):
    dense = {"name": "g128", "quant": {**G128["quant"], "fallback": "dense"}}
    refuse = {"name": "g128", "quant": {**G128["quant"], "fallback": "refuse"}}
    assert list(study({**BASE, "arms": [dense]}).arms) != list(study({**BASE, "arms": [refuse]}).arms)
    assert list(study({**BASE, "arms": [refuse]}).arms) == list(study({**BASE, "arms": [G128]}).arms)


def test_an_arm_with_dense_fallback_layers_is_not_given_to_vllm_native(tmp_path, monkeypatch):
    from fourbit.engines import vllm_native

    monkeypatch.setattr(vllm_native, "kernel_missing", lambda: None)
    arms = [{"name": "dense", "quant": {"method": "gptq", "group_size": 128, "fallback": "dense"}},
            {"name": "fits", "quant": {"method": "gptq", "group_size": 64, "fallback": "dense"}}]
    s = study({**BASE, "model": synthetic_576(tmp_path), "engines": {"vllm": {}, "vllm_native": {}},
               "arms": arms})
    names = {e.name: [s.arms[a].name for a in s.arms_for(e)] for e in s.engines.values()}
    assert names == {"vllm": ["dense", "fits"], "vllm_native": ["fits"]}
    plan = next(a["plan"] for a in s.summary()["arms"] if a["name"] == "dense")
    assert "model.layers.0.self_attn.q_proj" in plan["kept_dense"]
    assert "model.layers.0.mlp.down_proj" not in plan["kept_dense"]  # 1536 = 12 x 128


def test_an_architecture_vllm_does_not_list_stops_before_any_job(tmp_path):
    model = synthetic_576(tmp_path, architectures=["LlamaForCausalLMWithoutVllm"])
    with pytest.raises(ConfigError, match=r"LlamaForCausalLMWithoutVllm is not one vLLM .* runs.*"
                                          r"LlamaForCausalLM.*engines vllm need it"):
        study({**BASE, "model": model, "engines": {"vllm": {}}, "arms": [G64]})
    # without a vLLM engine the same model is fine
    assert study({**BASE, "model": model, "engines": {"reference": {}}, "arms": [G64]}).arms


def test_a_model_layout_fourbit_cannot_walk_stops_before_any_job(tmp_path):
    model = synthetic_576(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="model_type 'gpt2'.*Llama layout"):
        study({**BASE, "model": model, "arms": [G64]})


def test_a_bad_builtin_training_override_stops_before_any_job():
    with pytest.raises(ConfigError, match="model.train: .*hidden_size=300 must be a multiple of 256"):
        study({**BASE, "model": {"source": "builtin", "preset": "tiny", "train": {"hidden_size": 300}}})


def test_building_the_study_imports_neither_torch_nor_transformers(tmp_path):
    """The DAG is built at every Snakemake start (and in every cluster job): the shape and
    architecture checks must not cost a torch import."""
    code = ("import sys, json; from fourbit.config import Study; "
            "Study.from_config(json.loads(sys.argv[1])); "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    config = {**BASE, "model": synthetic_576(tmp_path), "engines": {"vllm": {}, "llamacpp": {}},
              "arms": [G64, {"name": "q4", "quant": {"method": "llamacpp"}}]}
    run = subprocess.run([sys.executable, "-c", code, json.dumps(config)], capture_output=True, text=True,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_the_report_names_refused_arms_dense_fallbacks_and_llamacpp_fallbacks(tmp_path):
    from fourbit.report.markdown import arms_refused_or_falling_back

    dense = {"name": "g128d", "quant": {"method": "rtn", "group_size": 128, "fallback": "dense"}}
    s = study({**BASE, "model": synthetic_576(tmp_path), "engines": {"vllm": {}, "llamacpp": {}},
               "arms": [G128, dense, {"name": "q4", "quant": {"method": "llamacpp"}}]})
    dense_id = next(a for a in s.arms if a.startswith("g128d-"))
    manifest = {"id": dense_id, "storage": {"fallback_dense": dict.fromkeys(["a", "b"], [576, 576]),
                                            "bits_per_weight_with_fallback": 7.25}}
    text = "\n".join(arms_refused_or_falling_back(s.summary(), [manifest]))
    assert "**Not run on this model: arm g128**" in text
    assert "model.layers.{0-1}.self_attn.q_proj: K=576 is not a multiple of group_size 128" in text
    assert f"`{dense_id}` kept 2 linears dense" in text and "7.250" in text
    assert "llama-quantize stores these tensors in a fallback type" in text
    assert "K=576 is not a multiple of 256 (Q4_K_M's block)" in text
    assert arms_refused_or_falling_back(study().summary(), []) == []


def fake_converter(tree: Path, registers: str, chkhsh: str = "0" * 64) -> Path:
    """A llama.cpp tree with only what fourbit reads of its converter."""
    (tree / "conversion").mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text("from conversion import ModelBase\n")
    (tree / "conversion" / "llama.py").write_text(f"@ModelBase.register(\n    {registers})\nclass M:\n    pass\n")
    (tree / "conversion" / "base.py").write_text(
        "    def get_vocab_base_pre(self, tokenizer) -> str:\n"
        "        chktxt = 'probe text'\n"
        f'        if chkhsh == "{chkhsh}":\n            # ref: somewhere\n            res = "known-bpe"\n')
    return tree


def test_the_converters_architectures_and_pre_tokenizers_are_read_from_its_source(tmp_path):
    from fourbit.inputs import supported

    tree = fake_converter(tmp_path / "tree", '"LlamaForCausalLM",\n    "MistralForCausalLM"', "ab" * 32)
    assert supported.llamacpp_architectures(tree) == {"LlamaForCausalLM", "MistralForCausalLM"}
    assert supported.llamacpp_pre_tokenizers(tree) == ("probe text", {"ab" * 32: "known-bpe"})
    supported.check_llamacpp({"architectures": ["MistralForCausalLM"]}, tree, None)
    with pytest.raises(supported.Unsupported, match="Qwen2ForCausalLM is not one llama.cpp's converter"):
        supported.check_llamacpp({"architectures": ["Qwen2ForCausalLM"]}, tree, None)


def built_llamacpp_tree() -> Path:
    from fourbit.llamacpp.installed import find_llamacpp

    tools = find_llamacpp()
    if tools is None:
        pytest.skip("llama.cpp is not built on this host (make llamacpp)")
    return tools.convert_script.parent


def test_an_architecture_the_built_converter_lacks_stops_before_any_job(tmp_path):
    built_llamacpp_tree()
    model = synthetic_576(tmp_path, architectures=["LlamaForCausalLMNotInLlamaCpp"])
    with pytest.raises(ConfigError, match="LlamaForCausalLMNotInLlamaCpp is not one llama.cpp's converter"):
        study({**BASE, "model": model, "engines": {"llamacpp": {}}, "arms": [{"name": "q4", "quant":
                                                                                {"method": "llamacpp"}}]})
    assert study({**BASE, "model": synthetic_576(tmp_path), "engines": {"llamacpp": {}},
                  "arms": [{"name": "q4", "quant": {"method": "llamacpp"}}]}).arms


def test_before_llamacpp_is_built_its_converter_sources_check_the_model(tmp_path, monkeypatch):
    """On a machine whose first job builds llama.cpp, the config check reads the pinned
    converter from the sdist instead, and answers as the built one does."""
    import shutil

    from fourbit.inputs import supported
    from fourbit.llamacpp import build, installed
    from fourbit.llamacpp.sdist import SDIST_NAME

    built = built_llamacpp_tree()
    sdist = installed.default_cache_root() / "sdist" / SDIST_NAME
    if not sdist.is_file():
        pytest.skip(f"no cached sdist at {sdist} (make llamacpp fetches it)")
    cache = tmp_path / "cache"
    (cache / "sdist").mkdir(parents=True)
    shutil.copy(sdist, cache / "sdist")  # no download: the same checked file
    tree = build.converter_source(cache)
    assert supported.llamacpp_architectures(tree) == supported.llamacpp_architectures(built)
    assert supported.llamacpp_pre_tokenizers(tree) == supported.llamacpp_pre_tokenizers(built)
    monkeypatch.setattr(installed, "find_llamacpp", lambda cache_root=None: None)
    monkeypatch.setattr(build, "default_cache_root", lambda: cache)
    model = synthetic_576(tmp_path, architectures=["LlamaForCausalLMNotInLlamaCpp"])
    with pytest.raises(ConfigError, match=f"LlamaForCausalLMNotInLlamaCpp is not one llama.cpp's converter \\({tree}"):
        study({**BASE, "model": model, "engines": {"llamacpp": {}},
               "arms": [{"name": "q4", "quant": {"method": "llamacpp"}}]})


def test_a_machine_that_cannot_build_llamacpp_stops_before_any_job(tmp_path, monkeypatch):
    """The workflow trains the model before its build job runs, so a missing compiler is
    named by the config check, not after the training."""
    from fourbit.llamacpp import build, installed, toolchain

    monkeypatch.setattr(installed, "find_llamacpp", lambda cache_root=None: None)
    monkeypatch.setattr(toolchain.shutil, "which", lambda tool: None if tool == "cmake" else "/bin/x")
    monkeypatch.setattr(build, "converter_source", lambda cache_root=None: pytest.fail("fetched the sdist"))
    with pytest.raises(ConfigError, match="missing: cmake .*apt-get install cmake build-essential"):
        study({**BASE, "model": synthetic_576(tmp_path), "engines": {"llamacpp": {}},
               "arms": [{"name": "q4", "quant": {"method": "llamacpp"}}]})


def bpe_tokenizer(folder: Path) -> None:
    """A byte-level-free BPE split on whitespace: a pre-tokenizer no released model uses."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    text = [json.__doc__ or "", os.__doc__ or "", re.__doc__ or ""] * 4
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "unk_token": "<unk>"}))


def test_a_tokenizer_the_converter_does_not_know_stops_before_any_job(tmp_path):
    from conftest import save_tiny_llama

    from fourbit.inputs import supported

    tree = built_llamacpp_tree()
    save_tiny_llama(tmp_path / "m", tied=True, vocab=512)
    bpe_tokenizer(tmp_path / "m")
    assert supported.needs_pre_tokenizer_hash(tmp_path / "m")
    config = {**BASE, "model": {"source": "path", "path": str(tmp_path / "m")},
              "engines": {"llamacpp": {}}, "arms": [{"name": "q4", "quant": {"method": "llamacpp"}}]}
    with pytest.raises(ConfigError, match=r"the tokenizer of .*m is a BPE whose pre-tokenizer llama.cpp's "
                                          r"converter does not recognise \(chkhsh [0-9a-f]{64}.*llama-bpe"):
        study(config)
    # the converter reads a SentencePiece tokenizer.model without hashing anything
    (tmp_path / "m" / "tokenizer.model").write_bytes(b"")
    assert not supported.needs_pre_tokenizer_hash(tmp_path / "m")
    assert study(config).arms
    # and without a llama.cpp engine or arm the BPE tokenizer is nobody's business
    (tmp_path / "m" / "tokenizer.model").unlink()
    assert study({**config, "engines": {"reference": {}}, "arms": [G64]}).arms
    assert tree.is_dir()


def test_an_hf_tokenizer_the_converter_does_not_know_stops_before_the_download(tmp_path):
    from conftest import hub_cache, save_tiny_llama

    from fourbit.inputs.sources import HUB_TOKENIZER_FILES

    built_llamacpp_tree()
    revision = "0123456789abcdef0123456789abcdef01234567"
    save_tiny_llama(tmp_path / "m", tied=True, vocab=512)
    bpe_tokenizer(tmp_path / "m")
    names = ("config.json", "tokenizer.json", "tokenizer_config.json")
    hub = hub_cache(tmp_path, "models--org--bpe", revision, {n: (tmp_path / "m" / n).read_bytes() for n in names})
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HOME": str(hub.parent), "HF_HUB_OFFLINE": "1"}
    config = {**BASE, "model": {"source": "hf", "repo_id": "org/bpe", "revision": revision},
              "engines": {"llamacpp": {}}, "arms": [{"name": "q4", "quant": {"method": "llamacpp"}}]}
    code = "import sys, json; from fourbit.config import Study; Study.from_config(json.loads(sys.argv[1]))"

    def build():
        return subprocess.run([sys.executable, "-c", code, json.dumps(config)], capture_output=True,
                              text=True, cwd=tmp_path, env=env)

    # Offline, and nothing says whether the repo has a tokenizer.model: not checked yet.
    assert build().returncode == 0
    # An earlier online look-up cached that the repo has none of the other files.
    absent = hub / "models--org--bpe" / ".no_exist" / revision
    absent.mkdir(parents=True)
    for name in set(HUB_TOKENIZER_FILES) - set(names):
        (absent / name).touch()
    run = build()
    assert run.returncode != 0
    assert "is a BPE whose pre-tokenizer llama.cpp's converter does not recognise" in run.stderr


def test_an_engine_that_cannot_time_the_model_is_known_before_any_job():
    """The tiny builtin model holds 128 positions: vLLM refuses pp512's prompt, llama-bench
    runs past them; the bench records the reason instead of failing the study."""
    config = copy.deepcopy(BASE)
    config["engines"] = {"vllm": {}, "llamacpp": {}}
    refusals = study(config).bench_refusals
    assert "512-token prompt (pp512) exceeds the model's 128 positions" in refusals["vllm"]
    assert refusals["llamacpp"] is None


ARCHITECTURE_TIER = ROOT / "configs" / "architectures"


@pytest.mark.slow
@pytest.mark.parametrize("family, width", [("llama-3.2-1b", None), ("qwen2.5-0.5b", None),
                                           ("smollm-135m", 576), ("smollm-360m", 960)])
def test_every_arm_of_the_architecture_tier_is_scheduled_or_refused_at_dag_time(tmp_path, family, width):
    """The tier's configs (make architectures): on each family every arm gets its jobs, or
    none and its reason in the dry run; only the group-128 arms without a fallback are
    refused, on the families whose hidden width is not a multiple of 128."""
    import yaml

    config = yaml.safe_load((ARCHITECTURE_TIER / "common.yaml").read_text())
    config.update(yaml.safe_load((ARCHITECTURE_TIER / f"{family}.yaml").read_text()))
    config["results"] = "results"
    # The dry run still checks the disk: a 1B model's study needs about 43 GB, more than a
    # CI host may have free. results/ on a tmpfs that large (a limit, nothing allocated:
    # the dry run writes nothing) keeps the scheduling verdict independent of the host.
    with mounted_tmpfs(tmp_path / "results", 10**12):
        run = dry_run(tmp_path, config)
    assert run.returncode == 0, run.stderr[-3000:]
    arms = {arm["name"] for arm in config["arms"]}
    refused = {"cpu_int4_g128", "gptq_sym_g128"} if width else set()
    assert scheduled_arms(run.stdout) == arms - refused
    for name in refused:
        assert f"not run: arm {name} (" in run.stderr
        assert f"K={width} is not a multiple of group_size 128" in run.stderr


def llamacpp_study(*quants: dict) -> Study:
    return study({**BASE, "engines": {"llamacpp": {}},
                  "arms": [{"name": f"q{i}", "quant": {"method": "llamacpp", **quant}}
                           for i, quant in enumerate(quants)]})


def test_the_imatrix_is_keyed_in_the_arm_id_and_shared_by_arms_of_one_calibration_block():
    from fourbit.schema import canonical_quant, load_schema

    s = llamacpp_study({}, {"imatrix": False}, {"imatrix": "calibration"},
                       {"type": "IQ4_XS", "imatrix": "calibration"},
                       {"imatrix": "calibration", "calibration": {"samples": 64}})
    arms = list(s.arms.values())
    hashes = [arm.id.rsplit("-", 1)[1] for arm in arms]
    # false is the default (the id of every llama.cpp arm made before the imatrix existed);
    # an arm that differs only by its imatrix is another arm
    assert hashes[0] == hashes[1] != hashes[2]
    assert [arm.imatrix for arm in arms[:2]] == [None, None]
    assert arms[2].imatrix == arms[3].imatrix != arms[4].imatrix
    assert s.imatrices == {arms[2].imatrix: arms[2].quant["calibration"],
                           arms[4].imatrix: arms[4].quant["calibration"]}
    # the calibration block is gptq's, its defaults included, and names the corpus
    gptq = canonical_quant({"method": "gptq"}, load_schema())["calibration"]
    assert arms[2].quant["calibration"] == {**gptq, "corpus": s.corpus_id}


def test_mixed_precision_arms_that_differ_only_in_their_budget_share_one_pass():
    gptq = {"method": "gptq", "group_size": 64, "sym": False}
    budgets = [{"extra_bits": 0.5}, {"extra_bits": 1.0}, {"extra_bits": 1.0, "windows": 2},
               {"extra_bits": 0.5, "grids": [8]}, {"extra_bits": 0.5, "grids": [8, 6, 5]}]
    s = study({**BASE, "arms": [
        {"name": "plain", "quant": gptq},
        *({"name": f"m{i}", "quant": {**gptq, "mixed_precision": b}} for i, b in enumerate(budgets)),
        {"name": "g128", "quant": {**gptq, "group_size": 128, "mixed_precision": budgets[0]}},
    ]})
    plain, m0, m1, m2, m3, m4, g128 = s.arms.values()
    assert plain.sensitivity is None and len({m0.id, m1.id, m2.id, m4.id}) == 4
    assert m3.id == m0.id.replace("m0", "m3")  # grids: [8] is the schema's default, spelt out
    # the budget is not in the pass's id; what the pass measures on, the grid and the wide
    # grids measured are
    assert m0.sensitivity == m1.sensitivity == m3.sensitivity != m2.sensitivity != g128.sensitivity
    assert len({m0.sensitivity, m2.sensitivity, m4.sensitivity, g128.sensitivity}) == 4
    shared = s.sensitivities[m0.sensitivity]
    assert list(s.sensitivities) == [m0.sensitivity, m2.sensitivity, m4.sensitivity, g128.sensitivity]
    assert shared.name == "m0" and shared.quant["mixed_precision"] == {"windows": 4, "grids": [8]}
    assert m4.quant["mixed_precision"]["grids"] == [5, 6, 8]  # a set, in one order
    assert {k: v for k, v in shared.quant.items() if k != "mixed_precision"} == plain.quant


@pytest.mark.parametrize("quant, message", [
    ({"type": "Q8_0", "imatrix": "calibration"}, "Q8_0 reads no importance matrix"),
    ({"calibration": {"samples": 8}}, "calibration is read only to compute an importance matrix"),
    ({"imatrix": "calibration", "calibration": {"samples": 1}}, "needs at least 2 calibration windows"),
    ({"type": "Q3_K_S"}, "allowed: Q4_0, Q4_1, Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, Q6_K, Q8_0, IQ4_XS, IQ4_NL"),
])
def test_a_llamacpp_arm_that_cannot_be_built_as_asked_stops_before_any_job(quant, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        llamacpp_study(quant)
