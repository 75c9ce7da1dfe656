"""The control: expand a quantized checkpoint back into a plain dense one.

Scoring the arm (4-bit weights run by a 4-bit kernel) and its dense expansion
(the same W_hat as ordinary float32 matrices) on one engine isolates the
runtime: if they disagree by more than rounding, the kernel or the packing is
wrong, not the quantizer. float32 because (q - z) * s is exact there and not in
bfloat16 (see fourbit.quant.qweight).
"""

from __future__ import annotations

import logging
import os

import torch

from fourbit.atomic import atomic_dir
from fourbit.checkpoint import write_checkpoint
from fourbit.quantized_checkpoint import read_quantized

log = logging.getLogger("fourbit")


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
