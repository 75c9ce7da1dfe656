"""The wide layouts: a matrix an arm keeps on a wide grid (fourbit.quant.int8: its head
with ``quantize_head: 8``, its embedding table with ``quantize_embedding: 8``, the sets
``mixed_precision`` moves, to 8 bits or to 5 or 6) inside a checkpoint of any of the
4-bit formats.

    8 bits     weight_int8        int8   [N, K]       codes[n, k]
               weight_int8_scale  float  [N, K/G]     scales[n, g]
    b = 5, 6   weight_int<b>      uint8  [N, K/8, b]  8 codes + 2**(b-1) per b bytes,
                                                      code j in bits b*j..b*j+b-1
               weight_int<b>_scale float [N, K/G]     scales[n, g]

The checkpoint's format stores the 4-bit matrices as usual; a matrix in a wide layout
stores its tensors beside them, and the format's quantization_config lists it under
INT8_MODULES, which is how readers (the dense control, the reference engine, the vLLM
plugin) find it; INT_BITS names those on a 5- or 6-bit grid and their bits (the rest are
at 8). Every reader unpacks them to int8 codes (Int8Weight), so the file holds b bits per
weight and memory 8 (the vLLM plugin keeps an embedding table packed, unpacking the rows
it looks up). Ecosystems that read only the format itself (vLLM's own GPTQ kernel)
do not know the layouts, so such an arm is not given to them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fourbit.formats.base import Layout
from fourbit.layouts import TensorSpec
from fourbit.quant.int8 import BITS, WIDE_BITS, Int8Weight, max_code

INT8_MODULES = "fourbit_int8_modules"  # quantization_config key: the modules in a wide layout
INT_BITS = "fourbit_int_bits"  # {module: 5 or 6} for those not at 8 bits
# true when the input embedding is one of them at 8 bits; its bits (5 or 6) when narrower,
# since vLLM builds some embeddings without the name INT_BITS would give
INT8_EMBEDDING = "fourbit_int8_embedding"


class Int8Layout(Layout):
    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.name = f"int{bits}"
        limit = max_code(bits)
        self.codes, self.scales = f"weight_int{bits}", f"weight_int{bits}_scale"
        codes = (TensorSpec(self.codes, ("N", "K"), "int8", f"codes[n, k], -{limit}..{limit}")
                 if bits == BITS else
                 TensorSpec(self.codes, ("N", "K/8", str(bits)), "uint8",
                            f"bits {bits}j..{bits}j+{bits - 1} of bytes [n, i, :] = "
                            f"codes[n, 8i+j] + {limit + 1}"))
        self.layout = (codes, TensorSpec(self.scales, ("N", "K/G"), None, "scales[n, g]"))

    def pack(self, qw: Int8Weight) -> dict[str, torch.Tensor]:
        if qw.bits != self.bits:
            raise ValueError(f"{self.name}: a {qw.bits}-bit weight")
        codes = qw.codes if self.bits == BITS else _pack_codes(qw.codes, self.bits)
        return {self.codes: codes.contiguous(), self.scales: qw.scales.contiguous()}

    def unpack(self, tensors: Mapping[str, torch.Tensor], out_features: int, in_features: int,
               group_size: int) -> Int8Weight:
        t = self.checked(tensors, out_features, in_features, group_size)
        codes = t[self.codes] if self.bits == BITS else _unpack_codes(t[self.codes], self.bits)
        return Int8Weight(codes, t[self.scales], group_size, self.bits)


_ROWS = 1024  # rows packed at a time: a block's int64 words, not a whole head's


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes [N, K] of the b-bit grid -> uint8 [N, K/8, b]: 8 codes, offset to
    1..2**b - 1, side by side in one word of 8b <= 48 bits, cut into b bytes low byte first
    (by shifts, so the file is the same on any host)."""
    n, k = codes.shape
    code_shifts = torch.arange(8, dtype=torch.int64) * bits
    byte_shifts = torch.arange(bits, dtype=torch.int64) * 8
    out = torch.empty(n, k // 8, bits, dtype=torch.uint8)
    for r in range(0, n, _ROWS):
        offset = codes[r : r + _ROWS].to(torch.int64).view(-1, k // 8, 8) + max_code(bits) + 1
        words = (offset << code_shifts).sum(-1, keepdim=True)  # [R, K/8, 1]: disjoint bits
        out[r : r + _ROWS] = ((words >> byte_shifts) & 0xFF).to(torch.uint8)  # [R, K/8, b]
    return out


def _unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of _pack_codes: uint8 [N, K/8, b] -> int8 codes [N, K]."""
    n, words, _ = packed.shape
    code_shifts = torch.arange(8, dtype=torch.int64) * bits
    byte_shifts = torch.arange(bits, dtype=torch.int64) * 8
    out = torch.empty(n, words * 8, dtype=torch.int8)
    for r in range(0, n, _ROWS):
        word = (packed[r : r + _ROWS].to(torch.int64) << byte_shifts).sum(-1, keepdim=True)
        fields = (word >> code_shifts) & ((1 << bits) - 1)  # [R, K/8, 1] -> [R, K/8, 8]
        out[r : r + _ROWS] = (fields - max_code(bits) - 1).to(torch.int8).view(-1, words * 8)
    return out


WIDE_LAYOUTS = {bits: Int8Layout(bits) for bits in WIDE_BITS}
INT8 = WIDE_LAYOUTS[BITS]


def int8_modules(quantization_config: Mapping) -> list[str]:
    """The modules a checkpoint stores in a wide layout (none in one written before them)."""
    return list(quantization_config.get(INT8_MODULES, []))


def wide_bits(quantization_config: Mapping) -> dict[str, int]:
    """The bits of each module int8_modules names: 8 unless INT_BITS says 5 or 6."""
    narrower = quantization_config.get(INT_BITS, {})
    return {name: int(narrower.get(name, BITS)) for name in int8_modules(quantization_config)}


def embedding_bits(quantization_config: Mapping) -> int | None:
    """The bits of an input embedding kept on a wide grid (INT8_EMBEDDING), else None."""
    marked = quantization_config.get(INT8_EMBEDDING, False)
    return BITS if marked is True else int(marked) if marked else None
