"""One server process: a free loopback port, started in its own process group, healthy or a
clear error, and stopped with everything it started.

A server is a tree of processes (vLLM's API server starts an engine core, which starts a
worker). Each is started as the leader of a new session, so its process group holds the
whole tree; stopping it signals the group, SIGTERM first and SIGKILL after a grace period,
and waits until no process of the group is left. That happens on leaving the context,
whether the job succeeded or failed, so no server outlives the job that started it.

A SIGTERM (Snakemake cancelling the job, SLURM's time limit) is turned into an exit while
servers run (:func:`exit_on_sigterm`), so the ``finally`` stops them. A job killed outright
(SIGKILL: no ``finally`` runs) is covered by each group's leader, fourbit.serving.guard,
which the kernel signals when the job dies and which then takes its whole group down.

A server that exits before it answers, or never answers within its time, fails with its
command line and the tail of its log: that is where the server says why.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"
# Run as a script by its path: it needs only the standard library, whatever the server's env.
GUARD = str(Path(__file__).with_name("guard.py"))
LOG_TAIL_LINES = 40
ERROR_LINES = 10
STOP_GRACE_S = 15.0


class ServerError(RuntimeError):
    """A server did not start, stopped answering or died; the message has its command line
    and its log's tail."""


class PortInUse(ServerError):
    """The port a server was to listen on is taken by another process."""


def free_port() -> int:
    """A loopback port no process listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def require_port_free(port: int) -> None:
    """PortInUse unless ``port`` can be bound on the loopback address: a server started on a
    taken port would fail late, or the load would go to whatever holds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError as e:
            raise PortInUse(f"port {port} on {LOOPBACK} is already in use ({e.strerror}); "
                            "stop what listens there or leave the port to free_port()") from e


def log_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The log's first error lines (a server's root cause often comes long before its last
    traceback: vLLM's engine core fails, then its API server), then its last ``lines``."""
    if not log_path.exists():
        return "(no log written)"
    text = log_path.read_text(errors="replace").splitlines()
    errors = [line for line in text[:-lines] if "Error" in line or "ERROR" in line][:ERROR_LINES]
    first = ["first error lines:", *errors, "...", "last lines:"] if errors else []
    return "\n".join(first + text[-lines:])


@dataclass
class RunningServer:
    """A server started by :func:`running_server`, answering at ``base_url``."""

    name: str
    command: list[str]
    base_url: str
    log_path: Path
    process: subprocess.Popen
    startup_s: float = 0.0

    @property
    def pgid(self) -> int:
        return self.process.pid  # the session leader's pid names its group

    def failure(self, what: str) -> ServerError:
        return ServerError(f"{self.name}: {what}\ncommand: {shlex.join(self.command)}\n"
                           f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")

    def check_alive(self) -> None:
        """ServerError if the server has exited (e.g. killed in the middle of a level)."""
        code = self.process.poll()
        if code is not None:
            raise self.failure(f"the server exited with status {code} while in use")


@contextlib.contextmanager
def running_server(name: str, command: Sequence[str], env: Mapping[str, str], port: int,
                   log_path: Path, *, health_path: str = "/health",
                   startup_timeout_s: float = 900.0) -> Iterator[RunningServer]:
    """Start ``command`` (which listens on ``port``), wait until GET ``health_path`` answers
    200, yield it, stop its process group on exit."""
    require_port_free(port)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([sys.executable, GUARD, str(os.getpid()), *command],
                                   env=dict(env), stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    server = RunningServer(name, list(command), f"http://{LOOPBACK}:{port}", log_path, process)
    try:
        server.startup_s = _wait_healthy(server, health_path, startup_timeout_s)
        yield server
    finally:
        stop_group(server.pgid, process)


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises SystemExit here, so the servers' contexts stop them; restored after."""
    def stop(signum, frame):
        raise SystemExit(f"stopped by signal {signum}")

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _wait_healthy(server: RunningServer, health_path: str, timeout_s: float) -> float:
    started = time.monotonic()
    while True:
        code = server.process.poll()
        if code is not None:
            raise server.failure(f"the server exited with status {code} before it answered")
        if _answers(server.base_url + health_path):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise server.failure(f"no answer from {server.base_url}{health_path} within "
                                 f"{timeout_s:.0f} s")
        time.sleep(0.5)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False  # not listening yet, or loading (llama-server answers 503)


def stop_group(pgid: int, leader: subprocess.Popen | None = None,
               grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group ``pgid``, SIGKILL what is left after ``grace_s``, and return
    once no process of the group remains (``leader`` is reaped on the way)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if leader is not None:
                leader.poll()
            if not group_alive(pgid):
                return
            time.sleep(0.1)
    raise ServerError(f"process group {pgid} still has processes after SIGKILL")


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is left (zombies not yet reaped count: their
    parent is gone with the group, and init reaps them)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            # fields[0] is the state, [2] the process group
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False
