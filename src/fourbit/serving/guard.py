"""The leader of a server's process group: runs the server as its child and takes the
whole group down when the job that started it ends, even when that job is SIGKILLed.

    python -m fourbit.serving.guard <job pid> <server argv...>

PR_SET_PDEATHSIG reaches only the process it is set on, and a server is a tree (vLLM's
API server starts an engine core): setting it on the server itself left the engine core
running after its killed parent. Here the signal goes to this small process instead,
which is the group's leader and outlives nothing: on SIGTERM (from the kernel when the job
dies, or from the job's own stop) it signals the group, SIGKILLs what is left after a grace
period, and exits; it exits with the server's status when the server ends first.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
GRACE_S = 10.0


def _take_down_group(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM reaches this process too
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.1)
        except ChildProcessError:  # every child gone
            break
    os.killpg(0, signal.SIGKILL)  # this process included


def main(argv: list[str]) -> int:
    job_pid, command = int(argv[0]), argv[1:]
    signal.signal(signal.SIGTERM, _take_down_group)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != job_pid:  # the job died before the line above took effect
        return 1
    code = subprocess.call(command)
    if code < 0:  # the server died of a signal: so does this process, for the same status
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
