"""A broken model folder is refused before any job (fourbit.inputs.model_folder), with a
message naming the file, what is wrong and what would be right; a tokenizer the study
names (model.tokenizer) is checked and used in place of the model's own; and a folder
changed since the DAG was built is refused before a job uses it, naming what changed
(fourbit.inputs.folder_state), in the download job and on a cluster node."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_tiny_llama, save_tiny_tokenizer
from safetensors.torch import load_file, save_file

from fourbit.config import ConfigError, Study, model_identity
from fourbit.inputs import folder_state, sources
from fourbit.inputs.model_folder import check_folder
from fourbit.steps.prepare import fetch_model

ARMS = [{"name": "g64", "quant": {"method": "cpu_int4", "group_size": 64}}]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny tied Llama (hidden 256, 2 layers, vocab 512) with a 300-word tokenizer."""
    folder = tmp_path_factory.mktemp("good") / "m"
    save_tiny_llama(folder, tied=True)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture
def folder(good, tmp_path):
    """A copy of the good folder, for a test to break."""
    return Path(shutil.copytree(good, tmp_path / "m"))


def config_of(folder: Path) -> dict:
    return {"model": {"source": "path", "path": str(folder)}, "corpus": {"source": "builtin"},
            "arms": ARMS, "results": str(folder.parent / "results")}


def refused(folder: Path, pattern: str) -> str:
    """Study.from_config's ConfigError on ``folder``, which must match ``pattern``."""
    with pytest.raises(ConfigError, match=pattern) as error:
        Study.from_config(config_of(folder))
    assert not (folder.parent / "results").exists()
    return str(error.value)


def named(path: Path) -> str:
    return re.escape(str(path))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def edit_tensors(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_good_folder_passes_every_check_and_its_tokenizer_loads(good):
    assert Study.from_config(config_of(good)).arms
    check_folder(good, json.loads((good / "config.json").read_text()), load_tokenizer=True)


def test_a_truncated_weight_file_is_refused(folder):
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)
    refused(folder, rf"{named(weights)} is truncated: its header places the tensors in [\d,]+ "
                    r"bytes after the header, but the file holds only [\d,]+ \([\d,]+ bytes in all, "
                    r"1,000 short; tensor \S+ is cut off\); copy it again from where the model came from")


def test_a_folder_without_a_tokenizer_is_refused(folder):
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    refused(folder, rf"{named(folder)}: no tokenizer \(neither tokenizer.json, nor tokenizer.model, "
                    r"nor vocab.json with merges.txt\); .*copy its tokenizer files \(tokenizer.json, "
                    r"tokenizer_config.json, special_tokens_map.json\) from where the model came from")


def test_a_tensor_of_the_wrong_shape_is_refused(folder):
    name = "model.layers.1.self_attn.k_proj.weight"
    edit_tensors(folder, lambda t: t.update({name: t["model.layers.1.self_attn.q_proj.weight"].clone()}))
    refused(folder, rf"{named(folder / 'model.safetensors')}: tensor {re.escape(name)} has shape "
                    r"\[256, 256\], but config.json \(num_key_value_heads 2 x head_dim 64, hidden_size 256\) "
                    r"gives \[128, 256\]; use the config.json "
                    "that came with these weights")


