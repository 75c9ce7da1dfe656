"""The 8-bit layout: a matrix an arm keeps on the 8-bit grid (fourbit.quant.int8: its head
with ``quantize_head: 8``, its embedding table with ``quantize_embedding: 8``, the sets
``mixed_precision`` moves) inside a checkpoint of any
of the 4-bit formats.

The checkpoint's format stores the 4-bit matrices as usual; a matrix in this layout
stores its tensors beside them, and the format's quantization_config lists it under
INT8_MODULES, which is how readers (the dense control, the reference engine, the vLLM
plugin) find it. Ecosystems that read only the format itself (vLLM's own GPTQ kernel)
do not know the layout, so such an arm is not given to them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fourbit.formats.base import Layout
from fourbit.layouts import TensorSpec
from fourbit.quant.int8 import MAX_CODE, Int8Weight

INT8_MODULES = "fourbit_int8_modules"  # quantization_config key: the modules in this layout
INT8_EMBEDDING = "fourbit_int8_embedding"  # true when the input embedding is one of them


class Int8Layout(Layout):
    name = "int8"
    layout = (
        TensorSpec("weight_int8", ("N", "K"), "int8", f"codes[n, k], -{MAX_CODE}..{MAX_CODE}"),
        TensorSpec("weight_int8_scale", ("N", "K/G"), None, "scales[n, g]"),
    )

    def pack(self, qw: Int8Weight) -> dict[str, torch.Tensor]:
        return {"weight_int8": qw.codes.contiguous(), "weight_int8_scale": qw.scales.contiguous()}

    def unpack(self, tensors: Mapping[str, torch.Tensor], out_features: int, in_features: int,
               group_size: int) -> Int8Weight:
        t = self.checked(tensors, out_features, in_features, group_size)
        return Int8Weight(t["weight_int8"], t["weight_int8_scale"], group_size)


INT8 = Int8Layout()


def int8_modules(quantization_config: Mapping) -> list[str]:
    """The modules a checkpoint stores in the 8-bit layout (none in one written before it)."""
    return list(quantization_config.get(INT8_MODULES, []))
