"""Write outputs under a temporary name and rename them into place when complete.

An interrupted job must never leave a file or folder that looks finished:
Snakemake (and a human) take an existing output to mean "done".
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; rename it onto ``path`` on success.

    Works for files and folders alike: the caller creates whatever it wants at
    the yielded path. On an exception the temporary is removed and ``path`` is
    left untouched.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_sibling(final)
    _remove(temp)
    try:
        yield temp
    except BaseException:
        _remove(temp)
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
