"""The inside of the sandbox: run as root by `unshare` in fresh network, mount and PID
namespaces, it narrows the view of the file system, drops to an unprivileged user and
runs the program as its child (fourbit.tasks.sandbox starts it and reads its report).

Run as ``python -I -S confine.py <settings as JSON>`` with the standard library only:
it runs under the interpreter's own install, not the project's virtual environment.
Writes one JSON line to the report descriptor when the program has started
({"ready": true}) and one when it has ended ({"exit": code} or {"signal": number}); a
failure before the program starts is reported as {"error": text}. The program cannot
write to that descriptor (it is closed in the child before exec).

Being PID 1 of the namespace, this process's end kills everything the program left
behind (a fork bomb's survivors included): the kernel SIGKILLs a PID namespace whose
init exits.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

# <linux/mount.h>
MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 0x2, 0x4, 0x20, 0x1000, 0x4000
MOUNT_ATTR_RDONLY, AT_RECURSIVE, AT_FDCWD = 0x1, 0x8000, -100
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added in Linux 5.12)
PR_SET_NO_NEW_PRIVS = 38

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _check(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags),
                      encode(data)), f"mount {target}")


def _read_only_everywhere() -> None:
    """Every mount of this namespace read-only, in one call (mount_setattr, recursive)."""
    attr = MountAttr(attr_set=MOUNT_ATTR_RDONLY)
    _check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                        ctypes.sizeof(attr)), "mount_setattr / read-only")


def _bind(source_fd: int, target: str) -> None:
    os.makedirs(target, exist_ok=True)
    _mount(f"/proc/self/fd/{source_fd}", target, None, MS_BIND | MS_REC)


def _reachable(path: str) -> bool:
    """Whether every folder on the way to ``path`` lets others through (o+x)."""
    parts = os.path.abspath(path).split(os.sep)[1:-1]
    return all(os.stat(os.sep + os.path.join(*parts[:i + 1])).st_mode & 0o001 for i in range(len(parts)))


def _under(path: str, places: list[str]) -> bool:
    path = os.path.abspath(path)
    return any(path == place or path.startswith(place.rstrip(os.sep) + os.sep) for place in places)


def _narrow_view(settings: dict) -> None:
    """The file system as the program sees it: the host's, read-only, with empty
    folders over the shared scratch places, the work folder at ``settings["cwd"]`` the
    only writable place, and the interpreter's install reachable where it lies."""
    work = os.open(settings["work"], os.O_PATH)
    prefix = os.open(settings["prefix"], os.O_PATH)
    reachable = _reachable(settings["prefix"])
    for place in settings["masked"]:  # e.g. /tmp: other jobs' files, sockets of services
        if os.path.isdir(place):
            _mount("tmpfs", place, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    if not reachable:
        # The interpreter lies under a folder others cannot enter (pyenv in /root): an
        # empty folder over that top-level folder, so the install can be put back alone.
        top = os.sep + os.path.abspath(settings["prefix"]).split(os.sep)[1]
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    if not reachable or _under(settings["prefix"], settings["masked"]):
        _bind(prefix, settings["prefix"])  # at its own path: its libpython is found by an absolute one
    _bind(work, settings["cwd"])
    _read_only_everywhere()
    _mount(None, settings["cwd"], None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)  # writable again
    os.close(work)
    os.close(prefix)


def _become_program(settings: dict, output: int) -> None:
    """In the forked child: limits, an unprivileged user, then the program (never returns)."""
    limits = settings["limits"]
    for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_NPROC", limits["processes"]),
                        ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_NOFILE", limits["open_files"]),
                        ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    # SIGXCPU at the soft limit; the hard limit, a second later, SIGKILLs a program that catches it.
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl no_new_privs")  # set-uid files stay inert
    os.setgroups([])
    os.setgid(settings["uid"])
    os.setuid(settings["uid"])
    os.chdir(settings["cwd"])
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    env = {"HOME": settings["cwd"], "TMPDIR": settings["cwd"], "PATH": "/usr/local/bin:/usr/bin:/bin",
           "LANG": "C.UTF-8"}
    os.execve(settings["argv"][0], settings["argv"], env)


def main() -> None:
    settings = json.loads(sys.argv[1])
    report = settings["report_fd"]
    os.set_inheritable(report, False)

    def tell(message: dict) -> None:
        os.write(report, (json.dumps(message) + "\n").encode())

    try:
        _narrow_view(settings)
        output = os.open(os.path.join(settings["cwd"], settings["output"]),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.chown(output, settings["uid"], settings["uid"])
    except OSError as error:
        tell({"error": str(error)})
        sys.exit(1)
    started, failed = os.pipe()  # closed on exec: EOF means the program started
    child = os.fork()
    if child == 0:
        try:
            os.close(started)
            _become_program(settings, output)
        except BaseException as error:  # noqa: BLE001 - whatever stopped it, the parent says so
            os.write(failed, f"{type(error).__name__}: {error}".encode())
        finally:
            os._exit(127)
    os.close(failed)
    why = os.read(started, 4096).decode()
    if why:
        os.waitpid(child, 0)
        tell({"error": f"the program did not start: {why}"})
        sys.exit(1)
    tell({"ready": True})
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        tell({"signal": os.WTERMSIG(status)})
    else:
        tell({"exit": os.WEXITSTATUS(status)})


if __name__ == "__main__":
    main()
