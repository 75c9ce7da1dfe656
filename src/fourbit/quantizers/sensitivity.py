"""Mixed precision by measured sensitivity: which sets of matrices an arm moves from its
4-bit grid to the 8-bit one (``mixed_precision`` in the arm's quant).

The unit is a set of matrices vLLM runs as one layer (fourbit.quantizers.shapes.sibling_groups:
q/k/v, gate/up, and every other matrix alone, the head too), since a layer has one kernel;
a 4-bit input embedding table is a set of its own (a lookup error is not a matmul's, but
its KL per bit is measured the same way, so whether the table is worth 8 bits is measured
too, not assumed).
A set's sensitivity is measured, not guessed from its name as llama.cpp's K-quant mixes
do: the unquantized model in float32 with only that set at its 4-bit W_hat scores a few
held-out calibration windows, and the sensitivity is the mean over their positions of
KL(P_dense || P_set), exact from full logits (fourbit.metrics.kl.kl_full). Sets then move
to the 8-bit grid (fourbit.quant.int8) so that the KL they remove is largest within the
budget: in decreasing order of KL per extra stored bit, a set that no longer fits being
skipped for the next, unless taking one set first does better (allocate). Sets are
measured one at a time, so what two sets cost together is taken as the sum.

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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fourbit.formats.base import Format
from fourbit.formats.int8 import INT8
from fourbit.formats.table import table_layout
from fourbit.metrics.kl import kl_full
from fourbit.progress import Progress
from fourbit.quant.int8 import Int8Weight, quantize_int8
from fourbit.quant.qweight import QuantizedWeight
from fourbit.quantizers.shapes import sibling_groups

log = logging.getLogger("fourbit")


@dataclass(frozen=True)
class Candidate:
    """One set of matrices that can move to 8 bits together."""

    members: tuple[str, ...]
    kl: float  # mean next-token KL from the dense model with only this set at 4 bits, nats
    extra_bits: int  # stored bits at 8 bits minus at 4 bits, over the members

    @property
    def name(self) -> str:
        return "+".join(self.members)


def measure_kl(model_dir: Path, qweights: Mapping[str, QuantizedWeight],
               sets: list[list[str]], windows: torch.Tensor) -> list[float]:
    """Per set, the mean next-token KL(P_dense || P_set) over ``windows`` [W, T] (positions
    0..T-2 of each), the model in float32 with only that set's weights replaced by W_hat."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights = {name: model.get_submodule(name).weight for group in sets for name in group}

    def logprobs(window: torch.Tensor) -> torch.Tensor:
        logits = model(window[None]).logits[0, :-1]  # [1, T] -> [T-1, V]
        return torch.log_softmax(logits.float(), dim=-1)

    progress = Progress("sensitivity", len(sets), "sets")
    with torch.inference_mode():
        dense = [logprobs(w) for w in windows]  # W x [T-1, V]
        positions = sum(len(d) for d in dense)
        kls = []
        for group in sets:
            kept = {name: weights[name].clone() for name in group}
            for name in group:
                weights[name].copy_(qweights[name].dequantize(torch.float32))
            total = math.fsum(kl_full(d, logprobs(w)).sum().item() for d, w in zip(dense, windows))
            for name in group:
                weights[name].copy_(kept[name])
            kls.append(total / positions)
            progress.update(note=f"{'+'.join(group)}: KL {kls[-1]:.3g}")
    return kls


def _greedy(candidates: list[Candidate], budget_bits: float) -> list[Candidate]:
    """Most KL per extra bit first, skipping those that no longer fit."""
    chosen, spent = [], 0
    for c in sorted(candidates, key=lambda c: (-c.kl / c.extra_bits, c.name)):
        if c.kl > 0 and spent + c.extra_bits <= budget_bits:
            chosen.append(c)
            spent += c.extra_bits
    return chosen


def allocate(candidates: list[Candidate], budget_bits: float) -> list[Candidate]:
    """The candidates to move: the greedy choice by KL per bit, or one candidate taken first
    and the rest greedily, whichever removes the most KL (the greedy order alone can spend
    the budget on small sets and leave out one large set worth more, such as the head)."""
    options = [_greedy(candidates, budget_bits)]
    for first in candidates:
        if 0 < first.kl and first.extra_bits <= budget_bits:
            rest = [c for c in candidates if c is not first]
            options.append([first, *_greedy(rest, budget_bits - first.extra_bits)])
    return max(options, key=lambda chosen: (sum(c.kl for c in chosen), -sum(c.extra_bits for c in chosen)))


def measure_sets(
    model_dir: Path,
    qweights: Mapping[str, QuantizedWeight],
    four_bit: Format,
    group_size: int,
    windows: torch.Tensor,
    *,
    embedding: str | None = None,
) -> list[Candidate]:
    """Every set of matrices of ``qweights`` (all on the 4-bit grid) as a candidate to move
    to 8 bits: its measured KL on ``windows`` (held-out token windows [W, T]) and what
    moving it costs in stored bits.

    ``four_bit``: the arm's format, whose layout stores its 4-bit matrices (``embedding``,
    the input embedding's name if ``qweights`` holds its table, in table_layout's).
    """
    layouts = {name: table_layout(four_bit) if name == embedding else four_bit for name in qweights}
    sets = sibling_groups(list(qweights))
    kls = measure_kl(model_dir, qweights, sets, windows)
    candidates = []
    for group, kl in zip(sets, kls, strict=True):
        # what the tables say each layout stores: the same count as the checkpoint's stats
        extra = sum(INT8.stored_bits(*qweights[name].shape, group_size)
                    - layouts[name].stored_bits(*qweights[name].shape, group_size) for name in group)
        candidates.append(Candidate(tuple(group), kl, extra))
    return candidates


def promote_sensitive(
    model_dir: Path,
    qweights: dict[str, QuantizedWeight],
    candidates: list[Candidate],
    quant: dict,
) -> tuple[dict[str, QuantizedWeight | Int8Weight], dict]:
    """``qweights`` with the most sensitive sets of ``candidates`` (measure_sets') moved to
    the 8-bit grid within ``quant["mixed_precision"]["extra_bits"]`` per weight of
    ``qweights``, and the facts the arm's manifest records. A moved matrix is rounded from
    its unquantized weight."""
    from fourbit.checkpoints.hf import TensorReader

    spec, g = quant["mixed_precision"], quant["group_size"]
    weights = sum(q.shape[0] * q.shape[1] for q in qweights.values())
    chosen = allocate(candidates, spec["extra_bits"] * weights)
    moved = sorted(name for c in chosen for name in c.members)
    spent = sum(c.extra_bits for c in chosen)
    log.info("mixed precision: %d of %d sets to 8 bits, +%.3f of %.3f bits per weight",
             len(chosen), len(candidates), spent / weights, spec["extra_bits"])
    reader = TensorReader(model_dir)
    promoted = {name: quantize_int8(reader.get(f"{name}.weight").float(), g) for name in moved}
    facts = {
        "extra_bits": spec["extra_bits"],
        "extra_bits_spent": spent / weights,
        "eight_bit": moved,
        "sets": [{"members": list(c.members), "kl": c.kl,
                  "extra_bits_per_weight": c.extra_bits / weights, "eight_bit": c in chosen}
                 for c in candidates],
    }
    return {**qweights, **promoted}, facts
