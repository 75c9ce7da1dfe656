"""Model sources: the real fetch code paths against local stand-ins for the hub."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import hub_cache, save_tiny_llama, save_tiny_tokenizer

from fourbit.checkpoints.hf import read_config
from fourbit.config import model_identity
from fourbit.schema import block
from fourbit.inputs.pinned_kernels import cpu_vendor
from fourbit.inputs.sources import MANIFEST
from fourbit.steps.prepare import fetch_model

REVISION = "0123456789abcdef0123456789abcdef01234567"
SRC = Path(__file__).resolve().parents[1] / "src"


def fetch_offline(hub: Path, spec: dict, out: Path) -> subprocess.CompletedProcess:
    """fetch_model in a fresh interpreter: huggingface_hub reads HF_* variables at import."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HOME": str(hub.parent), "HF_HUB_OFFLINE": "1"}
    code = "import json, sys; from fourbit.steps.prepare import fetch_model; "
    code += "fetch_model(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], 1)"
    return subprocess.run([sys.executable, "-c", code, json.dumps(spec), str(out), str(out.parent)],
                          env=env, capture_output=True, text=True)


def model_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_hf_source_reads_a_pinned_revision_from_the_hub_cache(tmp_path):
    save_tiny_llama(tmp_path / "m", tied=True)
    save_tiny_tokenizer(tmp_path / "m")
    hub = hub_cache(tmp_path, "models--org--tiny", REVISION, model_files(tmp_path / "m"))
    spec = {"source": "hf", "repo_id": "org/tiny", "revision": REVISION, "trust_remote_code": False}
    run = fetch_offline(hub, spec, tmp_path / "out")
    assert run.returncode == 0, run.stderr[-2000:]
    assert read_config(tmp_path / "out")["tie_word_embeddings"] is True
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert set(manifest["weights_sha256"]) == {"model.safetensors"}


def test_hf_source_without_safetensors_is_refused(tmp_path):
    save_tiny_llama(tmp_path / "m", tied=True)
    files = {k: v for k, v in model_files(tmp_path / "m").items() if not k.endswith(".safetensors")}
    files["pytorch_model.bin"] = b"not loaded"
    hub = hub_cache(tmp_path, "models--org--tiny", REVISION, files)
    spec = {"source": "hf", "repo_id": "org/tiny", "revision": REVISION, "trust_remote_code": False}
    run = fetch_offline(hub, spec, tmp_path / "out")
    assert run.returncode != 0 and "no *.safetensors" in run.stderr
    assert not (tmp_path / "out").exists()


def test_hf_source_with_remote_code_needs_consent(tmp_path):
    save_tiny_llama(tmp_path / "m", tied=True)
    files = model_files(tmp_path / "m")
    config = json.loads(files["config.json"])
    files["config.json"] = json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}).encode()
    hub = hub_cache(tmp_path, "models--org--tiny", REVISION, files)
    spec = {"source": "hf", "repo_id": "org/tiny", "revision": REVISION, "trust_remote_code": False}
    run = fetch_offline(hub, spec, tmp_path / "out")
    assert run.returncode != 0 and "trust_remote_code" in run.stderr


def test_path_source_links_the_folder(tmp_path):
    save_tiny_llama(tmp_path / "m", tied=False)
    save_tiny_tokenizer(tmp_path / "m")
    spec = block("model", {"source": "path", "path": str(tmp_path / "m")})
    fetch_model(spec, tmp_path / "out", tmp_path, 1, model_id=model_identity(spec, "c"),
                corpus_id="c")
    assert (tmp_path / "out" / "model.safetensors").is_symlink()


def test_a_model_id_this_host_would_not_make_is_refused_before_any_work(tmp_path):
    """A builtin model's id holds the CPU vendor it trains on: a job on a host of another
    vendor than where the workflow started stops, naming both ids and this host's vendor."""
    spec = block("model", {"source": "builtin", "preset": "tiny"})
    here = model_identity(spec, "c")
    elsewhere = "builtin_tiny-0123456789"
    with pytest.raises(ValueError, match=rf"this host would make model {here}, not the study's "
                                         rf"{elsewhere}.*CPU vendor, here {cpu_vendor()}"):
        fetch_model(spec, tmp_path / "out", tmp_path / "no-corpus", 1, model_id=elsewhere,
                    corpus_id="c")
    assert not (tmp_path / "out").exists()


