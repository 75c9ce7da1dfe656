"""The contention gate: refuses busy cores (a real pinned busy loop), passes quiet ones (faked)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fourbit.bench.contention import ContentionError, check_quiet, core_busy, wait_until_quiet


def fake_stat(*samples: dict[int, tuple[int, ...]]):
    """A /proc/stat reader returning the given samples in turn; each maps core -> fields."""
    texts = iter(
        "cpu  0 0 0 0 0 0 0 0 0 0\n"
        + "".join(f"cpu{core} {' '.join(map(str, fields))}\n" for core, fields in sample.items())
        + "intr 0\n"
        for sample in samples
    )
    return lambda: next(texts)


#                     user nice system idle iowait irq softirq steal guest guest_nice
START = {0: (1000, 0, 0, 1000, 0, 0, 0, 0, 0, 0), 1: (1000, 0, 0, 1000, 0, 0, 0, 0, 0, 0)}


def test_quiet_cores_pass_and_report_their_busy_fractions():
    after = {0: (1005, 0, 0, 1095, 0, 0, 0, 0, 0, 0), 1: (1008, 0, 2, 1090, 0, 0, 0, 0, 0, 0)}
    result = check_quiet([0, 1], threshold=0.2, override=False, window_s=0, read_stat=fake_stat(START, after))
    assert result == {"busy": {0: 0.05, 1: 0.10}, "threshold": 0.2, "override_used": False}


def test_iowait_is_idle_steal_is_busy_and_guest_is_not_counted_twice():
    # 50 idle + 50 iowait + 60 steal + 40 user, of which 40 guest (already inside user).
    after = {0: (1040, 0, 0, 1050, 50, 0, 0, 60, 40, 0)}
    busy = core_busy([0], window_s=0, read_stat=fake_stat({0: START[0]}, after))
    assert busy == {0: pytest.approx(100 / 200)}


def test_busy_core_with_override_is_recorded_not_refused():
    after = {0: (1090, 0, 0, 1010, 0, 0, 0, 0, 0, 0), 1: (1001, 0, 0, 1099, 0, 0, 0, 0, 0, 0)}
    result = check_quiet([0, 1], threshold=0.2, override=True, window_s=0, read_stat=fake_stat(START, after))
    assert result["override_used"] is True
    assert result["busy"][0] == pytest.approx(0.9)


def stepping_stat(busy_per_step: list[int]):
    """A reader whose core 0 is busy for busy_per_step[i] of 100 ticks in window i."""
    samples, user, idle = [], 1000, 1000
    samples.append({0: (user, 0, 0, idle, 0, 0, 0, 0, 0, 0)})
    for busy in busy_per_step:
        user, idle = user + busy, idle + 100 - busy
        samples += [{0: (user, 0, 0, idle, 0, 0, 0, 0, 0, 0)}] * 2  # each window's end, next start
    return fake_stat(*samples)


def test_settling_waits_until_the_cores_go_quiet_then_gives_up_after_its_timeout():
    # busy for two windows after the engines started (caches written back), then quiet
    waited = wait_until_quiet([0], 0.25, timeout_s=60, window_s=0,
                              read_stat=stepping_stat([80, 60, 5]))
    assert 0 <= waited < 60
    with pytest.raises(ContentionError, match=r"core 0 was still 90% busy \(threshold 25%\) after 0 s "
                                              r"of waiting after the start; .*allow_busy"):
        wait_until_quiet([0], 0.25, timeout_s=0, window_s=0, when="after the start",
                         read_stat=stepping_stat([90]))


def test_unknown_core_and_bad_threshold_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"cores \[7\] are not in /proc/stat \(online cores: \[0, 1\]\)"):
        core_busy([7], window_s=0, read_stat=fake_stat(START))
    with pytest.raises(ValueError, match=r"threshold is 20; it is a busy fraction in \(0, 1\]"):
        check_quiet([0], threshold=20, override=False)


def test_a_window_with_no_ticks_is_an_error_not_zero_busy():
    with pytest.raises(ValueError, match="core 0 accounted no time over a 0 s window"):
        core_busy([0], window_s=0, read_stat=fake_stat(START, START))


@pytest.fixture
def busy_loop_on_core_0():
    if 0 not in os.sched_getaffinity(0):
        pytest.skip("core 0 is not in this process's CPU affinity")
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(loop.pid, {0})
        time.sleep(0.3)  # let it start spinning before the window opens
        yield loop
    finally:
        loop.kill()
        loop.wait()


def test_a_real_busy_loop_pinned_to_core_0_is_refused_by_name(busy_loop_on_core_0):
    with pytest.raises(ContentionError) as refused:
        check_quiet([0], threshold=0.2, override=False, when="before pass 2")
    assert refused.value.core == 0
    assert refused.value.busy > 0.8  # a spinning loop leaves the core no idle time
    assert str(refused.value) == (
        f"core 0 is {refused.value.busy:.0%} busy (threshold 20%) before pass 2; "
        "rerun on quiet cores or set bench.allow_busy: true"
    )


def test_a_real_busy_loop_with_override_is_recorded(busy_loop_on_core_0):
    result = check_quiet([0], threshold=0.2, override=True)
    assert result["override_used"] is True
    assert result["busy"][0] > 0.8
