"""Mixed precision by measured sensitivity: which sets of matrices an arm moves from its
4-bit grid to a wider one (``mixed_precision`` in the arm's quant: 8 bits, or also 5 and
6 with ``grids``).

The unit is a set of matrices vLLM runs as one layer (fourbit.quantizers.shapes.sibling_groups:
q/k/v, gate/up, and every other matrix alone, the head too), since a layer has one kernel;
a 4-bit input embedding table is a set of its own (a lookup error is not a matmul's, but
its KL per bit is measured the same way, so whether the table is worth more bits is
measured too, not assumed).
A set's sensitivity is measured, not guessed from its name as llama.cpp's K-quant mixes
do: the unquantized model in float32 with only that set rounded scores a few held-out
calibration windows, and the sensitivity is the mean over their positions of
KL(P_dense || P_set), exact from full logits (fourbit.metrics.kl.kl_full). Each set is
scored at its 4-bit W_hat and on each wide grid below 8 bits the arm offers; on the
8-bit grid what is left is taken as nothing, not measured. Then each set gets the grid
(4 bits, or a wide one) that makes the summed KL smallest within the budget (allocate, a
knapsack with one choice per set). Sets are measured one at a time, so what two sets
cost together is taken as the sum.

The extra bits are counted from each layout's table (Layout.stored_bits), the count the
checkpoint's bits per weight is made from, so the budget is what the file will show.

Measuring (measure_sets) and spending (promote_sensitive) are apart because only the
second depends on the budget: arms that differ only in ``extra_bits`` share one 4-bit pass
and one measurement (the workflow's sensitivity rule), and each budget costs an allocation
and the rounding of what moves.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fourbit.formats.base import Format
from fourbit.formats.int8 import WIDE_LAYOUTS
from fourbit.formats.table import table_layout
from fourbit.metrics.kl import kl_full
from fourbit.progress import Progress
from fourbit.quant.int8 import BITS, Int8Weight, quantize_int8
from fourbit.quant.qweight import QuantizedWeight
from fourbit.quantizers.shapes import sibling_groups

log = logging.getLogger("fourbit")


@dataclass(frozen=True)
class Wider:
    """One wide grid a set can move to."""

    bits: int
    kl: float  # what is left with the set on this grid, nats (8 bits: 0, not measured)
    extra_bits: int  # stored bits on this grid minus at 4 bits, over the set's members


@dataclass(frozen=True)
class Candidate:
    """One set of matrices that moves to a wider grid together, or stays at 4 bits."""

    members: tuple[str, ...]
    kl: float  # mean next-token KL from the dense model with only this set at 4 bits, nats
    wider: tuple[Wider, ...]

    @property
    def name(self) -> str:
        return "+".join(self.members)


Rounding = Callable[[str, torch.Tensor], torch.Tensor]  # (name, W [N, K]) -> W_hat [N, K]


def measure_kl(model_dir: Path, sets: list[list[str]], windows: torch.Tensor,
               roundings: Sequence[Rounding]) -> list[list[float]]:
    """Per rounding, per set: the mean next-token KL(P_dense || P_set) over ``windows``
    [W, T] (positions 0..T-2 of each), the model in float32 with only that set's weights
    replaced by their rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights = {name: model.get_submodule(name).weight for group in sets for name in group}

    def logprobs(window: torch.Tensor) -> torch.Tensor:
        logits = model(window[None]).logits[0, :-1]  # [1, T] -> [T-1, V]
        return torch.log_softmax(logits.float(), dim=-1)

    progress = Progress("sensitivity", len(sets) * len(roundings), "sets")
    with torch.inference_mode():
        dense = [logprobs(w) for w in windows]  # W x [T-1, V]
        positions = sum(len(d) for d in dense)
        kls = []
        for rounding in roundings:
            kls.append([])
            for group in sets:
                kept = {name: weights[name].clone() for name in group}
                for name in group:
                    weights[name].copy_(rounding(name, kept[name]))
                total = math.fsum(kl_full(d, logprobs(w)).sum().item()
                                  for d, w in zip(dense, windows))
                for name in group:
                    weights[name].copy_(kept[name])
                kls[-1].append(total / positions)
                progress.update(note=f"{'+'.join(group)}: KL {kls[-1][-1]:.3g}")
    return kls


ALLOCATION_STEPS = 1 << 16  # at most this many units of budget; each choice's cost rounded up


