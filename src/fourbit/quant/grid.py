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
weight by absmax / 15 and leaves level -8 mostly unused.) With this choice plain
min/max clips nothing under either grid, and the search (``Grid.find_params``)
alone decides how much clipping pays. Its default, ``weighted``, is llama.cpp's
K-quant search: per-weight weights that grow with |x|, so a group's extremes are
clipped only when that lowers the weighted error, and a least-squares refit of
each candidate. For calibrated methods, quantizers/methods.py then checks each layer's
search against plain min/max on held-out activations and keeps the better.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fourbit.schema import allowed
from fourbit.quant.qweight import BITS, LEVELS, SYMMETRIC_ZERO, QuantizedWeight

MAXQ = LEVELS - 1  # 15, the largest code
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROW_CHUNK_ELEMS = 1 << 20  # RTN works on ~1M weights (4 MB float32) at a time
SEARCHES = ("minmax", "shrink", "weighted")  # how find_params picks a group's grid


def element_weights(w: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted search's weight of each w [..., G] in its group's error -> [..., G].

    As llama.cpp's quantize_row_q4_K: av_x + |x| without an importance matrix, and
    quant_weights * sqrt(sigma2 + x^2) with one, where av_x^2 = sigma2 = the group's
    mean x^2 and ``importance`` (broadcast to w) plays quant_weights.
    """
    sq = w.square()
    sigma2 = sq.mean(-1, keepdim=True)
    if importance is None:
        return sigma2.sqrt() + w.abs()
    return importance * (sigma2 + sq).sqrt()


@dataclass(frozen=True)
class Grid:
    bits: int = BITS  # codes are nibbles: QuantizedWeight and the kernels know no other width
    group_size: int = 128  # the schema's group_size enum: the sizes formats and kernels implement
    sym: bool = False  # zero fixed at 8: no per-group zero to store or subtract, less range fit
    scale_dtype: torch.dtype = torch.float16  # what formats store; the search happens in it

    def __post_init__(self) -> None:
        if self.bits != BITS:
            raise ValueError(f"only {BITS}-bit grids are supported, got bits={self.bits}")
        if self.group_size not in allowed("group_size"):
            raise ValueError(f"group_size={self.group_size} is not one of {allowed('group_size')}")
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
        search: str = "minmax",
        shrink_steps: int = 20,
        min_shrink: float = 0.5,
        importance: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) per group of w [..., G] -> two float32 [...] tensors, by ``search``.

        minmax    the full range, plain rounding (``params``); shrink_steps is not read.
        shrink    the old search: ranges shrunk 1.0 .. min_shrink in shrink_steps steps,
                  keeping per group the least squared weight error (times ``importance``
                  if given). It clips each group's extremes, which on real models are the
                  weights that matter: kept only to measure against.
        weighted  llama.cpp's K-quant search (``_weighted_search``): shrink_steps + 1
                  candidate steps, each refit by weighted least squares, per-weight
                  weights av_x + |x|, or importance * sqrt(sigma2 + x^2) with importance.
        ``importance`` broadcasts to w: the calibration activations' second moment of each
        input column (diag of H), as llama.cpp's quant_weights (its imatrix). Both searches
        include the minmax candidate and keep it on ties, so on their own objective they
        are never worse than plain rounding.
        """
        if search not in SEARCHES:
            raise ValueError(f"search={search!r} is not one of {SEARCHES}")
        if shrink_steps < 1 or not 0 < min_shrink <= 1:
            raise ValueError(
                f"need shrink_steps >= 1 and 0 < min_shrink <= 1, got {shrink_steps}, {min_shrink}"
            )
        if search == "weighted":
            return self._weighted_search(w, shrink_steps, importance)
        best_scale, best_zero = self.params(w)
        if search == "minmax":
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

    def _weighted_search(self, w, steps, importance):
        """llama.cpp's make_qkx2_quants (asym) / make_qx_quants (sym), vectorised over groups.

        Per-weight weights e (element_weights, as llama.cpp's quantize_row_q4_K) make
        the objective sum e (w_hat - x)^2, so a group's large weights, which clipping
        would hurt most, count for more. Then per group:

        1. candidates: inverse steps iscale = (1 + r * (2 i / steps - 1)) / step_minmax,
           i = 0..steps, r one level's worth (1/15 asym: llama.cpp's (15 - 1 .. 15 + 1) /
           (max - min); 1/8 sym); codes by rounding on each, then the scale (and for asym
           a float min) refit by weighted least squares for those codes;
        2. each refit becomes a stored grid: the scale rounded to scale_dtype, the float
           min to an integer zero (see _to_integer_zero), codes re-chosen on it, and
           scored there by the objective; plain min/max is candidate 0 and wins ties;
        3. the winner is refit once more, scale alone for its own codes and zero - 1, zero,
           zero + 1, and kept if that scores better still.
        Every score is of the grid exactly as stored, so the float16 scale is the one searched.
        Long because the three steps share their running best per group; kept in one
        place, they read step for step against llama.cpp's make_qkx2_quants.
        """
        e = element_weights(w, importance)
        best_scale, best_zero = self.params(w)
        best_err = self.error(w, best_scale, best_zero, e)

        def consider(scale, zero):
            nonlocal best_scale, best_zero, best_err
            scale = scale.to(self.scale_dtype).float()
            ok = torch.isfinite(scale) & (scale > 0)
            scale = torch.where(ok, scale, 1.0)
            zero = torch.where(ok, zero, best_zero)
            err = self.error(w, scale, zero, e)
            better = ok & (err < best_err)
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)

        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)  # [...]: 0 is on every grid
        sw, sx = e.sum(-1), (e * w).sum(-1)
        if self.sym:
            istep = 1 / torch.maximum(-lo / SYMMETRIC_ZERO, hi / (MAXQ - SYMMETRIC_ZERO))
            for i in range(steps + 1):
                iscale = istep * (1 + (2 * i / steps - 1) / SYMMETRIC_ZERO)  # [...]
                levels = torch.clamp(torch.round(w * iscale.unsqueeze(-1)), -SYMMETRIC_ZERO,
                                     MAXQ - SYMMETRIC_ZERO)  # [..., G], signed levels -8..7
                # min over s of sum e (s l - x)^2: s = sum e x l / sum e l^2
                scale = (e * w * levels).sum(-1) / (e * levels.square()).sum(-1)
                consider(scale, best_zero.new_full(scale.shape, SYMMETRIC_ZERO))
        else:
            istep = MAXQ / (hi - lo)
            for i in range(steps + 1):
                iscale = istep * (1 + (2 * i / steps - 1) / MAXQ)  # (15 - 1 .. 15 + 1) / range
                codes = torch.round((w - lo.unsqueeze(-1)) * iscale.unsqueeze(-1)).clamp(0, MAXQ)
                # min over (s, m) of sum e (s l + m - x)^2, the 2x2 normal equations; [...]
                sl, sl2 = (e * codes).sum(-1), (e * codes.square()).sum(-1)
                sxl = (e * w * codes).sum(-1)
                det = sw * sl2 - sl * sl
                scale = (sw * sxl - sx * sl) / det
                wmin = (sl2 * sx - sl * sxl) / det
                # a positive min would leave 0 off the grid: refit the scale alone with min 0
                pos = wmin > 0
                scale = torch.where(pos, sxl / sl2, scale)
                wmin = torch.where(pos, 0.0, wmin)
                consider(scale, self._to_integer_zero(wmin, scale.to(self.scale_dtype).float()))

        # Refit the winner's scale for its own codes, with its zero and each neighbour.
        for dz in (0, -1, 1):
            zero = (best_zero + dz).clamp(0, MAXQ) if not self.sym else best_zero
            z = zero.unsqueeze(-1)  # [...] -> [..., 1]
            levels = self.quantize(w, best_scale.unsqueeze(-1), z) - z  # [..., G], q - z
            scale = (e * w * levels).sum(-1) / (e * levels.square()).sum(-1)  # fixed codes, zero
            consider(scale, zero)
            if self.sym:
                break
        return best_scale, best_zero

    @staticmethod
    def _to_integer_zero(wmin: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """llama.cpp's float min m (w_hat = s * l + m) -> the formats' integer zero z.

        The formats store w_hat = (q - z) * s with z an integer 0..15, so the grid's
        lowest level -z * s can only be a whole number of steps below 0: z = round(-m / s),
        clamped to the codes. The grid then moves by less than half a step, and the codes
        are re-chosen on it (the caller scores it as stored). Worked example, one group
        w = [-0.31, -0.02, 0.07, 0.44], weights e = av_x + |x| = [0.582, 0.292, 0.342, 0.712]
        (av_x = 0.272), and the middle candidate's codes l = round((w + 0.31) * 15 / 0.75)
        = [0, 6, 8, 15]:
            least squares  s = 0.050062, m = -0.315548
                           (s * l + m = [-0.3155, -0.0152, 0.0849, 0.4354])
            float16 scale  s = 0.050048828125
            zero           z = round(0.315548 / 0.050049) = round(6.305) = 6
            grid           lowest level -6 * s = -0.300293, 0.0153 above m (< s / 2 = 0.025)
            codes          clamp(round(w / s) + 6, 0, 15) = [0, 6, 7, 15]
            W_hat          (codes - 6) * s = [-0.300293, 0.0, 0.050049, 0.450439]
        """
        return torch.round(-wmin / scale).clamp(0, MAXQ).nan_to_num(0.0)

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
    search: str = "weighted",
    shrink_steps: int = 20,
    min_shrink: float = 0.5,
    importance: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Round each weight [N, K] to the nearest level of its group's grid, found by ``search``.

    ``importance`` [K] weights each input column in the search (Grid.find_params);
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
            w, search=search, shrink_steps=shrink_steps, min_shrink=min_shrink,
            importance=importance,
        )
        q = grid.quantize(w, scale.unsqueeze(-1), zero.unsqueeze(-1))
        codes[r : r + rows] = q.view(-1, k).to(torch.uint8)
        scales[r : r + rows], zeros[r : r + rows] = scale, zero
    return grid.pack(codes, scales, zeros)
