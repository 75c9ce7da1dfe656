"""workflow/rules/quantize.smk: the `quantize` rule (quantize_checkpoint: one arm's
config applied to the untied checkpoint), the `sensitivity` rule (measure_sensitivity:
the 4-bit pass and the measurement that mixed_precision arms differing only in their
budget share) and the `dequantize` rule (dequantize_checkpoint: the control).

The control expands a quantized checkpoint back into a plain dense one. Scoring the
arm (4-bit weights run by a 4-bit kernel) and its dense expansion (the same W_hat as
ordinary float32 matrices) on one engine isolates the runtime: if they disagree by
more than rounding, the kernel or the packing is wrong, not the quantizer. float32
because (q - z) * s is exact there and not in bfloat16 (see fourbit.quant.qweight).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fourbit import records
from fourbit.atomic import atomic_dir
from fourbit.checkpoints.hf import (
    TensorReader,
    module_name,
    quantizable_linears,
    skeleton,
    write_checkpoint,
)
from fourbit.checkpoints.quantized import (
    matrix_shape,
    read_quantized,
    storage_stats,
    write_quantized,
)
from fourbit.formats import get_format
from fourbit.quant.int8 import quantize_int8
from fourbit.quantizers.methods import QuantizeJob, get_method, heldout_tokens
from fourbit.quantizers.sensitivity import Candidate, Wider, measure_sets, promote_sensitive
from fourbit.quantizers.shapes import Matrices, plan_arm, shared_pass_quant
from fourbit.vllm_plugin import write_arm_knobs

log = logging.getLogger("fourbit")


class GroupSizeError(ValueError):
    """A layer whose input width the group size does not divide."""


@dataclass(frozen=True)
class Selection:
    """What an arm quantizes on this model, and how."""

    linears: dict[str, tuple[int, int]]  # module name -> (N, K): the method's 4-bit matrices
    embedding: str | None  # the input embedding's name, if the arm quantizes it too
    kept_dense: dict[str, tuple[int, int]]  # the linears its ``fallback: dense`` keeps dense
    eight_bit: dict[str, tuple[int, int]]  # the head and the embedding, with ``quantize_head: 8``
    # and ``quantize_embedding: 8`` (mixed_precision chooses its own 8-bit matrices later)


def select_modules(model_dir: str | os.PathLike, quant: dict) -> Selection:
    """Which matrices the arm quantizes, on the 4-bit grid of its method or on the 8-bit one.

    The plan is fourbit.quantizers.shapes.plan_arm's, the one the workflow made from
    config.json before any job, here on the model's real module tree."""
    model = skeleton(model_dir)
    table = model.get_input_embeddings()
    matrices = Matrices(
        linears={name: matrix_shape(module) for name, module in quantizable_linears(model).items()},
        head=module_name(model, model.get_output_embeddings()),
        embedding=module_name(model, table),
        embedding_shape=matrix_shape(table),  # [V, H], grouped along H like a linear's K
    )
    plan = plan_arm(matrices, quant)
    if plan.refusal:
        raise GroupSizeError(plan.refusal)
    eight_bit = ([matrices.head] if quant["quantize_head"] == 8 else []) + (  # (True == 8 is False)
        [matrices.embedding] if quant.get("quantize_embedding") == 8 else [])
    chosen = {name: shape for name, shape in plan.quantized.items()
              if name != matrices.embedding and name not in eight_bit}
    four_bit_table = quant.get("quantize_embedding") is True and matrices.embedding in plan.quantized
    return Selection(
        linears=chosen,
        embedding=matrices.embedding if four_bit_table else None,
        kept_dense=plan.kept_dense,
        eight_bit={name: plan.quantized[name] for name in eight_bit if name in plan.quantized},
    )


