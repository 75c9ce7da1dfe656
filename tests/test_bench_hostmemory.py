"""The memory a bench job may still allocate: the host's, or less under its memory cgroup."""

from __future__ import annotations

import pytest

from fourbit.bench import hostmemory


@pytest.mark.parametrize(("membership", "files", "room_gib"), [
    # cgroup v2: the job's group sets no limit, its parent (a SLURM job's) does
    ("0::/slurm/job_7/step_0\n", {"slurm/job_7/memory.max": 6 << 30,
                                  "slurm/job_7/memory.current": 2 << 30,
                                  "slurm/job_7/step_0/memory.max": "max",
                                  "slurm/job_7/step_0/memory.current": 1 << 30}, 4),
    # cgroup v1 beside an empty v2 hierarchy (hybrid, as on this project's VMs)
    ("4:memory:/job\n0::/\n", {"memory/job/memory.limit_in_bytes": 3 << 30,
                              "memory/job/memory.usage_in_bytes": 1 << 30}, 2),
    # no limit anywhere: v1 writes its "unlimited" as a huge number
    ("4:memory:/job\n", {"memory/job/memory.limit_in_bytes": 9223372036854771712,
                         "memory/job/memory.usage_in_bytes": 1 << 30}, 16),
])
def test_the_memory_a_bench_may_use_is_capped_by_its_cgroup(tmp_path, membership, files, room_gib):
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {32 << 20} kB\nMemAvailable: {16 << 20} kB\n")
    (proc / "self" / "cgroup").write_text(membership)
    for name, value in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(f"{value}\n")
    assert hostmemory.available_memory_bytes(proc, cgroups) == room_gib << 30