def test_an_index_naming_a_missing_shard_is_refused(good, folder):
    from transformers import AutoModelForCausalLM

    for path in folder.glob("*.safetensors"):
        path.unlink()
    AutoModelForCausalLM.from_pretrained(good).save_pretrained(
        folder, max_shard_size="2MB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    assert Study.from_config(config_of(folder)).arms  # whole, the sharded folder passes
    shards[-1].unlink()
    refused(folder, rf"{named(folder / 'model.safetensors.index.json')}: its weight_map names "
                    rf"{re.escape(shards[-1].name)}, which {named(folder)} does not have \(1 of the "
                    rf"{len(shards)} shards it lists\); copy the missing shard from where the model came from")


def test_an_empty_weight_file_is_refused(folder):
    (folder / "model.safetensors").write_bytes(b"")
    refused(folder, rf"{named(folder / 'model.safetensors')} is empty \(0 bytes\): a safetensors file "
                    "starts with an 8-byte header length and a JSON header; copy it again")


def test_a_vocabulary_larger_than_the_embedding_is_refused(folder):
    edit_config(folder, vocab_size=600)
    refused(folder, rf"{named(folder / 'config.json')}: vocab_size 600 is larger than the embedding "
                    r"model.embed_tokens.weight in model.safetensors, which has 512 rows: token ids "
                    "512..599 would have no embedding; set vocab_size to 512 if the weights are right")


def test_a_tokenizer_larger_than_the_embedding_is_refused(folder):
    save_tiny_tokenizer(folder, vocab=600)
    refused(folder, rf"{named(folder / 'tokenizer.json')}: the tokenizer's ids run up to 599, but the "
                    r"model's embedding has 512 rows \(ids 0..511\): ids 512..599 would index past it; "
                    "use the tokenizer that came with these weights")


def test_a_tokenizer_file_that_is_not_utf8_is_refused(folder):
    path = folder / "tokenizer.json"
    text = path.read_bytes()
    path.write_bytes(text[:20] + b"\xff" + text[20:])
    refused(folder, rf"{named(path)}: not UTF-8 text \(byte 0xff at offset 20 is not valid UTF-8\); "
                    r"transformers reads tokenizer files as UTF-8: save it again as UTF-8")


def test_a_dtype_fourbit_does_not_read_is_refused(folder):
    edit_tensors(folder, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].double()}))
    refused(folder, rf"{named(folder / 'model.safetensors')}: tensor model.norm.weight is F64; fourbit "
                    "reads dense weights in F32, F16 and BF16 only")


