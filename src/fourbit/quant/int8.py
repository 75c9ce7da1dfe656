"""The 8-bit grid an arm can keep matrices on (its head with ``quantize_head: 8``, the sets
``mixed_precision`` moves): symmetric, per group.

    codes   int8   [N, K]       -127..127, one per weight
    scales  float  [N, K // G]  each group's absmax / 127, rounded to float16 first

and means  W_hat[n, k] = codes[n, k] * scales[n, k // G].

llama.cpp's Q8_0 is this grid with groups of 32 (and Q4_K_M keeps its output tensor at
6 bits or more); here the groups are the arm's own. The scale is rounded before the codes
are chosen, as on the 4-bit grid (fourbit.quant.grid), so what a checkpoint stores is what
was meant. An 8-bit integer times a float16 scale needs at most 8 + 11 significant bits,
so W_hat is exact in float32 and the dense control expands it exactly. Plain rounding:
at 255 levels no search is worth its cost, so no held-out check applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fourbit.quant.qweight import check_groups

BITS = 8
MAX_CODE = (1 << (BITS - 1)) - 1  # 127: codes -127..127, symmetric around 0


@dataclass
class Int8Weight:
    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float16/bfloat16/float32 [N, K // G]
    group_size: int

    def __post_init__(self) -> None:
        check_groups(self.codes, self.group_size, scales=self.scales)
        if self.codes.dtype != torch.int8:
            raise ValueError(f"codes must be int8, got {self.codes.dtype}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W_hat [N, K] computed in float32 (exact, see module doc), then cast."""
        n, k = self.shape
        grouped = self.codes.float().view(n, k // self.group_size, self.group_size)  # [N, K/G, G]
        return (grouped * self.scales.float().unsqueeze(-1)).view(n, k).to(dtype)

    def equal(self, other: "Int8Weight") -> bool:
        return (self.group_size == other.group_size and torch.equal(self.codes, other.codes)
                and self.scales.dtype == other.scales.dtype and torch.equal(self.scales, other.scales))


def quantize_int8(weight: torch.Tensor, group_size: int,
                  scale_dtype: torch.dtype = torch.float16) -> Int8Weight:
    """Round W [N, K] to the nearest level of its group's symmetric 8-bit grid."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group {group_size}")
    w = weight.float().view(n, k // group_size, group_size)  # [N, K] -> [N, K/G, G]
    scales = (w.abs().amax(-1) / MAX_CODE).to(scale_dtype)  # [N, K/G], rounded before use
    step = scales.float()
    step = torch.where(step > 0, step, torch.ones_like(step))  # an all-zero group: codes 0
    codes = torch.round(w / step.unsqueeze(-1)).clamp(-MAX_CODE, MAX_CODE)
    return Int8Weight(codes.to(torch.int8).view(n, k), scales, group_size)
