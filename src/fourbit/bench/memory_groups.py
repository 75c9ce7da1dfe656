"""Which engines held open for a bench job fit in memory together, and the groups that follow.

An engine that can stay open across passes (Bench.SESSION) is held open for the whole
job, every checkpoint's at once; when they would not fit together (a model of a
billion parameters, nine arms), the pairs are timed in groups that do, one group after
the other. The plan is made from an estimate of each engine's peak, before any engine
starts, so a pair that cannot fit even alone is refused instead of killed for memory.
"""

from __future__ import annotations

import os

from fourbit.bench.weight_bytes import resident_weight_bytes

# What one engine held open for the job costs beyond its weights: the process, its
# libraries and a KV cache sized for one bench sequence (a vLLM worker: ~0.7 GB
# for a 20 MB model).
ENGINE_OVERHEAD_BYTES = 1 << 30
# An engine's peak while it loads, as a multiple of the weights it then holds: vLLM
# allocates each parameter in the engine's dtype and copies the checkpoint's tensor
# into it, and the plugin repacks the 4-bit codes into the kernel's layout beside the
# loaded ones; the engines of a group start side by side, so their peaks add up.
# benchmarks/engine_memory.py checks it against each checkpoint format's real peak
# (every bench record carries both too; docs/measurement.md has the measurements). It
# holds while the GPTQ and compressed-tensors words are decoded as bytes
# (fourbit.formats.base.unpack_nibbles_int32): decoded as int32 they peak above it.
LOAD_PEAK_FACTOR = 2


def held_open_bytes(checkpoint: str | os.PathLike, dense_dtype: str) -> int:
    """The memory an engine held open for the job may take at its peak (its start)."""
    resident = resident_weight_bytes(checkpoint, dense_dtype)
    return LOAD_PEAK_FACTOR * resident + ENGINE_OVERHEAD_BYTES


def plan_groups(pairs: dict[str, set[str]], held: dict[str, int],
                available: int) -> list[list[str]]:
    """The pairs' names split, in order, into groups whose engines fit in memory together.

    ``pairs``: each pair's name and the keys of the engines it runs (its arm's and its
    baseline's; a baseline shared by several arms has one key). ``held``: the peak bytes
    of each engine kept open for the job, by key; engines started per pass are not held.
    One group when everything fits, the usual case: every arm is then interleaved with
    every other. Otherwise each group runs its rounds after the previous one closed its
    engines, a shared baseline reopened in each group; a pair that does not fit alone is
    refused before any engine starts.
    """
    groups: list[list[str]] = [[]]
    open_keys: set[str] = set()
    for name, engines in pairs.items():
        keys = engines & held.keys()
        alone = sum(held[key] for key in keys)
        if alone > available:
            raise MemoryError(
                f"bench pair {name} alone needs about {alone / 2**30:.1f} GiB with its "
                f"baseline (peak at the engines' start: {LOAD_PEAK_FACTOR}x the weights they "
                f"hold plus {ENGINE_OVERHEAD_BYTES / 2**30:.0f} GiB per engine) and "
                f"{available / 2**30:.1f} GiB is available; free memory, or run the bench "
                "on a machine with more"
            )
        if sum(held[key] for key in open_keys | keys) > available:
            groups.append([])
            open_keys = set()
        groups[-1].append(name)
        open_keys |= keys
    return groups
