"""Refuse to time a pass on cores that something else is already using.

On shared cores a benchmark times the scheduler, not the kernel: another job's
threads take turns with ours and the tokens/s drop by whatever share they got.
The gate samples the kernel's per-CPU time accounting (/proc/stat) over a short
window just before a pass, while the benchmark itself is idle, so any busy time
it sees belongs to someone else.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

StatReader = Callable[[], str]


class ContentionError(RuntimeError):
    """A core meant for timing was busy; ``core`` and ``busy`` say which and how much."""

    def __init__(self, message: str, core: int, busy: float):
        super().__init__(message)
        self.core, self.busy = core, busy


def read_proc_stat() -> str:
    return Path("/proc/stat").read_text()


def _jiffies(stat_text: str) -> dict[int, tuple[int, int]]:
    """Per-CPU (busy, total) jiffies from /proc/stat text.

    Fields: user nice system idle iowait irq softirq steal guest guest_nice. guest
    and guest_nice are already counted inside user and nice, so only the first
    eight add up to the total. Idle time is idle + iowait (a core waiting on I/O
    is free to run us); everything else is busy, steal included: steal is time
    the hypervisor gave our virtual CPU to another guest, which is contention too.
    """
    cores = {}
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        counts = [int(f) for f in fields[:8]]
        total = sum(counts)
        idle = counts[3] + counts[4]
        cores[int(name[3:])] = (total - idle, total)
    return cores


def core_busy(
    cores: list[int], window_s: float = 0.5, read_stat: StatReader = read_proc_stat
) -> dict[int, float]:
    """Fraction of ``window_s`` each core spent busy, from two /proc/stat samples."""
    before = _jiffies(read_stat())
    missing = sorted(set(cores) - set(before))
    if missing:
        raise ValueError(
            f"cores {missing} are not in /proc/stat (online cores: {sorted(before)}); "
            "pick cores from that list"
        )
    time.sleep(window_s)
    after = _jiffies(read_stat())
    busy = {}
    for core in cores:
        busy_delta = after[core][0] - before[core][0]
        total_delta = after[core][1] - before[core][1]
        if total_delta <= 0:
            raise ValueError(
                f"core {core} accounted no time over a {window_s} s window; "
                "use a window of at least 0.1 s (the kernel counts in 10 ms ticks)"
            )
        busy[core] = busy_delta / total_delta
    return busy


def check_quiet(
    cores: list[int],
    threshold: float,
    override: bool,
    *,
    when: str = "",
    starting: Sequence[str] = (),
    window_s: float = 0.5,
    read_stat: StatReader = read_proc_stat,
) -> dict:
    """Raise ContentionError if any core is busier than ``threshold`` (a fraction), or if
    ``starting`` names servers of the job still starting (the serve step's: a server loading
    or compiling its model is busy whether or not the half-second window caught it).

    ``when`` (e.g. "before pass 2") goes into the message. With ``override`` the
    gate lets the pass run and records ``override_used: True`` instead, so a
    result timed on busy cores says so.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold is {threshold}; it is a busy fraction in (0, 1], e.g. 0.2")
    busy = core_busy(cores, window_s, read_stat)
    if starting:
        busy = {core: 1.0 for core in busy}  # counted as fully busy
    busiest = max(busy, key=busy.get)
    too_busy = busy[busiest] > threshold
    if too_busy and not override:
        what = (f"servers {list(starting)} are still starting" if starting else
                f"core {busiest} is {busy[busiest]:.0%} busy (threshold {threshold:.0%})")
        raise ContentionError(
            f"{what}{' ' + when if when else ''}; rerun on quiet cores or set bench.allow_busy: true",
            core=busiest,
            busy=busy[busiest],
        )
    return {"busy": busy, "threshold": threshold, "override_used": too_busy}


def wait_until_quiet(cores: list[int], threshold: float, *, timeout_s: float, when: str = "",
                     window_s: float = 0.5, read_stat: StatReader = read_proc_stat) -> float:
    """Sample the cores until none is busier than ``threshold``, for at most ``timeout_s``;
    return the seconds waited. Engines that just started leave work behind them for a
    while (their compile caches written back to disk, compile worker pools winding down):
    the bench settles once before its first pass instead of refusing it. After
    ``timeout_s`` the cores are someone else's: ContentionError, as check_quiet says it."""
    start = time.monotonic()
    while True:
        busy = core_busy(cores, window_s, read_stat)
        busiest = max(busy, key=busy.get)
        if busy[busiest] <= threshold:
            return time.monotonic() - start
        if time.monotonic() - start >= timeout_s:
            raise ContentionError(
                f"core {busiest} was still {busy[busiest]:.0%} busy (threshold {threshold:.0%}) "
                f"after {timeout_s:.0f} s of waiting{' ' + when if when else ''}; rerun on quiet "
                "cores or set bench.allow_busy: true", core=busiest, busy=busy[busiest])


def gates_summary(gates: list[dict], threshold: float, allow_busy: bool) -> dict:
    """What the gates before a pair's passes saw: the threshold, whether the override was
    used, the busiest core."""
    return {"threshold": threshold, "allow_busy": allow_busy,
            "override_used": any(gate["override_used"] for gate in gates),
            "max_busy": max(max(gate["busy"].values()) for gate in gates)}