def test_the_head_must_be_stored_exactly_when_config_unties_it(folder):
    edit_config(folder, tie_word_embeddings=False)
    refused(folder, rf"{named(folder / 'config.json')} has tie_word_embeddings: false, so the head is "
                    r"its own matrix, but no weight file holds lm_head.weight .*set tie_word_embeddings: "
                    "true if the head shares the embedding")
    edit_config(folder, tie_word_embeddings=True)
    edit_tensors(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    refused(folder, rf"{named(folder / 'config.json')} says tie_word_embeddings: true, yet "
                    r"model.safetensors holds lm_head.weight, which fourbit's untie step would replace "
                    "by a copy of model.embed_tokens.weight")


def test_layers_the_config_does_not_have_are_refused(folder):
    edit_config(folder, num_hidden_layers=1)
    refused(folder, rf"{named(folder / 'model.safetensors')} holds decoder layer 1 \(model.layers.1.\*\), "
                    "but config.json says num_hidden_layers 1; use the config.json")
    edit_config(folder, num_hidden_layers=3)
    refused(folder, rf"{named(folder / 'model.safetensors')} holds no model.layers.2.self_attn.q_proj"
                    r".weight, .* which config.json calls for \(9 of its 29 tensors; num_hidden_layers 3\)")


def test_a_damaged_header_is_refused(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe[}"
    path.write_bytes(bytes(data))
    refused(folder, rf"{named(path)}: its header is not UTF-8 JSON .*copy it again")


def test_the_default_of_an_absent_tie_word_embeddings_is_transformers(folder):
    from transformers import AutoConfig

    from fourbit.inputs.model_folder import _tied
    from fourbit.quantizers.shapes import LLAMA_LAYOUT

    for model_type in LLAMA_LAYOUT:
        assert AutoConfig.for_model(model_type).tie_word_embeddings is _tied({}), model_type


def test_the_dag_time_checks_import_no_torch(good):
    code = ("import json, sys; from fourbit.config import Study; "
            "assert Study.from_config(json.loads(sys.argv[1])).arms; print('torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(config_of(good))],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"


def planned_record(spec: dict, path: Path) -> Path:
    """What rule record_model_folder writes when the DAG is built."""
    path.write_text(json.dumps(folder_state.local_state(spec)))
    return path


def test_the_download_job_refuses_a_folder_changed_after_the_dag_was_built(folder, tmp_path):
    study = Study.from_config(config_of(folder))
    spec = study.config["model"]
    planned = planned_record(spec, tmp_path / "source.planned.json")
    edit_config(folder, max_position_embeddings=1024, rope_scaling="linear")
    weights = folder / "model.safetensors"
    before = weights.stat().st_size
    edit_tensors(folder, lambda t: t.pop("model.norm.weight"))
    (folder / "notes.txt").write_text("new")
    with pytest.raises(ConfigError, match=rf"^the model folder {named(folder)} changed after the "
                                          rf"workflow built its DAG: {named(folder / 'config.json')} "
                                          r"\(max_position_embeddings 512 then, 1024 now, rope_scaling "
                                          rf"absent then, 'linear' now\); {named(weights)} "
                                          rf"\({before:,} bytes then, {weights.stat().st_size:,} now\); "
                                          rf"{named(folder / 'notes.txt')} \(new, 3 bytes\)\. The study "
                                          rf"was planned on the files as they were \(recorded in "
                                          rf"{named(planned)} when the DAG was built\): put them back"):
        fetch_model(spec, tmp_path / "out", tmp_path, 1, model_id=study.model_id,
                    corpus_id=study.corpus_id, planned=planned)
    assert not (tmp_path / "out").exists()


def test_a_weight_file_rewritten_with_the_same_size_is_named(folder, tmp_path):
    """The same tensors, other values: size and header unchanged. A small file's bytes are
    hashed; a large one's time is what tells (its bytes would cost seconds per gigabyte)."""
    study = Study.from_config(config_of(folder))
    spec = study.config["model"]
    planned = planned_record(spec, tmp_path / "source.planned.json")
    weights = folder / "model.safetensors"
    stat = weights.stat()
    edit_tensors(folder, lambda t: t["model.norm.weight"].mul_(2))
    assert weights.stat().st_size == stat.st_size
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even its time put back
    with pytest.raises(ConfigError, match=rf"{named(weights)} \(rewritten with other contents, the "
                                          rf"same {stat.st_size:,} bytes\)"):
        fetch_model(spec, tmp_path / "out", tmp_path, 1, model_id=study.model_id,
                    corpus_id=study.corpus_id, planned=planned)
    assert study.model_id == model_identity(spec, study.corpus_id)  # the id cannot tell


def test_each_kind_of_change_is_named(folder, monkeypatch):
    """folder_state.changes on every case, with the weights above HASHED_BYTES (as a real
    model's are): header, size and time are all that is read of them."""
    monkeypatch.setattr(folder_state, "HASHED_BYTES", 10_000)
    names = sorted(p.name for p in folder.iterdir())
    then = folder_state.record(folder, names)
    assert "header_sha256" in then["files"]["model.safetensors"]
    assert "sha256" in then["files"]["tokenizer.json"]

    def changed():
        return folder_state.changes(then, folder_state.record(folder, names + ["extra.json"]))

    weights, tokenizer = folder / "model.safetensors", folder / "tokenizer.json"
    assert changed() == []
    tokenizer.write_bytes(tokenizer.read_bytes())  # rewritten, the same bytes: no change
    assert changed() == []
    stat = weights.stat()
    edit_tensors(folder, lambda t: t["model.norm.weight"].mul_(2))
    later = weights.stat().st_mtime_ns
    assert changed() == [f"{weights} (rewritten: the same {stat.st_size:,} bytes and header, but "
                         f"modified {folder_state._time(later)}, where it was "
                         f"{folder_state._time(stat.st_mtime_ns)}; whether its tensors' values "
                         "changed would take reading all of it)"]
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert changed() == []  # the one change not seen: same size, header and time (module docstring)
    edit_tensors(folder, lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:128].clone(),
                                             "model.extra": t["model.norm.weight"][128:].clone()}))
    assert weights.stat().st_size != stat.st_size
    assert changed() == [f"{weights} ({stat.st_size:,} bytes then, {weights.stat().st_size:,} now)"]
    size = weights.stat().st_size
    edit_tensors(folder, lambda t: t.update({"model.extrb": t.pop("model.extra")}))
    assert weights.stat().st_size == size
    assert changed() == [f"{weights} ({stat.st_size:,} bytes then, {size:,} now)"]
    then = folder_state.record(folder, names)
    edit_tensors(folder, lambda t: t.update({"model.extrc": t.pop("model.extrb")}))
    assert changed() == [f"{weights} (rewritten: the same {size:,} bytes, but another safetensors "
                         "header (other tensor names, shapes, dtypes or byte ranges))"]
    then = folder_state.record(folder, names)
    data = tokenizer.read_bytes()
    tokenizer.write_bytes(data.replace(b"w1", b"v1", 1))
    (folder / "tokenizer_config.json").unlink()
    (folder / "extra.json").write_text("{}")
    assert changed() == [f"{folder / 'extra.json'} (new, 2 bytes)",
                         f"{tokenizer} (rewritten with other contents, the same {len(data):,} bytes)",
                         f"{folder / 'tokenizer_config.json'} (gone; it had "
                         f"{then['files']['tokenizer_config.json']['bytes']:,} bytes)"]


