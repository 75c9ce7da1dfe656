"""Build llama.cpp's CPU tools from the source llama-cpp-python's sdist vendors,
once per machine kind, and the command line that does it.

``ensure_llamacpp()`` returns the cached build (:mod:`fourbit.llamacpp.installed`),
or makes it: fetch the sdist with pip, checked against a pinned sha256
(:mod:`fourbit.llamacpp.sdist`), and build llama-quantize,
llama-bench, llama-imatrix, llama-server, fourbit-score (``scorer.cpp``; :mod:`fourbit.llamacpp.perplexity`
says why) and fourbit-imatrix (llama-imatrix reading token ids; :mod:`fourbit.llamacpp.imatrix`)
with CMake, CPU only, Release, static, no network
(:mod:`fourbit.llamacpp.cmake`, as :mod:`fourbit.llamacpp.recipe` says).
``converter_source()`` extracts only the converter from the same sdist, for the
config check on a machine that has not built llama.cpp yet.

Each folder is built under a temporary name and renamed when complete, so an
interrupted build never looks finished; a file lock makes concurrent jobs wait
for one build instead of building twice.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import signal
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

from fourbit.atomic import atomic_dir
from fourbit.llamacpp.cmake import compile_tools
from fourbit.llamacpp.installed import LlamaCpp, build_key, default_cache_root, find_llamacpp
from fourbit.llamacpp.recipe import LLAMA_CPP_COMMIT
from fourbit.llamacpp.sdist import CONVERTER_SOURCES, extract_tree, fetch_sdist
from fourbit.llamacpp.toolchain import require_build_tools
from fourbit.progress import setup_logging

log = logging.getLogger("fourbit")


def ensure_llamacpp(cache_root: Path | None = None, jobs: int | None = None) -> LlamaCpp:
    """The cached build for this machine and recipe, built first if there is none."""
    cache_root = Path(cache_root or default_cache_root())
    key = build_key()
    found = find_llamacpp(cache_root)
    if found:
        log.info("using the llama.cpp build in %s", found.root)
        return found
    require_build_tools()  # before the download and the build, not in the middle of it
    cache_root.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_root / f"{key}.lock"):
        found = find_llamacpp(cache_root)  # another job may have finished it while this one waited
        if found:
            return found
        _remove_interrupted_builds(cache_root, key)
        sdist = fetch_sdist(cache_root / "sdist")
        with atomic_dir(cache_root / key) as temp:
            compile_tools(sdist, temp, jobs or len(os.sched_getaffinity(0)))
        return LlamaCpp.at(cache_root / key).check_complete()


def converter_source(cache_root: Path | None = None) -> Path:
    """The pinned llama.cpp's converter sources, without building it: what the config check
    reads before any job on a machine whose first job will build llama.cpp. Extracted
    once from the same checked sdist the build uses (fetched now, so the build reuses it)."""
    cache_root = Path(cache_root or default_cache_root())
    tree = cache_root / f"converter-{LLAMA_CPP_COMMIT[:7]}"
    if (tree / CONVERTER_SOURCES[0]).is_file():
        return tree
    cache_root.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_root / f"{tree.name}.lock"):
        if not (tree / CONVERTER_SOURCES[0]).is_file():
            sdist = fetch_sdist(cache_root / "sdist")
            with atomic_dir(tree) as temp:
                extract_tree(sdist, temp, only=CONVERTER_SOURCES)
    return tree


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another job holds %s and is building llama.cpp; waiting for it", lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # the lock goes with the file handle


def _remove_interrupted_builds(cache_root: Path, key: str) -> None:
    """Delete temporaries of killed builds (atomic_dir names them .<key>.tmp-<pid>); only
    called under the lock, so none of them belongs to a running build."""
    for stale in cache_root.glob(f".{key}.tmp-*"):
        log.info("removing %s, left by an interrupted build", stale)
        shutil.rmtree(stale)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Build (or find) the cached llama.cpp tools; print their paths."
    )
    parser.add_argument("--cache-root", type=Path, help=f"default: {default_cache_root()}")
    parser.add_argument(
        "--jobs", type=int, help="parallel compile jobs (default: the usable cores)"
    )
    args = parser.parse_args()
    setup_logging()
    # `kill` (Snakemake cancelling a job) then unwinds like Ctrl-C: the compilers are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    tools = ensure_llamacpp(args.cache_root, args.jobs)
    print(json.dumps({k: str(v) for k, v in asdict(tools).items()}, indent=2))


if __name__ == "__main__":
    main()
