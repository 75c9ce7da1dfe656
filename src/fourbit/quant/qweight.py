"""The one in-memory form every quantizer produces and every format stores.

A 4-bit group-wise weight is three tensors:

    codes  uint8  [N, K]       integer codes in 0..15, one per weight
    scales float  [N, K // G]  one scale per group of G consecutive input columns
    zeros  uint8  [N, K // G]  integer zero point in 0..15, one per group

and means  W_hat[n, k] = (codes[n, k] - zeros[n, k // G]) * scales[n, k // G].

N is the layer's output width (rows of nn.Linear.weight), K its input width.
A symmetric grid is the special case zeros == 8 everywhere: codes 0..15 stand for
the signed levels -8..7. Scales are rounded to ``scale_dtype`` *before* the codes
are chosen, so what a format stores is exactly what the quantizer meant.

Why dequantize in float32: (q - z) is an integer of magnitude <= 15 (4 bits) and
a float16 scale has an 11-bit significand, so their product needs at most 15
significant bits and is exact in float32 (24 bits). In bfloat16 (8 bits) it is
not: 7 * 0.0123 rounds. The dense control therefore expands to float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = 4
LEVELS = 1 << BITS  # 16 codes: 0..15
SYMMETRIC_ZERO = LEVELS // 2  # 8


def check_groups(codes: torch.Tensor, group_size: int, **per_group: torch.Tensor) -> None:
    """Codes [N, K] in groups of ``group_size`` along K, and one [N, K/G] tensor per group."""
    n, k = codes.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group {group_size}")
    want = (n, k // group_size)
    for name, tensor in per_group.items():
        if tuple(tensor.shape) != want:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {want} for codes "
                             f"{n}x{k} at group {group_size}")


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [N, K]
    scales: torch.Tensor  # float16/bfloat16/float32 [N, K // G]
    zeros: torch.Tensor  # uint8 [N, K // G]
    group_size: int

    def __post_init__(self) -> None:
        check_groups(self.codes, self.group_size, scales=self.scales, zeros=self.zeros)
        if self.codes.dtype != torch.uint8 or self.zeros.dtype != torch.uint8:
            raise ValueError("codes and zeros must be uint8")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W_hat [N, K] computed in float32 (exact, see module doc), then cast."""
        g = self.group_size
        zeros = self.zeros.repeat_interleave(g, dim=1).float()  # [N, K/G] -> [N, K]
        scales = self.scales.float().repeat_interleave(g, dim=1)  # [N, K/G] -> [N, K]
        return ((self.codes.float() - zeros) * scales).to(dtype)

    def equal(self, other: "QuantizedWeight") -> bool:
        return (
            self.group_size == other.group_size
            and torch.equal(self.codes, other.codes)
            and torch.equal(self.zeros, other.zeros)
            and self.scales.dtype == other.scales.dtype
            and torch.equal(self.scales, other.scales)
        )
