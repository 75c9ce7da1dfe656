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