def test_a_folder_changed_on_a_cluster_node_is_refused_naming_what_changed(folder, tmp_path):
    """Where Snakemake builds the DAG again for one job (workflow/rules/common.smk on a
    node), the folders are compared with the record of the first build, found among the
    results' records even when the folder's new sizes make another model id."""
    study = Study.from_config(config_of(folder))
    spec = study.config["model"]
    other = planned_record(spec, tmp_path / "other.json")
    tokenizer = tmp_path / "tok"
    save_tiny_tokenizer(tokenizer)
    other.write_text(json.dumps(folder_state.local_state({**spec, "tokenizer": str(tokenizer)})))
    planned = planned_record(spec, tmp_path / "planned.json")
    records = [tmp_path / "absent.json", other, planned]
    folder_state.check_as_planned(spec, study.model_config, records)  # unchanged: passes
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)  # broken, too: the record speaks first
    with pytest.raises(ConfigError, match=rf"^the model folder {named(folder)} changed after the "
                                          rf"workflow built its DAG: {named(weights)} \([\d,]+ bytes "
                                          rf"then, [\d,]+ now\)\. .*\(recorded in {named(planned)} "):
        folder_state.check_as_planned(spec, study.model_config, records)
    with pytest.raises(ConfigError, match=rf"^{named(weights)} is truncated"):  # no record: whole
        folder_state.check_as_planned(spec, study.model_config, records[:2])


def test_the_download_job_checks_the_folder_it_links(folder, tmp_path):
    """Without the DAG's state (a direct call), the job's own checks still stop a folder
    broken after the DAG was built."""
    study = Study.from_config(config_of(folder))
    (folder / "tokenizer.json").write_bytes(b"\xff")
    spec = study.config["model"]
    with pytest.raises(ConfigError, match=rf"^{named(folder / 'tokenizer.json')}: not UTF-8 text"):
        fetch_model(spec, tmp_path / "out", tmp_path, 1)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_truncated_weight_file_fails_the_dry_run(folder, tmp_path):
    from test_config import dry_run, scheduled_jobs

    config = {**config_of(folder), "results": "results"}  # the dry run's target is results/report.md
    run = dry_run(tmp_path, config)
    assert run.returncode == 0, run.stderr[-3000:]
    assert scheduled_jobs(run.stdout)["download"] == 1
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)
    run = dry_run(tmp_path, config)
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert f"{weights} is truncated" in output and "copy it again" in output, output[-3000:]
    assert "Job stats" not in output
    assert not (tmp_path / "results").exists()


