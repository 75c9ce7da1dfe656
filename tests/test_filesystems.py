"""What a filesystem has free, how each writer's "no space left" is recognised, and the
line a job's log ends with when the disk is full."""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

import pytest

from fourbit.filesystems import (
    DiskFull,
    Filesystem,
    explain_disk_full,
    filesystem,
    human,
    says_disk_full,
)


@pytest.mark.parametrize("size, text", [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"),
                                        (12_345_678_901, "12.3 GB"), (4.2e13, "42.0 TB")])
def test_human_counts_in_decimal_units(size, text):
    assert human(size) == text


def test_filesystem_of_a_path_not_made_yet_is_its_parents(tmp_path):
    here = filesystem(tmp_path)
    later = filesystem(tmp_path / "not" / "yet")
    assert later.mount == here.mount and later.kind == here.kind and here.kind != "unknown"
    assert 0 <= here.free <= here.size
    assert os.path.ismount(here.mount)


def _raised_from(cause: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise outer from inner
    except BaseException as chained:
        return chained


@pytest.mark.parametrize("error, full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (Exception("Error while serializing: I/O error: No space left on device (os error 28)"), True),
    (_raised_from(OSError(errno.ENOSPC, "No space left on device"), RuntimeError("write failed")), True),
    (OSError(errno.EACCES, "Permission denied"), False),
    (RuntimeError("unexpected pos 576 vs 534"), False),  # torch.save: caught by free space instead
])
def test_each_writers_no_space_left_is_recognised(error, full):
    assert says_disk_full(error) is full


def test_a_job_ends_its_log_with_what_it_needed(caplog, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", lambda *exc: None)  # stands for the traceback
    where = Filesystem(Path("/mnt/small"), "tmpfs", 0, 2_000_000)
    error = DiskFull(Path("results/m/arms/a/dense"), where, 1_900_000, ".dense.tmp-12")
    explain_disk_full(4.5)
    explain_disk_full(3.8)  # a second entry only takes the new figure
    with caplog.at_level(logging.ERROR, logger="fourbit"):
        sys.excepthook(DiskFull, error, None)
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage() == (
        "fourbit: the disk is full: writing results/m/arms/a/dense failed on /mnt/small (tmpfs), "
        "which had 0 B free of 2.0 MB when the write failed; the job had written 1.9 MB of "
        "this output (under .dense.tmp-12, now removed, so nothing finished-looking is left). "
        "This job's outputs need about 3.8 MB (its disk_mb, estimated from the model's "
        "parameters before any job). Free space there, or point results: elsewhere, then run "
        "Snakemake again: it reruns this job.")


def test_other_failures_end_as_they_did(caplog, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", lambda *exc: None)
    explain_disk_full(1.0)
    with caplog.at_level(logging.ERROR, logger="fourbit"):
        sys.excepthook(ValueError, ValueError("a bug"), None)
    assert caplog.records == []
