"""How much memory a job may still allocate: the host's, or its memory cgroup's.

A SLURM job limited to 16 GB on a 256 GB node sees the node's MemAvailable in
/proc/meminfo; only its cgroup (v1, v2, or both in a hybrid tree) knows the limit
the kernel will hold it to, so the tighter of the two is what a job can plan with.
"""

from __future__ import annotations

from pathlib import Path


def available_memory_bytes(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int:
    """What this job may still allocate: the host's MemAvailable, or less when the job's
    memory cgroup (a SLURM job's, a container's) has a limit nearer to what it uses."""
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
            break
    else:
        raise RuntimeError(f"{proc / 'meminfo'} has no MemAvailable line")
    room = _cgroup_room_bytes((proc / "self" / "cgroup").read_text(), cgroups)
    return available if room is None else min(available, room)


# (hierarchy of /proc/self/cgroup, its folder under /sys/fs/cgroup, limit file, usage file)
_CGROUP_MEMORY = (("", "", "memory.max", "memory.current"),  # v2, unified
                  ("", "unified", "memory.max", "memory.current"),  # v2 beside v1 (hybrid)
                  ("memory", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"))  # v1


def _cgroup_room_bytes(membership: str, cgroups: Path) -> int | None:
    """The tightest limit minus usage over this process's memory cgroups and their
    ancestors; None where none sets a limit ("max", or v1's huge no-limit number)."""
    rooms = []
    for line in membership.splitlines():
        _, controllers, path = line.split(":", 2)
        for hierarchy, folder, limit_file, usage_file in _CGROUP_MEMORY:
            if hierarchy not in controllers.split(","):
                continue
            group = cgroups / folder / path.lstrip("/")
            while True:
                limit, usage = group / limit_file, group / usage_file
                if limit.is_file() and usage.is_file():
                    text = limit.read_text().strip()
                    if text != "max" and int(text) < 1 << 60:
                        rooms.append(int(text) - int(usage.read_text()))
                if group == cgroups / folder or group == group.parent:
                    break
                group = group.parent
    return min(rooms) if rooms else None
