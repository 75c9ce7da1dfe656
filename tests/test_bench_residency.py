"""Page-cache residency measured with mincore(2) on real files."""

from __future__ import annotations

import os

import pytest

from fourbit.bench import residency
from fourbit.bench.residency import ResidencyError, cache_state, resident_fraction, warm_and_check

SIZE = 8 << 20


def drop_from_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped, so write them back first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(SIZE))
    path.read_bytes()
    return path


def test_a_file_just_written_and_read_is_resident(weights):
    assert resident_fraction(weights) >= 0.99


def test_dropped_pages_are_seen_and_warming_brings_them_back(weights):
    drop_from_cache(weights)
    dropped = resident_fraction(weights)
    if dropped > 0.5:
        pytest.skip(f"the kernel kept {dropped:.0%} of the pages after POSIX_FADV_DONTNEED")
    result = warm_and_check([weights])
    assert result == {"files": 1, "bytes": SIZE, "resident_fraction": pytest.approx(1.0, abs=0.01)}
    assert resident_fraction(weights) >= 0.99


def test_a_folder_means_every_file_in_it(tmp_path, weights):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "empty").write_bytes(b"")
    result = warm_and_check([tmp_path])
    assert result["files"] == 3
    assert result["bytes"] == SIZE + 2


def test_an_empty_file_is_fully_resident(tmp_path):
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert resident_fraction(empty) == 1.0


def test_a_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors does not exist"):
        warm_and_check([tmp_path / "nope.safetensors"])


def test_a_model_the_cache_cannot_hold_is_refused_naming_the_worst_file(weights, monkeypatch):
    # Stands in for a model larger than free memory: pages evicted as fast as they are read.
    monkeypatch.setattr(residency, "resident_pages", lambda path: (1, 4))
    with pytest.raises(ResidencyError, match=r"only 25\.0% of 1 files .*/model\.safetensors is 25\.0% resident"):
        warm_and_check([weights])


def test_the_cache_state_of_an_engine_held_open_is_recorded_not_refused(weights, monkeypatch):
    """An engine held open read its files at its start; evicted pages cannot reach it."""
    monkeypatch.setattr(residency, "resident_pages", lambda path: (1, 4))
    state = cache_state([weights])
    assert state["resident_fraction"] == 0.25 and state["read_through"] is False
    assert state["files"] == 1 and state["bytes"] == weights.stat().st_size
