"""The plugin's knobs: their defaults, what they run on this host, and how an arm's
knobs reach its checkpoint. The fourbit.vllm_plugin package doc says what each knob does.

Nothing here imports vLLM, so the engine's main process can describe a run cheaply.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

QUANT_METHOD = "fourbit_int4"

# Knobs read from quantization_config (defaults here). See the package doc.
DEFAULTS: dict[str, Any] = {
    "dequant_threshold": 64,  # rows (tokens in the step) from which the dense path is used
    "prefill_dequant": True,  # False: tinygemm for every batch size
    # True: the dense path reads W_hat out of the packed tinygemm tensors, so no second
    # copy of the weights is kept, and it is no slower than reading a kept copy
    # (docs/engines.md); shapes the layout does not cover keep a copy.
    "direct_dequant": True,
    "activation_dtype": "auto",  # compute dtype of both paths; "auto" = the model's dtype
    # Which kernel runs batches below the threshold, and with which numerics (kernels/
    # int4_cpu.py): "w4a16" fourbit's kernel, float activations, exact against the dense
    # control; "w4a8" the same weights with activations rounded to int8 per 32 columns,
    # integer dot products; "w4a8_group" rounded per weight group instead (one integer sum
    # per group: the fastest); "tinygemm" PyTorch's kernel. An arm sets it in
    # its quant block (hashed), the checkpoint carries it; w4a16 when absent because it is
    # the exact one. Falls back to tinygemm by name (logged) where the ISA or shape is missing.
    "kernel": "w4a16",
}
KNOBS = tuple(DEFAULTS)


def describe(knobs: dict[str, Any], model_dtype: str) -> str:
    """What runs a 4-bit linear for these knobs on this host, for the runtime string.

    No vLLM import (the engine's runtime() calls it in the main process). Shapes the
    kernel does not cover are only known at load; those layers log their fallback.
    """
    import torch

    from fourbit.kernels import int4_cpu, tinygemm

    requested, compute = knobs["activation_dtype"], compute_dtype(knobs, model_dtype)
    kernel = knobs["kernel"]
    if runs_fourbit_kernel(knobs):
        small = f"fourbit {kernel.upper()} kernel ({int4_cpu.paths(kernel)})"
        source = "its packed layout"
    else:
        dtype = tinygemm.kernel_dtype(getattr(torch, compute), requested)
        small = f"tinygemm {str(dtype).removeprefix('torch.')}"
        small += "" if tinygemm.vectorized(dtype) else " (scalar)"
        if kernel != "tinygemm":
            small += f", fourbit {kernel} unavailable (not built, or no AVX2+FMA)"
        # bfloat16 scales are not exact: the float32 dense path then reads a kept copy
        exact = dtype in (getattr(torch, compute), torch.float32)
        source = "the packed layout" if knobs["direct_dequant"] and exact else "a kept copy"
    if not knobs["prefill_dequant"]:
        return f"{small} for every batch"
    return f"{small} below {knobs['dequant_threshold']} rows, dense {compute} from {source} above"


def describe_int8(knobs: dict[str, Any], group_size: int, wide: dict[str, int]) -> str:
    """Which matrices a checkpoint keeps on wide grids (``wide``: module -> bits,
    fourbit.formats.wide_bits) and what runs them on this host (fourbit.vllm_plugin.ops,
    int8_linear) for these knobs: W8A8 where the kernel knob rounds activations to int8 and
    the group size allows it (FourbitInt8LinearMethod), else W8A16."""
    counts = []
    for bits in sorted(set(wide.values()), reverse=True):
        names = sorted(name for name, b in wide.items() if b == bits)
        which = ", ".join(names) if len(names) <= 3 else f"{len(names)} matrices"
        counts.append(f"{which} at {bits} bits")
    unpacked = ", 5/6-bit codes unpacked to int8" if min(wide.values()) < 8 else ""
    return f"{'; '.join(counts)} ({_runs_int8(knobs, group_size)}{unpacked})"


def _runs_int8(knobs: dict[str, Any], group_size: int) -> str:
    from fourbit.kernels import int4_cpu
    from fourbit.vllm_plugin.ops import INT8_DENSE_ROWS

    if int4_cpu.isa() == "none":
        return "exact W_hat, dense, for every batch (no AVX2+FMA kernel here)"
    w8a8 = knobs["kernel"] in int4_cpu.INT8_ACTIVATIONS and int4_cpu.w8a8_runs(group_size)
    small = (f"fourbit W8A8 kernel ({int4_cpu.path_int8(2, int8_activations=True)}) from "
             f"{int4_cpu.W8A8_MIN_ROWS} rows, W8A16 for one" if w8a8
             else f"fourbit W8A16 kernel ({int4_cpu.path_int8()})")
    return f"{small} below {INT8_DENSE_ROWS} rows, exact W_hat block by block above"


def compute_dtype(knobs: dict[str, Any], model_dtype: str) -> str:
    """The dtype both paths compute in: the model's unless activation_dtype names one."""
    requested = knobs["activation_dtype"]
    return model_dtype if requested == "auto" else requested


def runs_fourbit_kernel(knobs: dict[str, Any]) -> bool:
    """Whether small batches run fourbit's kernel here (else tinygemm, the fallback)."""
    from fourbit.kernels import int4_cpu

    return knobs["kernel"] in int4_cpu.NUMERICS and int4_cpu.isa() != "none"


def numerics(knobs: dict[str, Any], model_dtype: str, rows: int, eight_bit: bool = False) -> str:
    """How a forward of ``rows`` rows rounds what the dense expansion would not (the
    control's tolerance class, fourbit.report.rows): "exact", "bf16_activations" or
    "int8_activations". At or above dequant_threshold rows the dense path runs W_hat in
    the compute dtype; below it the small-batch kernel: W4A8 rounds activations to int8,
    tinygemm runs in bfloat16 where only that is vectorized (kernels/tinygemm.py).
    ``eight_bit``: the checkpoint holds matrices at 8 bits, which an int8 kernel knob runs
    with int8 activations (W8A8) from W8A8_MIN_ROWS to INT8_DENSE_ROWS rows whatever the
    threshold."""
    import torch

    from fourbit.kernels import int4_cpu, tinygemm
    from fourbit.vllm_plugin.ops import INT8_DENSE_ROWS

    compute = compute_dtype(knobs, model_dtype)
    if (eight_bit and knobs["kernel"] in int4_cpu.INT8_ACTIVATIONS and int4_cpu.isa() != "none"
            and int4_cpu.W8A8_MIN_ROWS <= rows < INT8_DENSE_ROWS):
        return "int8_activations"
    if knobs["prefill_dequant"] and rows >= knobs["dequant_threshold"]:
        dtype = compute
    elif runs_fourbit_kernel(knobs):
        if knobs["kernel"] in int4_cpu.INT8_ACTIVATIONS:
            return "int8_activations"
        dtype = compute
    else:
        kernel = tinygemm.kernel_dtype(getattr(torch, compute), knobs["activation_dtype"])
        dtype = str(kernel).removeprefix("torch.")
    return "exact" if dtype == model_dtype == "float32" else "bf16_activations"


# Knobs an arm's quant block carries (hashed into its id) and the checkpoint then holds.
ARM_KNOBS = ("kernel",)


def write_arm_knobs(folder: str | os.PathLike, quant: dict[str, Any]) -> None:
    """Copy the arm's plugin knobs from its quant block into the checkpoint's
    quantization_config (config.json), where vLLM hands them to the plugin."""
    from fourbit.atomic import write_json
    from fourbit.checkpoints.hf import read_config

    knobs = {k: quant[k] for k in ARM_KNOBS if k in quant}
    if not knobs:
        return
    config = read_config(folder)
    config["quantization_config"] = {**config["quantization_config"], **knobs}
    write_json(Path(folder) / "config.json", config)