def test_the_builtin_model_id_follows_the_cpu_vendor(monkeypatch):
    from fourbit.inputs import builtin_model

    spec = {"source": "builtin", "preset": "tiny"}
    ids = set()
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        monkeypatch.setattr(builtin_model, "cpu_vendor", lambda vendor=vendor: vendor)
        ids.add(model_identity(spec, "c"))
    assert len(ids) == 2


def test_synthetic_source_builds_random_weights_at_given_shapes(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 8192, "tie_word_embeddings": True,
    }
    (tmp_path / "arch.json").write_text(json.dumps(config))
    # Enough varied text for a 4096-piece tokenizer: a few standard-library modules.
    import argparse
    import inspect
    import typing

    (tmp_path / "train.txt").write_text("".join(inspect.getsource(m) for m in (argparse, inspect, typing)))
    fetch_model({"source": "synthetic", "architecture": str(tmp_path / "arch.json"), "seed": 0},
                tmp_path / "out", tmp_path, 1)
    written = read_config(tmp_path / "out")
    assert written["hidden_size"] == 256 and written["vocab_size"] == 8192
    assert (tmp_path / "out" / "tokenizer.model").is_file()


def test_unknown_architecture_names_the_shipped_ones(tmp_path):
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        fetch_model({"source": "synthetic", "architecture": "nope", "seed": 0}, tmp_path / "out", tmp_path, 1)


def test_builtin_config_before_any_job_is_the_one_training_builds(tmp_path):
    from fourbit.inputs.builtin_model import TINY_SPEC, _new_model, resolve_spec
    from fourbit.inputs.sources import model_config

    planned = model_config({"source": "builtin", "preset": "tiny"}, Path("/nonexistent"))
    _new_model(resolve_spec(TINY_SPEC)).save_pretrained(tmp_path)  # as training saves it
    built = read_config(tmp_path)
    for key, value in planned.items():
        assert built[key] == value, key


def test_path_config_is_the_folders_and_a_folder_without_one_is_named(tmp_path):
    from fourbit.inputs.sources import model_config

    save_tiny_llama(tmp_path / "m", tied=False, hidden=256)
    assert model_config({"source": "path", "path": str(tmp_path / "m")}, tmp_path)["hidden_size"] == 256
    with pytest.raises(ValueError, match=f"{tmp_path}: no config.json"):
        model_config({"source": "path", "path": str(tmp_path)}, tmp_path)


def test_synthetic_config_of_a_shipped_name_and_of_an_unknown_one():
    from fourbit.inputs.sources import model_config

    from fourbit.schema import block

    def spec(**given):
        return block("model", {"source": "synthetic", **given})

    assert model_config(spec(architecture="qwen2.5-0.5b"), Path("."))["hidden_size"] == 896
    short = model_config(spec(architecture="qwen2.5-0.5b", layers=2), Path("."))
    assert (short["num_hidden_layers"], short["max_window_layers"], short["hidden_size"]) == (2, 2, 896)
    with pytest.raises(ValueError, match="'nope': not a shipped name \\(llama-3.2-1b, qwen2.5-0.5b, "
                                         "smollm-135m, smollm-360m\\)"):
        model_config(spec(architecture="nope"), Path("."))


def test_hf_config_before_any_job_comes_from_the_pinned_revision_and_refuses_remote_code(tmp_path):
    save_tiny_llama(tmp_path / "m", tied=True)
    files = model_files(tmp_path / "m")
    remote = json.dumps({**json.loads(files["config.json"]), "auto_map": {"AutoModel": "x.Y"}}).encode()
    hub = hub_cache(tmp_path, "models--org--tiny", REVISION, {"config.json": files["config.json"]})
    hub_cache(tmp_path, "models--org--remote", REVISION, {"config.json": remote})
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HOME": str(hub.parent), "HF_HUB_OFFLINE": "1"}
    code = ("import json, sys; from pathlib import Path; from fourbit.inputs.sources import model_config; "
            "print(json.dumps(model_config(json.loads(sys.argv[1]), Path(sys.argv[2]))))")

    def config_of(repo):
        spec = {"source": "hf", "repo_id": repo, "revision": REVISION}
        return subprocess.run([sys.executable, "-c", code, json.dumps(spec), str(tmp_path / "none")],
                              env=env, capture_output=True, text=True)

    run = config_of("org/tiny")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["hidden_size"] == 256
    run = config_of("org/remote")
    assert run.returncode != 0 and "trust_remote_code" in run.stderr
    run = config_of("org/absent")
    assert run.returncode != 0 and "cannot read config.json of org/absent@" in run.stderr
