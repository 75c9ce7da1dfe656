"""fourbit.metrics.kl: KL from full logits, and the two top-k lower bounds, never above the KL."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fourbit.metrics.kl import (
    KL_POSITIONS,
    kl_from_logits,
    kl_full,
    kl_topk_bounds,
    topk_window_bounds,
)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _bounds(lb: np.ndarray, la: np.ndarray, k: int, actual: int) -> dict:
    """What vLLM returns (each side's top k by rank, and the actual token), fed to the bound."""
    sb, sa = np.argsort(-lb, kind="stable")[:k], np.argsort(-la, kind="stable")[:k]
    return kl_topk_bounds(sb.tolist(), lb[sb].tolist(), sa.tolist(), la[sa].tolist(), actual,
                          float(lb[actual]), float(la[actual]))


def test_kl_full_matches_torch_and_is_zero_for_identical_rows():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(7, 50, generator=g).log_softmax(-1)
    arm = (base + 0.3 * torch.randn(7, 50, generator=g)).log_softmax(-1)
    want = torch.nn.functional.kl_div(arm.double(), base.double(), log_target=True,
                                      reduction="none").sum(-1)
    assert torch.allclose(kl_full(base, arm), want, atol=1e-12)
    assert kl_full(base, base).abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_from_logits_is_kl_full_of_float64_log_softmax_in_slices(dtype):
    """More rows than one slice, either logits dtype: the float64 KL per row, the argmax
    agreement, never negative, and 0 for the same logits."""
    g = torch.Generator().manual_seed(1)
    rows = KL_POSITIONS + 5
    base = (4 * torch.randn(rows, 300, generator=g)).to(dtype)
    arm = (base.float() + torch.randn(rows, 300, generator=g)).to(dtype)
    kl, top1 = kl_from_logits(base, arm)
    want = kl_full(base.double().log_softmax(-1), arm.double().log_softmax(-1))
    assert kl == want.tolist()
    assert top1 == (base.float().argmax(-1) == arm.float().argmax(-1)).tolist()
    assert 0 < sum(top1) < rows and min(kl) >= 0
    same, agree = kl_from_logits(base, base)
    assert set(same) == {0.0} and all(agree)
    with pytest.raises(ValueError, match=r"\[positions, V\]"):
        kl_from_logits(base, arm[:, :299])


@pytest.mark.parametrize("seed", range(4))
def test_topk_bounds_never_exceed_the_kl(seed):
    """Random pairs of distributions, flat to peaked, any k: both bounds <= KL; exact at k = V."""
    rng = np.random.default_rng(seed)
    for _ in range(400):
        vocab = int(rng.integers(2, 40))
        k = int(rng.integers(1, vocab + 1))
        scale = 10 ** rng.uniform(-1, 1.3)
        lb = _log_softmax(rng.normal(size=vocab) * scale)
        la = _log_softmax(rng.normal(size=vocab) * scale if rng.random() < 0.3
                          else lb + rng.normal(size=vocab) * rng.uniform(0, 2))
        actual = int(rng.integers(vocab))
        kl = float(np.sum(np.exp(lb) * (lb - la)))
        got = _bounds(lb, la, k, actual)
        assert got["merged"] <= kl + 1e-9
        assert got["substituted"] <= kl + 1e-9
        assert got["bound"] == max(got["merged"], got["substituted"])
        if k == vocab:
            assert got["bound"] == pytest.approx(kl, abs=1e-9)


def test_topk_bounds_adversarial_search():
    """Hill-climb for a pair where the substituted bound exceeds the KL: there is none."""
    rng = np.random.default_rng(7)
    worst = -math.inf
    for _ in range(30):
        vocab = int(rng.integers(3, 8))
        k = int(rng.integers(1, vocab))
        x = rng.normal(size=2 * vocab) * 3
        step = 1.0

        def gap(x, vocab=vocab, k=k):  # bound now: the loop moves on
            lb, la = _log_softmax(x[:vocab]), _log_softmax(x[vocab:])
            kl = float(np.sum(np.exp(lb) * (lb - la)))
            return _bounds(lb, la, k, int(np.argmin(lb)))["substituted"] - kl

        best = gap(x)
        for i in range(600):
            y = x + rng.normal(size=x.size) * step
            if (g := gap(y)) > best:
                x, best = y, g
            if i % 100 == 99:
                step *= 0.5
        worst = max(worst, best)
    # float rounding only: remainders are 1 - sum of probabilities
    assert worst <= 1e-6


def test_topk_bounds_of_identical_distributions_are_zero():
    lb = _log_softmax(np.random.default_rng(0).normal(size=100) * 3)
    got = _bounds(lb, lb, 10, 3)
    assert got["merged"] == pytest.approx(0, abs=1e-12)
    assert got["substituted"] == pytest.approx(0, abs=1e-12)
    assert 0 < got["mass_topk"] < 1


def test_window_bounds_are_the_position_bounds_laid_out_per_window():
    """Each window's lists hold kl_topk_bounds at positions 1..W-1 and the rank-1 agreement."""
    rng = np.random.default_rng(3)
    windows = [[0, 4, 2, 7], [5, 1]]
    sides = {}
    for side in ("baseline", "arm"):
        sides[side] = []
        for w in windows:
            lps = [_log_softmax(rng.normal(size=9) * 2) for _ in w[1:]]
            top = [np.argsort(-lp, kind="stable")[:3] for lp in lps]
            sides[side].append({"tokens": len(lps), "top_ids": [t.tolist() for t in top],
                                "top_logprobs": [lp[t].tolist() for lp, t in zip(lps, top)],
                                "token_logprobs": [float(lp[y]) for lp, y in zip(lps, w[1:])]})
    got = topk_window_bounds(windows, sides["baseline"], sides["arm"])
    assert [len(v) for v in got["window_kl"]] == [3, 1]
    base, arm = sides["baseline"][0], sides["arm"][0]
    one = kl_topk_bounds(base["top_ids"][1], base["top_logprobs"][1], arm["top_ids"][1],
                         arm["top_logprobs"][1], 2, base["token_logprobs"][1], arm["token_logprobs"][1])
    assert got["window_kl"][0][1] == one["bound"] and got["window_mass_topk"][0][1] == one["mass_topk"]
    assert got["window_kl_merged"][0][1] == one["merged"]
    assert got["window_kl_substituted"][0][1] == one["substituted"]
    assert got["window_top1"][1] == [base_t[0] == arm_t[0] for base_t, arm_t in
                                     zip(sides["baseline"][1]["top_ids"], sides["arm"][1]["top_ids"])]
