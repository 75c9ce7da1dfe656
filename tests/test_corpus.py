import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import hub_cache

from fourbit.inputs.corpus import CORPUS_KINDS, SPLITS, register_corpus
from fourbit.steps.prepare import prepare_corpus

SRC = Path(__file__).resolve().parents[1] / "src"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    out = tmp_path_factory.mktemp("builtin") / "corpus"
    spec = {
        "source": "builtin",
        "max_bytes": 1_000_000,
        "calibration_fraction": 0.2,
        "evaluation_fraction": 0.2,
    }
    return spec, out, prepare_corpus(spec, out)


def test_builtin_writes_the_splits_the_manifest_describes(builtin):
    spec, out, manifest = builtin
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{s}.txt" for s in SPLITS] + ["manifest.json"]
    )
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["kind"] == "builtin" and manifest["spec"] == spec
    assert manifest["python_version"] == sys.version
    for split in SPLITS:
        facts = manifest["splits"][split]
        assert facts["bytes"] == (out / f"{split}.txt").stat().st_size
        assert facts["sha256"] == _sha256(out / f"{split}.txt")
        assert facts["documents"] == len(manifest["files"][split]) > 0


def test_builtin_takes_sorted_sources_within_the_cap_and_deals_whole_files(builtin):
    _, out, manifest = builtin
    taken = [name for split in SPLITS for name in manifest["files"][split]]
    assert len(taken) == len(set(taken)), "a file appears in two splits"
    assert sum(manifest["splits"][s]["bytes"] for s in SPLITS) <= 1_000_000 + 2 * len(taken)
    assert all(name.endswith(".py") for name in taken)
    for skipped in ("site-packages", "test", "tests", "idlelib", "__pycache__"):
        assert not any(skipped in name.split("/")[:-1] for name in taken)
    total = sum(manifest["splits"][s]["bytes"] for s in SPLITS)
    for split in ("calibration", "evaluation"):  # each filled to its fraction of the bytes
        assert manifest["splits"][split]["bytes"] >= 0.19 * total
    root = Path(manifest["source_root"])
    first = manifest["files"]["train"][0]
    assert (root / first).read_text(encoding="utf-8").rstrip("\n") in (
        out / "train.txt"
    ).read_text()


def test_builtin_is_reproducible(builtin, tmp_path):
    spec, _, manifest = builtin
    assert prepare_corpus(spec, tmp_path / "again") == manifest


def test_the_schema_checks_a_direct_call_too(tmp_path):
    """Library callers get the schema's refusals, not a half-made corpus."""
    with pytest.raises(ValueError, match="corpus.max_bytes: 1 is less than the minimum of 10000"):
        prepare_corpus({"source": "builtin", "max_bytes": 1}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_unknown_kind_names_the_allowed_kinds(tmp_path):
    with pytest.raises(
        ValueError, match=r"unknown corpus source 'wiki'.*\['builtin', 'file', 'hf'"
    ):
        prepare_corpus({"source": "wiki"}, tmp_path / "c")


def test_unknown_option_names_the_allowed_keys(tmp_path):
    with pytest.raises(ValueError, match="'max_byte' was unexpected.*allowed keys: .*max_bytes"):
        prepare_corpus({"source": "builtin", "max_byte": 10}, tmp_path / "c")


def test_kinds_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="registered twice"):
        register_corpus("file")(CORPUS_KINDS["file"])


def _paragraph_file(path: Path, count: int) -> list[str]:
    paragraphs = [f"def f{i}():\n    return {i}" for i in range(count)]
    path.write_text("\n\n".join(paragraphs) + "\n\n\n")
    return paragraphs