def as_on_a_node(workdir: Path, study: Path, job: str) -> subprocess.CompletedProcess:
    """One job as a cluster executor runs it on a node: Snakemake in --mode remote, which
    builds the DAG again from the same config for that one job (the arguments are those
    snakemake-interface-executor-plugins passes, less the ones about storage and logs)."""
    from test_config import SNAKEMAKE

    return subprocess.run(
        [*SNAKEMAKE, "--directory", str(workdir), "--configfile", str(study), "--target-jobs", job,
         "--allowed-rules", job.split(":")[0], "--cores", "1", "--force", "--nolock",
         "--ignore-incomplete", "--max-inventory-time", "0", "--mode", "remote"],
        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_job_on_a_cluster_node_names_what_changed_since_the_dag_was_built(folder, tmp_path):
    """The record is written by a local rule where the workflow starts; on the node the
    same config builds the DAG again and is compared with it before the job runs, also
    when the folder's new config.json makes another model id (which used to stop
    Snakemake itself: the job's wildcard no longer matched the id's constraint)."""
    from test_config import SNAKEMAKE, dry_run, scheduled_jobs

    config = {**config_of(folder), "results": "results"}
    model_id = Study.from_config(config).model_id
    planned = f"results/{model_id}/source.planned.json"
    study = tmp_path / "study.yaml"
    study.write_text(json.dumps(config))
    run = subprocess.run([*SNAKEMAKE, "--directory", str(tmp_path), "--configfile", str(study),
                          "--cores", "1", planned], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    download = f"download:model={model_id}"
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    edit_tensors(folder, lambda t: t["model.norm.weight"].mul_(2))
    run = as_on_a_node(tmp_path, study, download)
    assert run.returncode != 0
    assert (f"the model folder {folder} changed after the workflow built its DAG: {weights} "
            f"(rewritten with other contents, the same {size:,} bytes). The study was planned on "
            f"the files as they were (recorded in {planned} when the DAG was built)") in run.stderr
    # Where the workflow starts again, the study is planned on the folder as it is now
    # (the same model id, so the record's params are what changed), from the download on.
    run = dry_run(tmp_path, config)
    assert run.returncode == 0, run.stderr[-3000:]
    assert {"record_model_folder", "download"} <= set(scheduled_jobs(run.stdout))
    edit_config(folder, max_position_embeddings=1024)
    assert Study.from_config(config).model_id != model_id
    run = as_on_a_node(tmp_path, study, download)
    assert run.returncode != 0
    assert (f"{folder / 'config.json'} (max_position_embeddings 512 then, 1024 now); {weights} "
            f"(rewritten with other contents") in run.stderr, run.stderr[-3000:]
    assert "AttributeError" not in run.stderr
    assert not (tmp_path / "results" / model_id / "source").exists()


@pytest.mark.parametrize("architecture", ["llama-3.2-1b", "qwen2.5-0.5b", "smollm-135m", "smollm-360m"])
def test_the_shipped_architectures_as_transformers_saves_them_pass(architecture, tmp_path):
    """The tensors transformers saves for each shipped architecture (a tied head left
    out, as save_pretrained does) are the ones the checks expect, in their shapes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fourbit.inputs.model_folder import check_weights
    from fourbit.inputs.sources import model_config
    from fourbit.inputs.weight_headers import Tensor

    config = model_config({"source": "synthetic", "architecture": architecture, "layers": 2}, tmp_path)
    given = dict(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(given.pop("model_type"), **given))
    tensors = {name: Tensor("model.safetensors", "F32", tuple(t.shape))
               for name, t in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        del tensors["lm_head.weight"]
    assert check_weights(tmp_path, tensors, config) == config["vocab_size"]


def test_the_download_job_refuses_an_hf_snapshot_without_a_tokenizer(good, tmp_path):
    """An hf model has no folder before its download job: the job checks the snapshot."""
    from conftest import hub_cache
    from test_sources import REVISION, fetch_offline, model_files

    files = {name: data for name, data in model_files(good).items() if not name.startswith("tokenizer")}
    hub = hub_cache(tmp_path, "models--org--tiny", REVISION, files)
    spec = {"source": "hf", "repo_id": "org/tiny", "revision": REVISION, "trust_remote_code": False}
    run = fetch_offline(hub, spec, tmp_path / "out")
    assert run.returncode != 0
    assert f"FolderError: org/tiny@{REVISION}: no tokenizer (neither tokenizer.json" in run.stderr, \
        run.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.fixture
def own_tokenizer(tmp_path):
    """A tokenizer folder of its own (what model.tokenizer names): 300 ids, one added token."""
    folder = tmp_path / "tokenizer"
    save_tiny_tokenizer(folder)
    return folder


def with_tokenizer(folder: Path, tokenizer: Path) -> dict:
    config = config_of(folder)
    config["model"]["tokenizer"] = str(tokenizer)
    return config


def test_a_folder_without_a_tokenizer_runs_with_the_one_the_study_names(folder, own_tokenizer, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(ConfigError, match=r"or name a folder that holds them in the study's "
                                          "model.tokenizer"):
        Study.from_config(config_of(folder))
    (folder / "tokenizer.model").write_bytes(b"not a tokenizer: the study's replaces it")
    with pytest.raises(ConfigError, match="tokenizer.model: sentencepiece cannot load it"):
        Study.from_config(config_of(folder))
    study = Study.from_config(with_tokenizer(folder, own_tokenizer))
    spec = study.config["model"]
    planned = planned_record(spec, tmp_path / "source.planned.json")
    assert sorted(json.loads(planned.read_text())) == ["model", "tokenizer"]
    fetch_model(spec, tmp_path / "out", tmp_path, 1, model_id=study.model_id,
                corpus_id=study.corpus_id, planned=planned)
    out = tmp_path / "out"
    assert (out / "tokenizer.json").resolve() == own_tokenizer / "tokenizer.json"
    assert (out / "tokenizer_config.json").resolve() == own_tokenizer / "tokenizer_config.json"
    assert not (out / "tokenizer.model").exists()  # the model's own tokenizer files stay out
    assert (out / "model.safetensors").resolve() == folder / "model.safetensors"


def test_the_tokenizer_the_study_names_is_part_of_the_model_id(good, own_tokenizer):
    own = Study.from_config(config_of(good)).model_id
    named_one = Study.from_config(with_tokenizer(good, own_tokenizer)).model_id
    assert named_one != own
    save_tiny_tokenizer(own_tokenizer, vocab=299)
    assert Study.from_config(with_tokenizer(good, own_tokenizer)).model_id not in (own, named_one)


def test_the_tokenizer_the_study_names_is_checked_before_any_job(folder, own_tokenizer, tmp_path):
    config = with_tokenizer(folder, own_tokenizer)
    save_tiny_tokenizer(own_tokenizer, vocab=600)
    refused_with = rf"{named(own_tokenizer / 'tokenizer.json')}: the tokenizer's ids run up to 599, " \
                   r"but the model's embedding has 512 rows"
    with pytest.raises(ConfigError, match=refused_with):
        Study.from_config(config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (own_tokenizer / name).unlink()
    with pytest.raises(ConfigError, match=rf"^{named(own_tokenizer)}: no tokenizer \(neither "
                                          r"tokenizer.json, .*\), yet model.tokenizer names it as the "
                                          "tokenizer to use: point model.tokenizer at the folder"):
        Study.from_config(config)
    with pytest.raises(ConfigError, match=rf"^model.tokenizer: {named(tmp_path / 'nowhere')} is not "
                                          "a folder"):
        Study.from_config(with_tokenizer(folder, tmp_path / "nowhere"))


def test_a_hub_model_takes_the_tokenizer_the_study_names(good, own_tokenizer, tmp_path):
    """The Hub snapshot has no folder before its job: the named tokenizer is checked when
    the DAG is built against config.json's vocab_size, and linked in by the download."""
    from conftest import hub_cache
    from test_sources import REVISION, fetch_offline, model_files

    spec = {"source": "hf", "repo_id": "org/tiny", "revision": REVISION, "trust_remote_code": False,
            "tokenizer": str(own_tokenizer)}
    sources.check_local_folder(spec, {"vocab_size": 512})
    with pytest.raises(ConfigError, match="the tokenizer's ids run up to 299, but the model's "
                                          "embedding has 200 rows"):
        sources.check_local_folder(spec, {"vocab_size": 200})
    assert model_identity(spec, "c") != model_identity({**spec, "tokenizer": None}, "c")
    files = {name: data for name, data in model_files(good).items() if not name.startswith("tokenizer")}
    hub = hub_cache(tmp_path, "models--org--tiny", REVISION, files)
    run = fetch_offline(hub, spec, tmp_path / "out")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "out" / "tokenizer.json").resolve() == own_tokenizer / "tokenizer.json"
