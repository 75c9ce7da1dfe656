"""Outputs appear under their final name only when complete: a failure, a full disk
included, leaves neither the output nor its temporary (the kills are in test_faults.py)."""

from __future__ import annotations

import errno

import pytest
import torch
from safetensors.torch import save_file

from conftest import mounted_tmpfs
from fourbit.atomic import atomic_dir, atomic_path, write_text
from fourbit.filesystems import DiskFull


def test_a_failure_leaves_neither_output_nor_temporary(tmp_path):
    with pytest.raises(ValueError), atomic_dir(tmp_path / "out") as folder:
        (folder / "half").write_text("x")
        raise ValueError("boom")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_is_replaced_whole(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("old")
    with atomic_dir(tmp_path / "out") as folder:
        (folder / "new").write_text("new")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new"]


# Each writer fourbit uses says "full" its own way: Python's OSError, safetensors' Rust
# error text, and torch.save, which says only "unexpected pos ...".
WRITERS = {
    "python": lambda path: path.write_bytes(b"0" * 3_000_000),
    "safetensors": lambda path: save_file({"w": torch.zeros(750_000)}, str(path)),
    "torch.save": lambda path: torch.save(torch.zeros(750_000), path),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_full_disk_says_so_and_leaves_nothing(tmp_path, writer):
    with mounted_tmpfs(tmp_path / "small", 1 << 20) as small:
        with pytest.raises(DiskFull) as raised, atomic_dir(small / "checkpoint") as folder:
            (folder / "config.json").write_text("{}")
            WRITERS[writer](folder / "model.safetensors")
        message = str(raised.value)
        assert raised.value.errno == errno.ENOSPC
        assert f"writing {small / 'checkpoint'} failed on {small} (tmpfs)" in message, message
        assert "free of 1.0 MB" in message and "nothing finished-looking is left" in message
        assert raised.value.written >= 2  # config.json's bytes at least, measured before removal
        assert list(small.iterdir()) == []  # neither the output nor its temporary


def test_a_failure_on_a_roomy_disk_stays_what_it_was(tmp_path):
    with pytest.raises(RuntimeError, match="not about space"), atomic_path(tmp_path / "f") as temp:
        temp.write_text("x")
        raise RuntimeError("not about space")
    write_text(tmp_path / "f", "done")
    assert (tmp_path / "f").read_text() == "done"


def test_a_killed_writers_temporary_goes_with_the_next_write(tmp_path):
    (tmp_path / ".out.tmp-999999").mkdir()  # a writer killed mid-way, long gone
    (tmp_path / ".out.tmp-999999" / "half").write_text("x")
    (tmp_path / ".out.json.tmp-1").write_text("another output's: kept")
    with atomic_dir(tmp_path / "out") as folder:
        (folder / "whole").write_text("y")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.json.tmp-1", "out"]
