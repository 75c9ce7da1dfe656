"""The cores a bench job times on: chosen once for the job, every thread moved onto them.

Runs are comparable only on the same cores with the same thread count, and the
contention gate watches exactly these cores, so nothing of the job may run elsewhere:
not the engine's threads, nor the thread pools that existed before the pinning.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def choose_cores(cores: list[int] | None, threads: int) -> list[int]:
    """The CPUs to pin to: the config's, checked against the job, or the job's first ``threads``."""
    allowed = sorted(os.sched_getaffinity(0))
    if cores is None:
        return allowed[:threads]
    chosen = sorted(set(cores))
    outside = sorted(set(chosen) - set(allowed))
    if outside:
        raise ValueError(
            f"bench.cores {outside} are not available to this job; pick from {allowed}"
        )
    if len(chosen) > threads:
        raise ValueError(
            f"bench.cores lists {len(chosen)} cores but the job was given {threads}; "
            f"run Snakemake with --cores {len(chosen)} or more, or list fewer cores"
        )
    return chosen


@contextlib.contextmanager
def pinned(cores: list[int]) -> Iterator[None]:
    """Every thread of this process (and any it starts) on ``cores``; restored afterwards.

    sched_setaffinity(0) would move the calling thread only; thread pools that already
    exist (OpenMP's) must be moved one by one.
    """
    before = os.sched_getaffinity(0)
    _set_all_threads(set(cores))
    try:
        yield
    finally:
        _set_all_threads(before)


def _set_all_threads(cores: set[int]) -> None:
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cores)
