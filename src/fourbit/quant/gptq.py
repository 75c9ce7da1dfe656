"""GPTQ (Frantar et al. 2022): quantize a weight column by column, pushing each
column's rounding error onto the columns not yet quantized.

The loss is tr(dW H dW^T) with H from ``hessian.py``. Quantizing column i alone and
letting the later columns j > i absorb the error optimally (Optimal Brain
Surgeon) gives the update

    err   = (w_i - q_i) / U[i, i]
    W[:, j] -= err * U[i, j]          for j > i,

where U is the upper Cholesky factor of H^-1: its row i is row i of the inverse of
H restricted to the columns not yet quantized (i, i+1, ...), divided by U[i, i], so
one factorisation serves every step. Updates within a block of columns are applied
at once, to the rest of the matrix once per block (one matmul, not block_size rank-1
updates).

This file knows nothing about models: a weight, a Hessian and a grid go in, a
QuantizedWeight comes out. Follows IST-DASLab/gptq's gptq.py.
"""

from __future__ import annotations

import logging

import torch

from fourbit.quant.grid import Grid
from fourbit.quant.qweight import QuantizedWeight

log = logging.getLogger("fourbit")


class SingularHessianError(ValueError):
    """H + damp * I could not be factorised even at the largest damping allowed."""


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    grid: Grid,
    *,
    block_size: int = 128,
    damp_percent: float = 0.01,
    max_damp_percent: float = 1.0,
    act_order: bool = False,
    static_groups: bool = False,
    search: str = "minmax",
    shrink_steps: int = 20,
    layer_name: str = "",
) -> tuple[QuantizedWeight, dict]:
    """Quantize weight [N, K] against hessian [K, K] on ``grid``.

    damp_percent: fraction of mean(diag H) added to the diagonal; raised x10 up to
        max_damp_percent while the Cholesky factorisation fails.
    act_order: quantize columns in order of decreasing H[i, i] (most-used inputs
        first, while the most columns remain to absorb their error). Needs
        static_groups, so each group keeps one contiguous range of original columns
        and the result needs no column index (g_idx).
    static_groups: group scale/zero from the original W up front, instead of from
        the error-updated W when the first column of the group is reached.
    search, shrink_steps: how each group's scale and zero are found (Grid.find_params),
        with diag H as the per-column importance, as llama.cpp uses its imatrix;
        "minmax" is the reference's plain min/max.
    Returns the QuantizedWeight (in original column order) and an info dict.

    Long because the error-feedback loop is one algorithm (Frantar et al., Algorithm 1,
    with the reference's lazy block updates): split, its steps would pass the same five
    tensors back and forth and no longer read line for line against the paper.
    """
    n, k = weight.shape
    g, where = grid.group_size, layer_name or "weight"
    n_groups = grid.n_groups(k, where)
    if hessian.shape != (k, k):
        raise ValueError(f"{where}: Hessian {tuple(hessian.shape)} does not match K={k}")
    if act_order and not static_groups:
        raise ValueError(f"{where}: act_order needs static_groups (contiguous groups, no g_idx)")
    if block_size % g:
        raise ValueError(f"{where}: block_size={block_size} is not a multiple of group {g}")
    if not torch.isfinite(weight).all():
        bad = (~torch.isfinite(weight)).sum().item()
        raise ValueError(f"{where}: weight has {bad} non-finite values")

    W = weight.float().clone()
    H = hessian.double().clone()  # factorised in float64: H can be near singular
    # Inputs that were always 0 carry no signal: any weight there is free, so make it
    # 0 (exact on either grid) and give H a unit diagonal there to keep it invertible.
    dead = torch.nonzero(H.diagonal() == 0).squeeze(1)
    H[dead, dead] = 1
    W[:, dead] = 0
    importance = H.diagonal().float()

    def find_params(w, cols):  # w [N, ..., G] -> (scale, zero) [N, ...]
        return grid.find_params(
            w, search=search, shrink_steps=shrink_steps, importance=importance[cols]
        )

    scales, zeros = torch.empty(n, n_groups), torch.empty(n, n_groups)
    if static_groups:
        scales[:], zeros[:] = find_params(W.view(n, n_groups, g), torch.arange(k).view(n_groups, g))

    perm = torch.arange(k)
    if act_order:
        perm = torch.argsort(H.diagonal(), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
    U, damp_used = _upper_cholesky_of_inverse(H, damp_percent, max_damp_percent, where)

    codes = torch.empty(n, k, dtype=torch.uint8)  # in processing (permuted) order
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        U1 = U[i1:i2, i1:i2]
        # The block transposed, [N, B] -> [B, N], as a copy: each column, and each rank-1
        # update of the columns after it, is then contiguous memory rather than a
        # stride-K walk through all N rows (the same products and differences, so the
        # same bits). Only err1 leaves the block: W's own copy of it is never read again.
        W1 = W[:, i1:i2].t().contiguous()
        err1 = torch.empty(i2 - i1, n)  # [B, N]
        for i in range(i2 - i1):
            col = i1 + i
            if not static_groups and col % g == 0:  # the group lies inside this block
                group = find_params(W1[i : i + g].t().contiguous(), perm[col : col + g])
                scales[:, col // g], zeros[:, col // g] = group
            j = perm[col] // g
            q = grid.quantize(W1[i], scales[:, j], zeros[:, j])
            codes[:, col] = q.to(torch.uint8)
            err = (W1[i] - grid.dequantize(q, scales[:, j], zeros[:, j])) / U1[i, i]  # [N]
            W1[i + 1 :] -= U1[i, i + 1 :].unsqueeze(1) * err.unsqueeze(0)  # [B-i-1,1]*[1,N]
            err1[i] = err
        W[:, i2:] -= err1.t() @ U[i1:i2, i2:]  # [N, B] @ [B, K - i2]

    qw = grid.pack(codes[:, torch.argsort(perm)], scales, zeros)
    loss, total = _proxy_loss(weight.float(), qw.dequantize(), hessian.float())
    info = {
        "layer": layer_name,
        "damp_percent_used": damp_used,
        "dead_columns": len(dead),
        "act_order": act_order,
        "static_groups": static_groups,
        "search": search,
        "loss": loss,  # tr(dW H dW^T): mean over calibration tokens of 2 |dW x|^2
        "relative_loss": loss / total if total > 0 else 0.0,  # the same over tr(W H W^T)
    }
    return qw, info


def _upper_cholesky_of_inverse(H, damp_percent, max_damp_percent, where):
    """U with U^T U = (H + damp * I)^-1, float32, and the damp fraction that worked."""
    mean_diag = H.diagonal().mean().item()
    pct = damp_percent
    while True:
        damped = H.clone()
        damped.diagonal().add_(pct * mean_diag)
        L, fail = torch.linalg.cholesky_ex(damped)
        if not fail:
            U, fail = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if not fail and torch.isfinite(U).all():
                break
        if pct >= max_damp_percent:
            raise SingularHessianError(
                f"{where}: Hessian {H.shape[0]}x{H.shape[0]} is not positive definite even with "
                f"damp {pct:g} x mean(diag H) = {pct * mean_diag:.4g} (tried from {damp_percent:g})"
            )
        pct = min(pct * 10, max_damp_percent)
    if pct != damp_percent:
        log.warning(
            "%s: Cholesky of H failed at damp %g x mean(diag H); succeeded at %g",
            where, damp_percent, pct,
        )
    return U.float(), pct


def _proxy_loss(W, W_hat, H):
    """(tr(dW H dW^T), tr(W H W^T)) as floats: the output error and its scale."""
    dW = W - W_hat
    return (dW @ H * dW).sum().item(), (W @ H * W).sum().item()
