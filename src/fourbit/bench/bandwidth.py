"""Memory bandwidth (a STREAM-like triad) and the decode roofline it implies.

Decoding one token reads every weight once, so tokens/s can be no higher than
bandwidth / weight bytes per token. Measuring the bandwidth on the same host and
threads lets a decode number be read as a fraction of that ceiling: near 1 the
build is memory-bound as it should be, far below it the kernel is the limit.

Counting convention (STREAM's): a = b + s*c moves three arrays per iteration,
two read and one written. With write-allocate caches the CPU also reads ``a``
before writing it (a fourth stream) unless it uses non-temporal stores, so the
bytes that really cross the memory bus may be up to 4/3 of the ones counted.
GB/s here is 10**9 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fourbit.threads import torch_threads

ARRAYS_COUNTED = 3
MIN_ARRAY_BYTES = 256 << 20
LLC_MULTIPLE = 8
_SCALAR = 3.0
_ELEMENT = torch.float32


def last_level_cache_bytes(cpu: int = 0) -> int:
    """Size of the largest data/unified cache level ``cpu`` reports in sysfs."""
    caches = Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*")
    data = [c for c in caches if (c / "type").read_text().strip() in ("Data", "Unified")]
    if not data:
        raise RuntimeError(f"no data cache listed under /sys/devices/system/cpu/cpu{cpu}/cache")
    top = max(data, key=lambda c: int((c / "level").read_text()))
    return _parse_size((top / "size").read_text().strip())


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def default_array_bytes() -> int:
    """8x the last-level cache, and at least 256 MiB, so no array fits in cache."""
    return max(LLC_MULTIPLE * last_level_cache_bytes(), MIN_ARRAY_BYTES)


def measure_bandwidth(
    bytes_per_array: int | None = None, repeats: int = 5, threads: int | None = None
) -> dict:
    """Best-of-``repeats`` triad bandwidth in GB/s, counting three arrays per iteration.

    ``bytes_per_array`` defaults to :func:`default_array_bytes`; anything smaller
    than 4x the last-level cache is refused, since it would time the cache.
    ``threads`` sets torch's intra-op threads for the measurement (and is restored
    afterwards); None keeps the current setting.
    """
    llc = last_level_cache_bytes()
    size = default_array_bytes() if bytes_per_array is None else bytes_per_array
    if size < 4 * llc:
        raise ValueError(
            f"bytes_per_array={size} is under 4x the last-level cache ({llc} bytes): the arrays "
            f"would stay in cache and the triad would time it; use at least {4 * llc} or the default"
        )
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; need at least 1 timed iteration")
    elements = size // _ELEMENT.itemsize
    with torch_threads(threads):
        # Filled, not just allocated: the first touch of each page faults it in,
        # which would otherwise be timed as part of the first iteration.
        a, b, c = (torch.full((elements,), v, dtype=_ELEMENT) for v in (0.0, 1.0, 2.0))
        torch.add(b, c, alpha=_SCALAR, out=a)  # untimed: warms threads and TLBs
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.add(b, c, alpha=_SCALAR, out=a)
            times.append(time.perf_counter() - start)
        used_threads = torch.get_num_threads()
    moved = ARRAYS_COUNTED * elements * _ELEMENT.itemsize
    return {
        "gbs": moved / min(times) / 1e9,
        "gbs_per_repeat": [moved / t / 1e9 for t in times],
        "bytes_per_array": elements * _ELEMENT.itemsize,
        "bytes_counted_per_iteration": moved,
        "arrays_counted": ARRAYS_COUNTED,
        "counting": "STREAM triad: 2 reads + 1 write; the write-allocate read of a is not counted",
        "last_level_cache_bytes": llc,
        "repeats": repeats,
        "threads": used_threads,
    }


def decode_roofline(
    weight_bytes_per_token: float, tokens_per_s: float, bandwidth_gbs: float
) -> dict:
    """How close a decode rate comes to the bandwidth limit.

    ``weight_bytes_per_token``: bytes read per decoded token (every weight once,
    plus scales and zero points; the KV cache is small at tg128 and left out).
    """
    for name, value in (
        ("weight_bytes_per_token", weight_bytes_per_token),
        ("tokens_per_s", tokens_per_s),
        ("bandwidth_gbs", bandwidth_gbs),
    ):
        if not value > 0:
            raise ValueError(f"{name} is {value}; it must be a positive number")
    effective = weight_bytes_per_token * tokens_per_s / 1e9
    return {
        "effective_gbs": effective,
        "bandwidth_gbs": bandwidth_gbs,
        "fraction_of_limit": effective / bandwidth_gbs,
        "limit_tokens_per_s": bandwidth_gbs * 1e9 / weight_bytes_per_token,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure memory bandwidth with a STREAM-like triad.")
    parser.add_argument("--mib", type=int, help="MiB per array (default: 8x LLC, at least 256)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's current setting)")
    args = parser.parse_args(argv)
    result = measure_bandwidth(args.mib << 20 if args.mib else None, args.repeats, args.threads)
    print(
        f"triad bandwidth: {result['gbs']:.1f} GB/s (best of {result['repeats']}, "
        f"{result['threads']} threads, 3 x {result['bytes_per_array'] >> 20} MiB arrays, "
        "STREAM counting)"
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
