"""The 4-bit group grid: how a group of weights is given a scale and zero point.

One set of rounding rules, used by both round-to-nearest (``quantize_rtn`` below)
and GPTQ (``gptq.py``), so a code means the same thing whichever chose it.

Worked example (asymmetric, float16 scales), one group w = [-0.30, 0.05, 0.12, 0.45]:
    range  [lo, hi] = [min(w.min(), 0), max(w.max(), 0)] = [-0.30, 0.45]
    scale  (hi - lo) / 15 = 0.05, rounded to float16 first: 0.04998779296875
    zero   round(-lo / scale) = round(6.0015) = 6        (code 6 means exactly 0.0)
    codes  clamp(round(w / scale) + zero, 0, 15) = [0, 7, 8, 15]
    W_hat  (codes - zero) * scale = [-0.29993, 0.04999, 0.09998, 0.44989]
0.12 lands 0.02 away, inside the half step 0.025 that round-to-nearest allows.
Because the scale was rounded before the codes were chosen, storing it in float16
loses nothing: the format holds exactly the grid that was searched.

Symmetric convention: zero is fixed at 8, so codes 0..15 are the levels -8..7, and
scale = max(-lo / 8, hi / 7), the smallest step whose levels cover [lo, hi] without
clipping. (GPTQ's reference takes 2 * absmax / 15, which clips the largest positive
weight by absmax / 15 and leaves level -8 mostly unused.) With this choice the
unshrunk candidate clips nothing under either grid, and the shrink search alone
decides how much clipping pays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fourbit.quant.qweight import BITS, LEVELS, SYMMETRIC_ZERO, QuantizedWeight

MAXQ = LEVELS - 1  # 15, the largest code
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROW_CHUNK_ELEMS = 1 << 20  # RTN works on ~1M weights (4 MB float32) at a time


@dataclass(frozen=True)
class Grid:
    bits: int = BITS  # codes are nibbles: QuantizedWeight and the kernels know no other width
    group_size: int = 128  # 32/64/128: the sizes the formats and kernels implement
    sym: bool = False  # zero fixed at 8: no per-group zero to store or subtract, less range fit
    scale_dtype: torch.dtype = torch.float16  # what formats store; the search happens in it

    def __post_init__(self) -> None:
        if self.bits != BITS:
            raise ValueError(f"only {BITS}-bit grids are supported, got bits={self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size} is not one of {GROUP_SIZES}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype} is not one of {SCALE_DTYPES}")

    def n_groups(self, k: int, where: str = "") -> int:
        if k % self.group_size:
            prefix = f"{where}: " if where else ""
            raise ValueError(f"{prefix}K={k} is not a multiple of group {self.group_size}")
        return k // self.group_size

    def params(self, w: torch.Tensor, shrink: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) for each group w [..., G] -> two float32 [...] tensors.

        The range is shrunk by ``shrink`` (1.0 = full min/max). ``scale`` holds values
        exactly representable in scale_dtype; ``zero`` holds integers 0..15.
        """
        wmin, wmax = w.amin(-1), w.amax(-1)
        # A group of one repeated value c gets step |c| unshrunk: one level then holds c
        # exactly whenever c fits scale_dtype, where c / 15 would round.
        const = wmin == wmax
        shrink = torch.where(const, 1.0, shrink)
        lo, hi = wmin.clamp(max=0) * shrink, wmax.clamp(min=0) * shrink
        if self.sym:
            step = torch.maximum(-lo / SYMMETRIC_ZERO, hi / (MAXQ - SYMMETRIC_ZERO))
        else:
            step = (hi - lo) / MAXQ
        scale = torch.where(const, wmax.abs(), step).to(self.scale_dtype).float()
        if not torch.isfinite(scale).all():
            bad = step[~torch.isfinite(scale)][0].item()
            raise ValueError(f"group step {bad:.4g} does not fit a {self.scale_dtype} scale")
        # An all-zero group (or one below the dtype's smallest step) gets scale 1:
        # every weight then rounds to the zero code and is stored as exactly 0.
        scale = torch.where(scale == 0, 1.0, scale)
        if self.sym:
            zero = torch.full_like(scale, SYMMETRIC_ZERO)
        else:
            zero = torch.round(-lo / scale).clamp(0, MAXQ)
        return scale, zero

    def find_params(
        self,
        w: torch.Tensor,
        *,
        shrink_steps: int = 0,
        min_shrink: float = 0.5,
        importance: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Best (scale, zero) per group of w [..., G] over ranges shrunk 1.0 .. min_shrink.

        Tries shrink_steps + 1 evenly spaced factors, keeping per group the one with the
        least squared error, weighted per column by ``importance`` (broadcastable to w)
        if given. Factor 1.0 is tried first and kept on ties, so the result is never
        worse than plain min/max; shrink_steps=0 is plain min/max.
        """
        if shrink_steps < 0 or not 0 < min_shrink <= 1:
            raise ValueError(
                f"need shrink_steps >= 0 and 0 < min_shrink <= 1, got {shrink_steps}, {min_shrink}"
            )
        best_scale, best_zero = self.params(w)
        if shrink_steps == 0:
            return best_scale, best_zero
        best_err = self.error(w, best_scale, best_zero, importance)
        for i in range(1, shrink_steps + 1):
            scale, zero = self.params(w, 1 - (1 - min_shrink) * i / shrink_steps)
            err = self.error(w, scale, zero, importance)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
        return best_scale, best_zero

    def error(self, w, scale, zero, importance=None) -> torch.Tensor:
        """Squared error of each group of w [..., G] on its grid -> [...]."""
        scale, zero = scale.unsqueeze(-1), zero.unsqueeze(-1)
        sq = (self.dequantize(self.quantize(w, scale, zero), scale, zero) - w).square_()
        return (sq if importance is None else sq * importance).sum(-1)

    @staticmethod
    def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Codes (float32, integers 0..15) of w on the grid; scale/zero broadcast to w."""
        return torch.clamp(torch.round(w / scale) + zero, 0, MAXQ)

    @staticmethod
    def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """(codes - zero) * scale in float32: QuantizedWeight.dequantize's arithmetic."""
        return (codes - zero) * scale

    def pack(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        """Codes [N, K], scales and zeros [N, K/G] -> the stored form, a QuantizedWeight."""
        scales, u8 = scales.to(self.scale_dtype), torch.uint8
        return QuantizedWeight(codes.to(u8), scales, zeros.to(u8), self.group_size)


def quantize_rtn(
    weight: torch.Tensor,
    grid: Grid,
    *,
    shrink_steps: int = 20,
    min_shrink: float = 0.5,
    importance: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Round each weight [N, K] to the nearest level of its group's best grid.

    ``importance`` [K] weights each input column's squared error in the range search;
    pass the Hessian diagonal (calibration activations' second moments) for the
    activation-aware variant. Rows go in chunks so a 151936 x 896 head needs only a
    few times 4 MB of temporaries beyond its codes.
    """
    n, k = weight.shape
    g, n_groups = grid.group_size, grid.n_groups(k)
    if importance is not None:
        if importance.shape != (k,) or not (torch.isfinite(importance) & (importance >= 0)).all():
            raise ValueError(
                f"importance must be finite, >= 0 and of shape ({k},), "
                f"got {tuple(importance.shape)}"
            )
        importance = importance.float().view(n_groups, g)  # [K] -> [K/G, G], broadcast over rows
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, n_groups)
    zeros = torch.empty(n, n_groups)
    rows = max(1, ROW_CHUNK_ELEMS // k)
    for r in range(0, n, rows):
        w = weight[r : r + rows].float().view(-1, n_groups, g)  # [rows, K] -> [rows, K/G, G]
        scale, zero = grid.find_params(
            w, shrink_steps=shrink_steps, min_shrink=min_shrink, importance=importance
        )
        q = grid.quantize(w, scale.unsqueeze(-1), zero.unsqueeze(-1))
        codes[r : r + rows] = q.view(-1, k).to(torch.uint8)
        scales[r : r + rows], zeros[r : r + rows] = scale, zero
    return grid.pack(codes, scales, zeros)
