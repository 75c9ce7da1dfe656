"""Uncertainty of perplexity differences, from per-window NLL sums.

Every engine scores the same windows for the arm and for its baseline, so the
difference is paired: resampling windows (with replacement) and recomputing
both perplexities on the same resample keeps the windows' shared difficulty out
of the interval. Windows, not tokens, are the unit, because tokens inside a
window are not independent.
"""

from __future__ import annotations

import math

import torch

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def delta_ppl_interval(
    arm_nll: list[float], baseline_nll: list[float], tokens: list[int], *, seed: int = 0,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> tuple[float, float, float]:
    """(ppl_arm - ppl_baseline, lower, upper): a paired percentile bootstrap over windows."""
    if not (len(arm_nll) == len(baseline_nll) == len(tokens)) or not tokens:
        raise ValueError(
            f"paired windows needed: {len(arm_nll)} arm, {len(baseline_nll)} baseline, {len(tokens)} token counts"
        )
    arm = torch.tensor(arm_nll, dtype=torch.float64)
    base = torch.tensor(baseline_nll, dtype=torch.float64)
    count = torch.tensor(tokens, dtype=torch.float64)
    point = math.exp(arm.sum() / count.sum()) - math.exp(base.sum() / count.sum())
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(tokens), (resamples, len(tokens)), generator=generator)  # [R, W]
    scored = count[picks].sum(1)  # [R]
    deltas = torch.exp(arm[picks].sum(1) / scored) - torch.exp(base[picks].sum(1) / scored)  # [R]
    tail = (1 - CONFIDENCE) / 2
    lower, upper = torch.quantile(deltas, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return point, lower, upper


def overlapping(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]
