"""Stop a job at one point of its writing, for tests/test_faults.py to kill it there.

Python imports ``sitecustomize`` at start-up from the first folder on sys.path that has
one. tests/test_faults.py puts this folder first on PYTHONPATH for the Snakemake run it
starts, so every Python process of that run (Snakemake, each job's script) runs this
file; it does nothing unless FOURBIT_TEST_STOP_AT is set, and nothing in src/ reads that
variable. Its value is a JSON object:

    {"event": "open" | "os.rename", "path": a regular expression, "nth": 1, "marker": a path}

At the ``nth`` audit event of that kind (``open`` counts opens for writing only;
``os.rename`` is also the event of ``os.replace``, which fourbit.atomic renames with) whose
path (the file opened, the file renamed) matches ``path``, the process writes its pid
to ``marker`` and stops itself with SIGSTOP: what it wrote so far is on disk, what it was
about to write is not. The test then kills the run's whole process group (or lets the
job go on with SIGCONT). Audit events (PEP 578) come from the interpreter, so the point is
the same on every run: no timing, no polling race.
"""

import json
import os
import re
import signal
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND


def _writes(args) -> bool:
    """Whether an "open" event's (path, mode, flags) open the file for writing."""
    mode = args[1] if len(args) > 1 else None
    flags = args[2] if len(args) > 2 else 0
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(isinstance(flags, int) and flags & _WRITE_FLAGS)


def _install(spec: dict) -> None:
    pattern, event = re.compile(spec["path"]), spec["event"]
    seen = [0]

    def hook(name, args):
        if name != event or not args or seen[0] >= spec.get("nth", 1):
            return
        path = args[0]
        if not isinstance(path, (str, bytes, os.PathLike)) or not pattern.search(os.fsdecode(path)):
            return
        if event == "open" and not _writes(args):
            return
        seen[0] += 1
        if seen[0] == spec.get("nth", 1):
            fd = os.open(spec["marker"] + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.close(fd)
            os.replace(spec["marker"] + ".part", spec["marker"])
            os.kill(os.getpid(), signal.SIGSTOP)

    sys.addaudithook(hook)


if os.environ.get("FOURBIT_TEST_STOP_AT"):
    _install(json.loads(os.environ["FOURBIT_TEST_STOP_AT"]))