def allocate(candidates: list[Candidate], budget_bits: float) -> list[int]:
    """Each candidate's grid in bits (4: it stays) such that the summed KL is smallest
    while the extra stored bits stay within ``budget_bits``: a knapsack with one choice per
    set, solved by dynamic programming over the budget in units of the costs' greatest
    common divisor (exact), or, where that makes more than ALLOCATION_STEPS units, of
    budget / ALLOCATION_STEPS with each cost rounded up (never over the budget, at most
    one unit per set short of the best). Ties go to fewer bits."""
    common = math.gcd(*(w.extra_bits for c in candidates for w in c.wider))
    unit = max(common, budget_bits / ALLOCATION_STEPS)
    steps = int(budget_bits // unit)
    choices = [[(0, c.kl, 4)] + [(math.ceil(w.extra_bits / unit), w.kl, w.bits) for w in c.wider]
               for c in candidates]  # (units, KL left, bits) per choice, staying first
    best = np.zeros(steps + 1)  # [units]: least summed KL within that many units
    picked = np.zeros((len(candidates), steps + 1), dtype=np.int8)
    for i, options in enumerate(choices):
        trial = np.full((len(options), steps + 1), np.inf)  # [choice, units]
        for j, (units, kl, _) in enumerate(options):
            if units <= steps:
                trial[j, units:] = best[: steps + 1 - units] + kl
        picked[i] = trial.argmin(0)  # the first of equal ones: the fewest bits
        best = trial.min(0)
    bits, left = [], steps
    for i in reversed(range(len(candidates))):
        units, _, grid = choices[i][picked[i, left]]
        bits.append(grid)
        left -= units
    return bits[::-1]


def measure_sets(
    model_dir: Path,
    qweights: Mapping[str, QuantizedWeight],
    four_bit: Format,
    group_size: int,
    windows: torch.Tensor,
    grids: Sequence[int],
    *,
    embedding: str | None = None,
) -> list[Candidate]:
    """Every set of matrices of ``qweights`` (all on the 4-bit grid) as a candidate to move
    to each wide grid of ``grids`` (bits: 5, 6, 8): its measured KL on ``windows`` (held-out
    token windows [W, T]) at 4 bits and on each grid below 8, and what each move costs in
    stored bits.

    ``four_bit``: the arm's format, whose layout stores its 4-bit matrices (``embedding``,
    the input embedding's name if ``qweights`` holds its table, in table_layout's).
    """
    layouts = {name: table_layout(four_bit) if name == embedding else four_bit for name in qweights}
    sets = sibling_groups(list(qweights))
    measured = sorted(b for b in grids if b < BITS)

    def four(name: str, weight: torch.Tensor) -> torch.Tensor:
        return qweights[name].dequantize(torch.float32)

    def wide(bits: int) -> Rounding:
        return lambda name, weight: quantize_int8(weight, group_size, bits=bits).dequantize()

    def extra(bits: int, group: list[str]) -> int:
        # what the tables say each layout stores: the same count as the checkpoint's stats
        return sum(WIDE_LAYOUTS[bits].stored_bits(*qweights[name].shape, group_size)
                   - layouts[name].stored_bits(*qweights[name].shape, group_size) for name in group)

    kls = measure_kl(model_dir, sets, windows, [four, *(wide(b) for b in measured)])
    left = dict(zip(measured, kls[1:], strict=True))
    return [Candidate(tuple(group), kls[0][i],
                      tuple(Wider(b, left[b][i] if b in left else 0.0, extra(b, group))
                            for b in sorted(grids)))
            for i, group in enumerate(sets)]


def promote_sensitive(
    model_dir: Path,
    qweights: dict[str, QuantizedWeight],
    candidates: list[Candidate],
    quant: dict,
) -> tuple[dict[str, QuantizedWeight | Int8Weight], dict]:
    """``qweights`` with the sets of ``candidates`` (measure_sets') that allocate moves put
    on their wide grids within ``quant["mixed_precision"]["extra_bits"]`` per weight of
    ``qweights``, and the facts the arm's manifest records. A moved matrix is rounded from
    its unquantized weight."""
    from fourbit.checkpoints.hf import TensorReader

    spec, g = quant["mixed_precision"], quant["group_size"]
    weights = sum(q.shape[0] * q.shape[1] for q in qweights.values())
    chosen = allocate(candidates, spec["extra_bits"] * weights)
    moves = {c: next(w for w in c.wider if w.bits == bits)
             for c, bits in zip(candidates, chosen, strict=True) if bits != 4}
    moved = {name: w.bits for c, w in moves.items() for name in c.members}
    spent = sum(w.extra_bits for w in moves.values())
    log.info("mixed precision: %d of %d sets to wider grids (%s), +%.3f of %.3f bits per weight",
             len(moves), len(candidates),
             ", ".join(f"{sum(w.bits == b for w in moves.values())} at {b} bits"
                       for b in spec["grids"]), spent / weights, spec["extra_bits"])
    reader = TensorReader(model_dir)
    promoted = {name: quantize_int8(reader.get(f"{name}.weight").float(), g, bits=bits)
                for name, bits in sorted(moved.items())}
    facts = {
        "extra_bits": spec["extra_bits"],
        "extra_bits_spent": spent / weights,
        "grids": list(spec["grids"]),
        "moved": dict(sorted(moved.items())),
        "sets": [{"members": list(c.members), "kl": c.kl,
                  "wider": [{"bits": w.bits, "kl": w.kl,
                             "extra_bits_per_weight": w.extra_bits / weights} for w in c.wider],
                  "bits": bits}
                 for c, bits in zip(candidates, chosen, strict=True)],
    }
    return {**qweights, **promoted}, facts
