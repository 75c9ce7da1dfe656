"""The weights' hash every downstream record carries (fourbit.hashing.model_weights_sha256)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from fourbit.hashing import file_sha256, model_weights_sha256


def _manifest(folder, files: dict[str, bytes]):
    """A source folder as fourbit.steps.prepare.fetch_model leaves it: weight files plus the manifest."""
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content)
    hashes = {name: file_sha256(folder / name) for name in files}
    manifest = folder / "fourbit-source.json"
    manifest.write_text(json.dumps({"spec": {"source": "path"}, "weights_sha256": hashes}))
    return manifest


def test_one_weight_file_gives_that_files_sha256(tmp_path):
    manifest = _manifest(tmp_path / "m", {"model.safetensors": b"weights"})
    assert model_weights_sha256(manifest) == file_sha256(tmp_path / "m" / "model.safetensors")


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils' sha256sum")
def test_shards_give_the_sha256_of_sha256sums_listing(tmp_path):
    names = ["model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"]
    manifest = _manifest(tmp_path / "m", {name: name.encode() * 3 for name in names})
    listing = subprocess.run(["sha256sum", *sorted(names)], cwd=tmp_path / "m", check=True,
                             capture_output=True).stdout
    expected = subprocess.run(["sha256sum"], input=listing, check=True,
                              capture_output=True).stdout.split()[0].decode()
    assert model_weights_sha256(manifest) == expected
    other = _manifest(tmp_path / "o", {names[0]: b"changed", names[1]: names[1].encode() * 3})
    assert model_weights_sha256(other) != expected


@pytest.mark.parametrize(
    "manifest, message",
    [
        ({"spec": {}}, "no weights_sha256 per weight file"),
        ({"weights_sha256": {}}, "no weights_sha256 per weight file"),
        ({"weights_sha256": {"model.safetensors": "abc"}},
         r"weights_sha256\['model.safetensors'\] must be a sha256 in lowercase hex"),
    ],
)
def test_a_manifest_without_weight_hashes_is_refused_by_name(tmp_path, manifest, message):
    path = tmp_path / "fourbit-source.json"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=message):
        model_weights_sha256(path)


def test_a_source_folders_weights_hash_is_its_manifests(tmp_path):
    from fourbit.inputs.sources import MANIFEST, source_weights_sha256

    digest = "ab" * 32
    (tmp_path / MANIFEST).write_text(json.dumps({"weights_sha256": {"model.safetensors": digest}}))
    assert source_weights_sha256(tmp_path) == digest
