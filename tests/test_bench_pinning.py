"""Core pinning: the job's cores checked against its affinity, every thread moved and put back."""

from __future__ import annotations

import os

import pytest

from fourbit.bench.pinning import choose_cores, pinned


def test_more_cores_than_the_job_has_is_refused():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores in this process's affinity")
    with pytest.raises(ValueError, match="lists 2 cores but the job was given 1; run Snakemake"):
        choose_cores(cores[:2], threads=1)


def test_pinned_moves_every_thread_and_restores():
    import threading

    before = os.sched_getaffinity(0)
    core = min(before)
    seen = {}
    ready, done = threading.Event(), threading.Event()

    def worker():
        ready.set()
        done.wait()
        seen["worker"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=worker)
    thread.start()
    ready.wait()
    with pinned([core]):
        seen["main"] = os.sched_getaffinity(0)
        done.set()
        thread.join()
    assert seen == {"main": {core}, "worker": {core}}
    assert os.sched_getaffinity(0) == before
