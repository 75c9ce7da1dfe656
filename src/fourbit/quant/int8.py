"""The wide grids an arm can keep matrices on (its head with ``quantize_head: 8``, the sets
``mixed_precision`` moves): symmetric, per group, with b = 8 bits or, for the sets
mixed precision moves, 5 or 6 (``mixed_precision.grids``).

    codes   int8   [N, K]       -M..M with M = 2**(b-1) - 1 (127 at 8 bits), one per weight
    scales  float  [N, K // G]  each group's absmax / M, rounded to float16 first

and means  W_hat[n, k] = codes[n, k] * scales[n, k // G].

In memory every b is held as int8 codes, so one set of kernels runs them all; on disk a
5- or 6-bit grid is packed to its b bits (fourbit.formats.int8).

llama.cpp's Q8_0 is this grid with groups of 32 (and Q4_K_M keeps its output tensor at
6 bits or more); here the groups are the arm's own. The scale is rounded before the codes
are chosen, as on the 4-bit grid (fourbit.quant.grid), so what a checkpoint stores is what
was meant. An integer of at most 8 bits times a float16 scale needs at most 8 + 11
significant bits, so W_hat is exact in float32 and the dense control expands it exactly.
Plain rounding, no search and no held-out check: mixed precision measures what each grid
leaves (fourbit.quantizers.sensitivity), so a grid too coarse for a set is not chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fourbit.quant.qweight import check_groups

BITS = 8
WIDE_BITS = (5, 6, 8)  # the grids a matrix can be kept on besides the arm's 4-bit one


def max_code(bits: int) -> int:
    """The largest code of the symmetric b-bit grid: codes -M..M around 0 (2**b - 1 levels)."""
    if bits not in WIDE_BITS:
        raise ValueError(f"no {bits}-bit wide grid; there are {', '.join(map(str, WIDE_BITS))}")
    return (1 << (bits - 1)) - 1



@dataclass
class Int8Weight:
    codes: torch.Tensor  # int8 [N, K], within -max_code(bits)..max_code(bits)
    scales: torch.Tensor  # float16/bfloat16/float32 [N, K // G]
    group_size: int
    bits: int = BITS

    def __post_init__(self) -> None:
        check_groups(self.codes, self.group_size, scales=self.scales)
        if self.codes.dtype != torch.int8:
            raise ValueError(f"codes must be int8, got {self.codes.dtype}")
        limit = max_code(self.bits)
        if self.bits < BITS and self.codes.numel() and int(self.codes.abs().max()) > limit:
            raise ValueError(f"codes reach {int(self.codes.abs().max())}; the {self.bits}-bit "
                             f"grid holds -{limit}..{limit}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W_hat [N, K] computed in float32 (exact, see module doc), then cast."""
        n, k = self.shape
        grouped = self.codes.float().view(n, k // self.group_size, self.group_size)  # [N, K/G, G]
        return (grouped * self.scales.float().unsqueeze(-1)).view(n, k).to(dtype)

    def equal(self, other: "Int8Weight") -> bool:
        return (self.group_size == other.group_size and self.bits == other.bits
                and torch.equal(self.codes, other.codes)
                and self.scales.dtype == other.scales.dtype and torch.equal(self.scales, other.scales))


def quantize_int8(weight: torch.Tensor, group_size: int,
                  scale_dtype: torch.dtype = torch.float16, *, bits: int = BITS) -> Int8Weight:
    """Round W [N, K] to the nearest level of its group's symmetric ``bits``-bit grid."""
    limit = max_code(bits)
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group {group_size}")
    w = weight.float().view(n, k // group_size, group_size)  # [N, K] -> [N, K/G, G]
    scales = (w.abs().amax(-1) / limit).to(scale_dtype)  # [N, K/G], rounded before use
    step = scales.float()
    step = torch.where(step > 0, step, torch.ones_like(step))  # an all-zero group: codes 0
    codes = torch.round(w / step.unsqueeze(-1)).clamp(-limit, limit)
    return Int8Weight(codes.to(torch.int8).view(n, k), scales, group_size, bits)