def _fallback_stats(folder: Path, stats: dict, kept_dense: dict[str, tuple[int, int]]) -> dict:
    """The linears ``fallback: dense`` kept unquantized, and the bits per weight over every
    matrix the arm was asked to quantize, those dense ones counted as stored (the table's
    ``quantized_bits_per_weight`` covers only the quantized ones)."""
    reader = TensorReader(folder)
    stored = {name: reader.get(f"{name}.weight") for name in kept_dense}
    dense_bits = sum(t.numel() * t.element_size() * 8 for t in stored.values())
    dense_weights = sum(t.numel() for t in stored.values())
    quantized_bits = stats["quantized_bits_per_weight"] * stats["linear_weights"]
    return {
        "fallback_dense": {name: list(shape) for name, shape in kept_dense.items()},
        "fallback_dense_weights": dense_weights,
        "bits_per_weight_with_fallback": (quantized_bits + dense_bits) / (stats["linear_weights"] + dense_weights),
    }


def _peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _job(model_dir, selection: Selection, quant: dict, calibration_text, threads: int) -> QuantizeJob:
    """What the arm's method reads: the checkpoint, the chosen matrices, the corpus split."""
    calibration = Path(calibration_text) if calibration_text else None
    return QuantizeJob(Path(model_dir), selection.linears, quant, calibration, threads,
                       selection.embedding)


def measure_sensitivity(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    record_path: str | os.PathLike,
    sensitivity: dict,
    *,
    calibration_text: str | os.PathLike | None = None,
    threads: int = 1,
) -> dict:
    """The shared pass of the mixed_precision arms that differ only in their budget: the
    method's 4-bit weights of every matrix they choose, written to ``out_dir`` in their
    format, and each set's measured KL and cost in stored bits, recorded at
    ``record_path`` (fourbit.quantizers.sensitivity.measure_sets).

    ``sensitivity``: {"id", "quant"}, the quant being shared_pass_quant's (no ``extra_bits``).
    """
    quant = sensitivity["quant"]
    method = get_method(quant["method"])
    selection = select_modules(model_dir, quant)  # fails before any expensive work
    started = time.monotonic()
    job = _job(model_dir, selection, quant, calibration_text, threads)
    qweights, facts = method.quantize(job)
    quantized = time.monotonic()
    windows = heldout_tokens(job)[: quant["mixed_precision"]["windows"]]  # [W, T]
    fmt = method.format(quant)
    candidates = measure_sets(job.model_dir, qweights, get_format(fmt), quant["group_size"],
                              windows, quant["mixed_precision"]["grids"],
                              embedding=selection.embedding)
    measured = time.monotonic()
    with atomic_dir(out_dir) as folder:
        write_quantized(folder, model_dir, qweights, fmt, quant)
    record = {
        **sensitivity,
        "format": fmt,
        "method_facts": facts,
        "windows": len(windows),
        "sets": [{"members": list(c.members), "kl": c.kl, "wider": [asdict(w) for w in c.wider]}
                 for c in candidates],
        "quantize_seconds": round(quantized - started, 2),
        "measure_seconds": round(measured - quantized, 2),
        "peak_rss_mib": _peak_rss_mib(),
    }
    records.write("sensitivity", record_path, record)
    log.info("%s: %d sets measured on %d windows; %.1fs quantizing, %.1fs measuring",
             sensitivity["id"], len(candidates), len(windows), record["quantize_seconds"],
             record["measure_seconds"])
    return record


def _spend_budget(model_dir: Path, quant: dict, embedding: str | None, four_bit: Path,
                  sensitivity_record: Path) -> tuple[dict, dict]:
    """A mixed_precision arm's weights from its shared pass (measure_sensitivity's
    checkpoint and record), and the facts its manifest records. ``embedding``: the input
    embedding's name if the arm puts its table on the 4-bit grid."""
    record = records.check("sensitivity", json.loads(sensitivity_record.read_text()),
                           sensitivity_record)
    if record["quant"] != shared_pass_quant(quant):
        raise ValueError(f"{sensitivity_record}: the pass of {record['quant']}, not of this "
                         f"arm's {shared_pass_quant(quant)}; run its sensitivity job for this "
                         "arm's quant")
    _, _, qweights = read_quantized(four_bit)
    measured = sorted(name for s in record["sets"] for name in s["members"])
    if sorted(qweights) != measured:
        raise ValueError(f"{four_bit} holds {len(qweights)} 4-bit matrices, but "
                         f"{sensitivity_record} measured {len(measured)}; both must come from "
                         "one sensitivity job")
    candidates = [Candidate(tuple(s["members"]), s["kl"], tuple(Wider(**w) for w in s["wider"]))
                  for s in record["sets"]]
    qweights, mixed = promote_sensitive(model_dir, qweights, candidates, quant)
    seconds = round(record["quantize_seconds"] + record["measure_seconds"], 2)
    mixed = {**mixed, "windows": record["windows"],
             "shared_pass": {"id": record["id"], "seconds": seconds,
                             "peak_rss_mib": record["peak_rss_mib"]}}
    facts = {**record["method_facts"], "mixed_precision": mixed}
    if embedding in mixed["moved"]:
        facts["embedding"] = f"rtn, {mixed['moved'][embedding]} bits (mixed precision)"
    return qweights, facts


