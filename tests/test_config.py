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


def test_duplicate_arm_is_refused():
    bad = copy.deepcopy(BASE)
    bad["arms"].append(copy.deepcopy(BASE["arms"][0]))
    with pytest.raises(ConfigError, match="same id"):
        study(bad)


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
    from fourbit import engines

    monkeypatch.setitem(engines.ENGINE_HOST_CHECKS, "vllm_native", lambda: None)
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
    from fourbit import engines

    monkeypatch.setitem(engines.ENGINE_HOST_CHECKS, "vllm_native", lambda: "no avx512f here")
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
    from fourbit import engines
    from fourbit.engines import vllm_native

    monkeypatch.setitem(engines.ENGINE_HOST_CHECKS, "vllm_native", lambda: "no avx512f here")
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "gptq"}}')
    with pytest.raises(RuntimeError, match="cannot run on this node .*no avx512f here"):
        vllm_native.score_windows(tmp_path, [[1, 2]], {}, 1)
