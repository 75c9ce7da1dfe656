"""Write outputs under a temporary name and rename them into place when complete.

An interrupted job must never leave a file or folder that looks finished:
Snakemake (and a human) take an existing output to mean "done". A job killed outright
(SIGKILL, a node lost) leaves at most its hidden temporary, ``.<name>.tmp-<pid>``, which
the next write of the same path removes (a path has one writer at a time: Snakemake's
lock keeps two runs from making the same output, and llama.cpp's build holds its own
lock). A write that fails on a full disk raises fourbit.filesystems.DiskFull, saying so
in numbers (tests/test_faults.py does both to every kind of job).
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from fourbit.filesystems import disk_full


def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _temp_siblings(path: Path) -> list[Path]:
    """Every temporary of ``path``, whichever process made it."""
    prefix = f".{path.name}.tmp-"
    return [path.parent / name for name in os.listdir(path.parent)
            if name.startswith(prefix) and name[len(prefix):].isdigit()]


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; rename it onto ``path`` on success.

    Works for files and folders alike: the caller creates whatever it wants at
    the yielded path. On an exception the temporary is removed and ``path`` is
    left untouched; an exception from a full disk becomes DiskFull (measured before the
    temporary goes).
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_sibling(final)
    for stale in _temp_siblings(final):  # left by a killed writer, or by this pid before
        _remove(stale)
    try:
        yield temp
    except BaseException as error:
        full = disk_full(error, final, temp)
        _remove(temp)
        if full is not None and full is not error:
            raise full from error
        raise
    if final.is_dir() and not final.is_symlink():
        shutil.rmtree(final)  # a folder cannot be renamed over a non-empty one
    os.replace(temp, final)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Like :func:`atomic_path`, with the temporary folder already created."""
    with atomic_path(path) as temp:
        temp.mkdir()
        yield temp


def write_json(path: str | os.PathLike, data: Any) -> None:
    with atomic_path(path) as temp:
        temp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as temp:
        temp.write_text(text)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