def quantize_checkpoint(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    arm_path: str | os.PathLike,
    arm: dict,
    *,
    calibration_text: str | os.PathLike | None = None,
    shared_pass: tuple[str | os.PathLike, str | os.PathLike] | None = None,
    threads: int = 1,
) -> dict:
    """One arm's checkpoint and manifest. ``shared_pass``: for a mixed_precision arm, the
    checkpoint and the record of its sensitivity job (measure_sensitivity), whose 4-bit
    weights it starts from."""
    quant = arm["quant"]
    method = get_method(quant["method"])
    selection = select_modules(model_dir, quant)  # fails before any expensive work
    kept_dense = selection.kept_dense
    started = time.monotonic()
    if "mixed_precision" in quant:
        if shared_pass is None:
            raise ValueError(f"{arm['id']}: a mixed_precision arm starts from its sensitivity "
                             "job's pass; give its checkpoint and record as shared_pass")
        qweights, facts = _spend_budget(Path(model_dir), quant, selection.embedding,
                                        *map(Path, shared_pass))
    else:
        qweights, facts = method.quantize(_job(model_dir, selection, quant, calibration_text, threads))
    if selection.eight_bit:  # nothing is measured after the head or the table: no walk
        reader = TensorReader(model_dir)
        for name in selection.eight_bit:  # [N, K], or the table's [V, H]: groups along H
            qweights[name] = quantize_int8(reader.get(f"{name}.weight"), quant["group_size"])
        facts = {**facts, **{role: "rtn, 8 bits" for role, eight in
                             (("head", quant["quantize_head"] == 8),
                              ("embedding", quant.get("quantize_embedding") == 8)) if eight}}
    seconds = time.monotonic() - started
    with atomic_dir(out_dir) as folder:
        write_quantized(folder, model_dir, qweights, method.format(quant), quant)
        write_arm_knobs(folder, quant)  # the plugin's per-arm kernel, into quantization_config
        stats = storage_stats(folder)
        if kept_dense:
            stats.update(_fallback_stats(folder, stats, kept_dense))
    manifest = {
        **arm,
        "format": method.format(quant),
        "method_facts": facts,
        "quantized_modules": sorted(qweights),
        "storage": stats,
        "quantize_seconds": round(seconds, 2),
        "peak_rss_mib": _peak_rss_mib(),
    }
    records.write("arm", arm_path, manifest)
    log.info("%s: %d modules, %.3f bits/weight in quantized layers, %.1fs",
             arm["id"], len(qweights), stats["quantized_bits_per_weight"], seconds)
    return manifest


def dequantize_checkpoint(source: str | os.PathLike, target: str | os.PathLike) -> None:
    config, dense, qweights = read_quantized(source)
    tensors = {name: t.float() if t.is_floating_point() else t for name, t in dense.items()}
    for name, qweight in qweights.items():
        tensors[f"{name}.weight"] = qweight.dequantize(torch.float32)  # [N, K], exact in float32
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["torch_dtype"] = config["dtype"] = "float32"  # transformers 5 reads dtype, older torch_dtype
    with atomic_dir(target) as folder:
        write_checkpoint(folder, tensors, config, copy_from=source)
    log.info("%s: %d modules expanded to float32", source, len(qweights))