def test_file_kind_cuts_contiguous_blocks_with_evaluation_last(tmp_path):
    paragraphs = _paragraph_file(tmp_path / "text.txt", 20)
    spec = {
        "source": "file",
        "path": str(tmp_path / "text.txt"),
        "calibration_fraction": 0.1,
        "evaluation_fraction": 0.1,
    }
    manifest = prepare_corpus(spec, tmp_path / "c")
    assert manifest["paragraph_ranges"] == {
        "train": [0, 16],
        "calibration": [16, 18],
        "evaluation": [18, 20],
    }
    assert (tmp_path / "c/evaluation.txt").read_text() == "\n\n".join(paragraphs[18:]) + "\n"
    assert (tmp_path / "c/train.txt").read_text().startswith("def f0():\n    return 0\n\ndef f1():")
    assert manifest["selection_sha256"] == _sha256(tmp_path / "text.txt")


def test_file_kind_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.txt does not exist"):
        prepare_corpus({"source": "file", "path": str(tmp_path / "nowhere.txt")}, tmp_path / "c")


def test_file_kind_with_too_few_paragraphs_names_the_empty_split(tmp_path):
    _paragraph_file(tmp_path / "text.txt", 5)
    with pytest.raises(ValueError, match="split 'calibration' came out empty"):
        prepare_corpus({"source": "file", "path": str(tmp_path / "text.txt")}, tmp_path / "c")


def _hub_cache(root: Path, files: dict[str, bytes]) -> Path:
    """A hub cache holding ``files`` of dataset org/code at REVISION, as a download leaves it."""
    return hub_cache(root, "datasets--org--code", REVISION, files)


def _prepare_offline(hub: Path, spec: dict, out: Path) -> subprocess.CompletedProcess:
    """Run prepare_corpus in a fresh interpreter: huggingface_hub reads HF_* variables at import."""
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(hub),
        "HF_HOME": str(hub.parent),
        "HF_HUB_OFFLINE": "1",
    }
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    code = "import json, sys; from pathlib import Path; from fourbit.steps.prepare import prepare_corpus; "
    code += "print(json.dumps(prepare_corpus(json.loads(sys.argv[1]), Path(sys.argv[2]))))"
    return subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec), str(out)],
        env=env,
        capture_output=True,
        text=True,
    )


def test_hf_kind_reads_pinned_files_through_the_hub_cache(tmp_path):
    texts = {
        "train.txt": b"a = 1\n\nb = 2\n",
        "cal.txt": b"c = 3\n",
        "eval.txt": b"d = 4\n\ne = 5\n",
    }
    hub = _hub_cache(tmp_path, texts)
    spec = {
        "source": "hf",
        "repo_id": "org/code",
        "revision": REVISION,
        "files": {"train": "train.txt", "calibration": "cal.txt", "evaluation": "eval.txt"},
    }
    result = _prepare_offline(hub, spec, tmp_path / "c")
    assert result.returncode == 0, result.stderr
    manifest = json.loads(result.stdout.splitlines()[-1])
    assert manifest["revision"] == REVISION
    assert manifest["splits"]["evaluation"]["documents"] == 2
    assert (tmp_path / "c/train.txt").read_text() == "a = 1\n\nb = 2\n"


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_hf_kind_asks_for_pyarrow_to_read_parquet(tmp_path):
    hub = _hub_cache(tmp_path, {"t.parquet": b"PAR1 not really"})
    files = {split: "t.parquet" for split in SPLITS}
    spec = {"source": "hf", "repo_id": "org/code", "revision": REVISION, "files": files}
    result = _prepare_offline(hub, spec, tmp_path / "c")
    assert result.returncode != 0
    assert "needs pyarrow" in result.stderr and "envs/requirements.txt" in result.stderr


def test_hf_kind_refuses_an_unpinned_revision(tmp_path):
    files = {split: "x.txt" for split in SPLITS}
    with pytest.raises(ValueError, match="corpus.revision: 'main' does not match.*not pinned.*40-hex-digit"):
        prepare_corpus(
            {"source": "hf", "repo_id": "org/code", "revision": "main", "files": files},
            tmp_path / "c",
        )
