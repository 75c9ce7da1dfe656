"""The `quantize` step: one arm's config applied to the untied checkpoint."""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path

from fourbit.atomic import atomic_dir, write_json
from fourbit.checkpoint import module_name, quantizable_linears, skeleton
from fourbit.quant.methods import QuantizeJob, get_method
from fourbit.quantized_checkpoint import matrix_shape, storage_stats, write_quantized
from fourbit.vllm_plugin import write_arm_knobs

log = logging.getLogger("fourbit")


class GroupSizeError(ValueError):
    """A layer whose input width the group size does not divide."""


def select_modules(
    model_dir: str | os.PathLike, quant: dict
) -> tuple[dict[str, tuple[int, int]], str | None]:
    """(module name -> (N, K) for every linear the arm quantizes, the input embedding's
    name if the arm quantizes it too), every width checked against the group."""
    model = skeleton(model_dir)
    linears = quantizable_linears(model)
    head = model.get_output_embeddings()
    chosen = {
        name: matrix_shape(module)
        for name, module in linears.items()
        if quant["quantize_head"] or module is not head
    }
    shapes = dict(chosen)
    embedding = None
    if quant.get("quantize_embedding"):
        table = model.get_input_embeddings()
        embedding = module_name(model, table)
        shapes[embedding] = matrix_shape(table)  # [V, H], grouped along H like a linear's K
    group = quant["group_size"]
    bad = [f"{name}: K={k} is not a multiple of group_size {group}"
           for name, (_, k) in shapes.items() if k % group]
    if bad:
        raise GroupSizeError(
            f"group_size {group} does not divide the input width of {len(bad)} layer(s):\n  "
            + "\n  ".join(bad[:10])
            + "\nchoose a group size that divides every input width (32, 64 or 128 usually do)"
        )
    return chosen, embedding


def quantize_checkpoint(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    arm_path: str | os.PathLike,
    arm: dict,
    *,
    calibration_text: str | os.PathLike | None = None,
    threads: int = 1,
) -> dict:
    quant = arm["quant"]
    method = get_method(quant["method"])
    linears, embedding = select_modules(model_dir, quant)  # fails before any expensive work
    started = time.monotonic()
    calibration = Path(calibration_text) if calibration_text else None
    job = QuantizeJob(Path(model_dir), linears, quant, calibration, threads, embedding)
    qweights, facts = method.quantize(job)
    seconds = time.monotonic() - started
    with atomic_dir(out_dir) as folder:
        write_quantized(folder, model_dir, qweights, method.format(quant), quant)
        write_arm_knobs(folder, quant)  # the plugin's per-arm kernel, into quantization_config
        stats = storage_stats(folder)
    manifest = {
        **arm,
        "format": method.format(quant),
        "method_facts": facts,
        "quantized_modules": sorted(qweights),
        "storage": stats,
        "quantize_seconds": round(seconds, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    write_json(arm_path, manifest)
    log.info("%s: %d modules, %.3f bits/weight in quantized layers, %.1fs",
             arm["id"], len(qweights), stats["quantized_bits_per_weight"], seconds)
    return manifest
