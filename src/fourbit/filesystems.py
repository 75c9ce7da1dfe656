"""What a filesystem has free, and the error a job ends with when one fills up.

A job that runs out of space must say so in numbers: which filesystem, how much it had
free, how much the job had written, how much the job needs. fourbit.atomic raises
DiskFull when writing an output under its temporary name fails on a full disk: it
measures the filesystem and the temporary before removing it, while the space is still
taken. The rule scripts' common entry (fourbit.progress.setup_logging) adds what the job
needs (its ``disk_mb``, estimated by fourbit.diskspace before any job) to the last line
of the log.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("fourbit")

# How the writers fourbit runs say "no space left": Python (OSError ENOSPC, or EDQUOT for
# a quota), safetensors' Rust writer ("No space left on device (os error 28)"), llama.cpp's
# tools (the C library's strerror in their output, which fourbit.llamacpp.ToolError quotes).
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "os error 28")
# A write that fails while its filesystem has less than this left is taken for a full disk
# whatever the writer said: torch.save, for one, says "unexpected pos 576 vs 534".
NEARLY_FULL = 1 << 20


@dataclass(frozen=True)
class Filesystem:
    """The filesystem a path lies on, as `df` shows it."""

    mount: Path  # where it is mounted
    kind: str  # its type: ext4, xfs, tmpfs, nfs, ...
    free: int  # bytes this process may still write (statvfs f_bavail)
    size: int  # bytes in all

    def __str__(self) -> str:
        return f"{self.mount} ({self.kind}, {human(self.free)} free of {human(self.size)})"


def human(size: float) -> str:
    """Bytes in decimal units, as `df -H` and disk makers count them: 12.3 GB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def existing_ancestor(path: str | os.PathLike) -> Path:
    """``path`` itself if it exists, else its nearest parent that does: where it would be
    written."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def filesystem(path: str | os.PathLike) -> Filesystem:
    """The filesystem ``path`` is (or would be) written on."""
    where = existing_ancestor(path).resolve()
    stats = os.statvfs(where)
    mount = where
    while not os.path.ismount(mount):
        mount = mount.parent
    return Filesystem(mount, _mount_kind(mount), stats.f_bavail * stats.f_frsize,
                      stats.f_blocks * stats.f_frsize)


def _mount_kind(mount: Path) -> str:
    """The type /proc/self/mounts gives the filesystem mounted at ``mount`` (the last
    mount there wins, as it hides the others); "unknown" where there is no such table."""
    kind = "unknown"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields = line.split()
        # spaces in mount points are written as \040
        if len(fields) > 2 and fields[1].replace("\\040", " ") == str(mount):
            kind = fields[2]
    return kind


def bytes_under(path: Path) -> int:
    """The bytes of a file, or of every file under a folder (links not followed)."""
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _chain(error: BaseException | None) -> list[BaseException]:
    """``error`` and every error it was raised from or while handling, in that order."""
    chain: list[BaseException] = []
    while error is not None and all(error is not e for e in chain):
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def says_disk_full(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, is a writer's "no space left"."""
    return any((isinstance(e, OSError) and e.errno in _FULL_ERRNOS)
               or any(text in str(e) for text in _FULL_TEXTS) for e in _chain(error))


class DiskFull(OSError):
    """Writing ``output`` failed because its filesystem is full."""

    def __init__(self, output: Path, where: Filesystem, written: int, temp_name: str):
        self.output, self.filesystem, self.written = output, where, written
        super().__init__(
            errno.ENOSPC,
            f"the disk is full: writing {output} failed on {where.mount} ({where.kind}), "
            f"which had {human(where.free)} free of {human(where.size)} when the write "
            f"failed; the job had written {human(written)} of this output (under "
            f"{temp_name}, now removed, so nothing finished-looking is left)",
        )


def disk_full(error: BaseException, output: Path, temp: Path) -> DiskFull | None:
    """The DiskFull that ``error`` (raised while writing ``output`` under ``temp``) is, or
    None. Call it before removing ``temp``: the space it takes is part of the story."""
    if isinstance(error, DiskFull):
        return error
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: not a write failing
        return None
    try:
        where = filesystem(temp)
    except OSError:
        return None
    if says_disk_full(error) or where.free < NEARLY_FULL:
        return DiskFull(output, where, bytes_under(temp), temp.name)
    return None


def explain_disk_full(need_mb: float | None) -> None:
    """End a job that fails on a full disk with one line saying so: the filesystem, its
    free bytes, what the job had written and, where the rule declares it (``disk_mb``),
    what the job needs in all. Installed by the rule scripts' common entry
    (fourbit.progress.setup_logging) as the hook Python calls on an uncaught exception,
    after the usual traceback; installed again, it only takes the new ``need_mb``."""
    if isinstance(sys.excepthook, _ExplainDiskFull):
        sys.excepthook.need_mb = need_mb
    else:
        sys.excepthook = _ExplainDiskFull(sys.excepthook, need_mb)


class _ExplainDiskFull:
    def __init__(self, previous, need_mb: float | None):
        self.previous, self.need_mb = previous, need_mb

    def __call__(self, kind, error, traceback) -> None:
        self.previous(kind, error, traceback)
        full = _disk_full_in(error)
        if full is None:
            return
        need = (f" This job's outputs need about {human(self.need_mb * 1e6)} (its disk_mb, "
                "estimated from the model's parameters before any job)." if self.need_mb else "")
        log.error("fourbit: %s.%s Free space there, or point results: elsewhere, then run "
                  "Snakemake again: it reruns this job.", full, need)


def _disk_full_in(error: BaseException) -> str | None:
    """What the job should say about a full disk, if ``error`` came from one: a DiskFull's
    own words, or for a "no space left" outside fourbit.atomic (a log, a cache) the
    filesystem of the file it names."""
    chain = _chain(error)
    for cause in chain:
        if isinstance(cause, DiskFull):
            return str(cause.strerror)
    for cause in chain:
        if isinstance(cause, OSError) and cause.errno in _FULL_ERRNOS and cause.filename:
            return f"the disk is full: writing {cause.filename} failed on {filesystem(cause.filename)}"
    if says_disk_full(error):
        return f"the disk is full ({error})"
    return None
