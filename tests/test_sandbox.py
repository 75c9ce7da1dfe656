"""The sandbox that runs model-written code, attacked the ways a completion can go wrong:
each run is real (unshare, a fresh interpreter, the kernel's limits)."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from fourbit.tasks import sandbox

ROOMY = sandbox.Limits(wall_seconds=20, cpu_seconds=10)  # room for a loaded machine; tests of a limit set it tight


pytestmark = pytest.mark.usefixtures("task_sandbox")


def _run(source: str, limits: sandbox.Limits = ROOMY, slot: int = 0) -> sandbox.Outcome:
    return sandbox.run(textwrap.dedent(source), slot=slot, limits=limits)


def _uid(slot: int) -> int:
    return sandbox.UID_BASE + (os.getpid() % 1000) * sandbox.UIDS_PER_PROCESS + slot


def test_processes_of_a_user_are_found_and_only_theirs():
    uid = _uid(63)
    with subprocess.Popen(["sleep", "30"], user=uid, group=uid) as sleeper:
        try:
            assert sandbox.processes_of(uid) == [sleeper.pid]
        finally:
            sleeper.kill()
    assert sandbox.processes_of(uid) == []


def test_a_correct_program_passes_and_a_wrong_one_fails_with_its_assertion():
    assert _run("assert sorted([3, 1, 2]) == [1, 2, 3]\n").status == "passed"
    wrong = _run("assert sum([1, 2]) == 4, 'sum is off'\n")
    assert (wrong.status, wrong.detail) == ("failed", "AssertionError: sum is off")


def test_a_program_that_exits_early_has_not_passed():
    outcome = _run("import sys\nsys.exit(0)\nassert False\n")
    assert outcome.status == "failed" and "exited before its tests finished" in outcome.detail


def test_the_work_folder_is_the_cwd_and_home_and_is_writable():
    outcome = _run("""
        import os
        open('notes.txt', 'w').write('kept')
        assert open(os.path.join(os.environ['HOME'], 'notes.txt')).read() == 'kept'
        assert os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'] == '/tmp/work'
        assert os.getuid() != 0 and os.getgroups() == []
    """)
    assert outcome.status == "passed", outcome.detail


@pytest.mark.slow
def test_a_hanging_program_times_out_within_the_wall_limit():
    start = time.monotonic()
    outcome = _run("while True:\n    pass\n", sandbox.Limits(wall_seconds=2, cpu_seconds=60))
    assert outcome.status == "timed out" and "wall-time" in outcome.detail
    assert 2 <= outcome.seconds < 4 and time.monotonic() - start < 60
    assert sandbox.processes_of(_uid(0)) == []


@pytest.mark.slow
def test_a_spinning_program_is_stopped_by_its_cpu_limit():
    outcome = _run("while True:\n    pass\n", sandbox.Limits(wall_seconds=60, cpu_seconds=1))
    assert outcome.status == "timed out" and "CPU limit" in outcome.detail


@pytest.mark.slow
def test_a_program_that_ignores_the_cpu_signal_is_killed_a_second_later():
    outcome = _run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",
                   sandbox.Limits(wall_seconds=60, cpu_seconds=1))
    assert outcome.status == "timed out" and "SIGKILL" in outcome.detail


@pytest.mark.slow
def test_a_fork_bomb_is_contained_and_leaves_no_process():
    outcome = _run("import os\nwhile True:\n    os.fork()\n", slot=3)
    assert outcome.status != "passed"
    assert sandbox.processes_of(_uid(3)) == []


def test_a_process_left_running_is_killed_with_the_run():
    outcome = _run("""
        import subprocess
        subprocess.Popen(['sleep', '300'], start_new_session=True)
    """, slot=1)
    assert outcome.status == "passed", outcome.detail
    assert sandbox.processes_of(_uid(1)) == []


def test_a_write_outside_the_work_folder_fails_and_the_file_does_not_appear(tmp_path):
    # One folder anyone may write to outside /tmp (only the read-only mount stops the
    # write there), and one under /tmp (hidden behind an empty folder as well).
    open_to_all = Path(tempfile.mkdtemp(dir=Path(__file__).parent, prefix=".sandbox-target-"))
    try:
        open_to_all.chmod(0o777)
        tmp_path.chmod(0o777)
        for folder in (open_to_all, tmp_path):
            target = folder / "escaped.txt"
            outcome = _run(f"open({str(target)!r}, 'w').write('out')\n")
            assert outcome.status == "failed" and "Errno" in outcome.detail, outcome.detail
            assert not target.exists()
    finally:
        for leftover in open_to_all.iterdir():
            leftover.unlink()
        open_to_all.rmdir()


def _visible_folder() -> Path:
    """A folder the sandbox shows, read-only: these tests' own, unless the checkout lies
    under a folder the sandbox masks (a clone in /tmp), where the write would fail for
    want of the folder instead of for the read-only mount."""
    here = Path(__file__).resolve().parent
    if any(here.is_relative_to(masked) for masked in sandbox.MASKED):
        return Path("/usr/local/share")
    return here


def test_a_user_namespace_of_its_own_does_not_unlock_the_mounts():
    target = _visible_folder() / "escaped.txt"
    outcome = _run(f"""
        import subprocess
        subprocess.run(['unshare', '--user', '--mount', 'sh', '-c', 'mount -o remount,rw /'])
        open({str(target)!r}, 'w').write('out')
    """)
    assert outcome.status == "failed" and "Read-only file system" in outcome.detail
    assert not target.exists()


def test_a_network_connection_fails_and_reaches_nothing():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        outcome = _run(f"""
            import socket
            socket.create_connection(('127.0.0.1', {port}), timeout=5)
        """)
        assert outcome.status == "failed" and "Errno" in outcome.detail, outcome.detail
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody came
    outside = _run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=5)\n")
    assert outside.status == "failed" and "unreachable" in outside.detail


def test_memory_beyond_the_limit_is_refused():
    outcome = _run("block = bytearray(2 << 30)\n", sandbox.Limits(memory_bytes=512 << 20))
    assert (outcome.status, outcome.detail) == ("failed", "MemoryError")


def test_a_crash_is_told_from_a_failure():
    outcome = _run("import ctypes\nctypes.string_at(0)\n")
    assert (outcome.status, outcome.detail) == ("crashed", "killed by SIGSEGV")


def test_the_programs_output_file_swapped_for_a_link_is_not_followed():
    outcome = _run("""
        import os
        os.remove('output.txt')
        os.symlink('/etc/passwd', 'output.txt')
        raise ValueError('done')
    """)
    assert outcome.status == "failed" and "root" not in outcome.detail


def test_a_slot_outside_the_range_is_refused():
    with pytest.raises(ValueError, match="slot 64"):
        sandbox.run("pass", slot=64)
