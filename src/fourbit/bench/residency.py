"""Read the model files into the page cache and prove, with mincore(2), they are there.

A first run over a cold page cache times the storage: every weight page is read
from disk while the clock runs. Reading each file through beforehand fixes that
only if the cache can hold it all; mincore asks the kernel which pages of a
mapping are resident, so a model too big for free memory is caught rather than
timed half from disk.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value

_READ_CHUNK = 16 << 20


class ResidencyError(RuntimeError):
    """A file was not fully in the page cache after being read through."""


def resident_pages(path: str | os.PathLike) -> tuple[int, int]:
    """(resident, total) pages of ``path`` in the page cache.

    Mapping the file does not read it (no page is touched), so asking does not
    change the answer. An empty file has no pages: (0, 0).
    """
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == _MAP_FAILED:
            raise _libc_error("mmap", path)
        try:
            if _libc.mincore(addr, size, vec) != 0:
                raise _libc_error("mincore", path)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(byte & 1 for byte in vec), pages  # bit 0: resident; the rest are reserved


def _libc_error(call: str, path) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{call} on {path} failed: {os.strerror(errno)}")


def resident_fraction(path: str | os.PathLike) -> float:
    """Share of ``path``'s pages in the page cache; 1.0 for an empty file (nothing to miss)."""
    resident, total = resident_pages(path)
    return resident / total if total else 1.0


def warm_and_check(paths: list[Path], min_fraction: float = 0.99) -> dict:
    """Read every file (folders: every file inside) through, then verify it stayed cached.

    Raises ResidencyError naming the least-resident file if the overall resident
    fraction is below ``min_fraction``: then the page cache cannot hold the
    model, and a timed run would read weights from disk.
    """
    if not 0 < min_fraction <= 1:
        raise ValueError(
            f"min_fraction is {min_fraction}; it is a share of pages in (0, 1], e.g. 0.99"
        )
    files = _expand(paths)
    buffer = bytearray(_READ_CHUNK)
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    counts = {file: resident_pages(file) for file in files}
    fraction, total_bytes = _resident_share(counts)
    if fraction < min_fraction:
        worst = min((f for f in files if counts[f][1]), key=lambda f: counts[f][0] / counts[f][1])
        raise ResidencyError(
            f"only {fraction:.1%} of {len(files)} files ({total_bytes / 2**30:.2f} GiB) "
            f"stayed in the page cache after reading them (need {min_fraction:.0%}); "
            f"{worst} is {counts[worst][0] / counts[worst][1]:.1%} resident. "
            f"{_available_memory()} Free memory or bench a smaller model, or timings will read from disk"
        )
    return {"files": len(files), "bytes": total_bytes, "resident_fraction": fraction}


def cache_state(paths: list[Path]) -> dict:
    """The page-cache state of every file (folders: every file inside), read nothing, refuse
    nothing: for an engine held open across passes, which read its files once, at its
    start, so a later eviction cannot reach its timings (and reading its files again would
    only compete with the engines' own memory)."""
    files = _expand(paths)
    fraction, total_bytes = _resident_share({file: resident_pages(file) for file in files})
    return {"files": len(files), "bytes": total_bytes, "resident_fraction": fraction,
            "read_through": False}


def _resident_share(counts: dict[Path, tuple[int, int]]) -> tuple[float, int]:
    """(resident pages / pages over all files, their bytes) from {file: resident_pages}."""
    pages = sum(t for _, t in counts.values())
    fraction = sum(r for r, _ in counts.values()) / pages if pages else 1.0
    return fraction, sum(f.stat().st_size for f in counts)


def _expand(paths: list[Path]) -> list[Path]:
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{path} does not exist; pass model files or their folder")
    return files


def _available_memory() -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return f"The kernel reports {int(line.split()[1]) / 2**20:.2f} GiB available."
    return ""
