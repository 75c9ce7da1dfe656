"""KL(P_b || P_a) of next-token distributions, from what an engine gives.

P_b is the baseline's distribution at a position, P_a the arm's;
KL(P_b || P_a) = sum_v P_b(v) (log P_b(v) - log P_a(v)), in nats. How it is
computed depends on what the engine returns (fourbit.steps.fidelity writes the
method next to every number):

``full logits`` (FULL; the reference engine): log_softmax over the whole
vocabulary, accumulated in float64 (kl_full; from two models' logits, kl_from_logits).
Exact.

``top-k lower bound`` (TOPK; vLLM): vLLM returns, per position, the top-k ids
and logprobs of the model that ran and the logprob of the actual next token,
not the logprob of ids of our choosing. With S the baseline's top-k ids, A the
arm's top-k ids, m the arm's smallest returned probability and y the actual
next token, every id of S has a known or bounded arm probability: exact for
ids in A or equal to y, else P_a(i) <= m (it is not in the arm's top k). Two
estimates are computed (kl_topk_bounds), and each is a lower bound of the KL
(so their maximum, which is reported, is one too):

1. merged (``kl_merged``): K = the ids whose logprobs both models returned
   (S ∩ A, and y); every other id is merged into one outcome R.
   LB1 = sum_{i in K} P_b(i) log(P_b(i)/P_a(i)) + P_b(R) log(P_b(R)/P_a(R)),
   P(R) = 1 - sum_{i in K} P(i). This is the KL of the two distributions
   coarsened by the same map, and a coarsening never increases KL (the
   log-sum inequality applied to the cell R: sum_{v in R} p log(p/q) >=
   P(R) log(P(R)/Q(R))). Equality iff P_b/P_a is constant over R.

2. substituted (``kl_substituted``): every id of S outside A (y excepted) is
   given the arm probability m, the most it can have, and the rest of the
   vocabulary is one outcome with the remaining mass:
   LB2 = sum_{i in S} P_b(i) log(P_b(i)/q_i) + P_b(R) log(P_b(R)/(1 - sum_S q_i)),
   R = V \\ S. Why it is a lower bound: let J = S \\ A (minus y) and pair each
   j in J with its own a in A \\ S (possible: |S| = |A| = k, so |A \\ S| =
   |S \\ A| >= |J|). Move mass m - P_a(j) from a to j: Q_j = m, Q_a = P_a(a) +
   P_a(j) - m >= 0 (P_a(a) >= m). LB2 is the coarsened KL(P_b || Q) (a in R), so
   LB2 <= KL(P_b || Q) by (1). And KL(P_b || Q) <= KL(P_b || P_a): with u =
   P_a(j) <= m <= v = P_a(a) and P_b(a) <= P_b(j) (a is outside the baseline's
   top k, j inside), the pair's change is P_b(j) log(u/m) + P_b(a) log(v/(v+u-m))
   <= P_b(j) log(uv / (m(v+u-m))) <= 0, because m(v+u-m) - uv = (v-m)(m-u) >= 0.
   So the reading "missing ids get the arm's smallest returned logprob" is a
   bound when the remainder is computed from the substituted values, as here;
   the proof uses that both lists have the same length k.

Both are exact when the top-k lists cover the vocabulary; otherwise they can be
far below the KL when the distributions are flat (much mass outside the top k):
``mass_topk`` (P_b(S)) says how much of the baseline's distribution was
compared id by id. vLLM returns float32 logprobs: the remainders 1 - sum are
floored at REST_FLOOR before dividing (which only lowers a term), so the bounds
hold to float32 rounding. A bound at every position bounds the mean, the
median, the p99 and the max too (order statistics are monotone). top-1
agreement from the rank-1 ids is exact either way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

FULL = "full logits"
TOPK = "top-k lower bound"
REST_FLOOR = 1e-6  # remainders below float32 resolution of a sum of k probabilities
# positions per float64 log-softmax slice: [128, V] doubles stay small for a large V
KL_POSITIONS = 128


def kl_full(base_logprobs, arm_logprobs):
    """KL(P_b || P_a) per row of two [..., V] log-softmax tensors, in float64."""
    base, arm = base_logprobs.double(), arm_logprobs.double()
    return (base.exp() * (base - arm)).sum(-1)


def kl_from_logits(base_logits, arm_logits) -> tuple[list[float], list[bool]]:
    """Per row of two [positions, V] logit tensors (any float dtype), KL(P_b || P_a) by
    kl_full of their float64 log_softmax, and whether both have the same argmax (top-1
    agreement)."""
    if base_logits.shape != arm_logits.shape or base_logits.dim() != 2:
        raise ValueError(f"logits of shapes {tuple(base_logits.shape)} and "
                         f"{tuple(arm_logits.shape)}; expected two equal [positions, V]")
    kl: list[float] = []
    top1: list[bool] = []
    for start in range(0, base_logits.shape[0], KL_POSITIONS):
        base = base_logits[start : start + KL_POSITIONS].double().log_softmax(-1)  # [n, V]
        arm = arm_logits[start : start + KL_POSITIONS].double().log_softmax(-1)
        kl.extend(kl_full(base, arm).tolist())
        top1.extend((base.argmax(-1) == arm.argmax(-1)).tolist())
    return kl, top1


def _cell(p: float, q: float) -> float:
    """p log(p/q) for one outcome; q floored at REST_FLOOR (which can only lower the term)."""
    if p <= 0.0:
        return 0.0
    return p * math.log(p / max(q, REST_FLOOR))


def kl_topk_bounds(
    base_ids: Sequence[int],
    base_logprobs: Sequence[float],
    arm_ids: Sequence[int],
    arm_logprobs: Sequence[float],
    actual: int,
    base_actual: float,
    arm_actual: float,
) -> dict:
    """The two lower bounds of KL(P_b || P_a) at one position (see the module docstring).

    base_ids/base_logprobs: the baseline's top-k; arm_ids/arm_logprobs: the arm's top-k
    (the same k); actual: the next token, with each model's logprob of it.
    Returns {"merged", "substituted", "bound" (their max), "mass_topk" (P_b of its top k)}.
    """
    if len(base_ids) != len(arm_ids):
        raise ValueError(f"top-k lists differ in length: {len(base_ids)} vs {len(arm_ids)}")
    base = dict(zip(base_ids, base_logprobs, strict=True))
    arm = dict(zip(arm_ids, arm_logprobs, strict=True))
    base_known = {**base, actual: base_actual}
    arm_known = {**arm, actual: arm_actual}
    smallest = min(arm_logprobs)

    # 1. merged: every id with both logprobs known (S ∩ A and the actual token), the rest
    # one outcome.
    known = [i for i in base_known if i in arm_known]
    head = math.fsum(math.exp(base_known[i]) * (base_known[i] - arm_known[i]) for i in known)
    rest_b = 1.0 - math.fsum(math.exp(base_known[i]) for i in known)
    rest_a = 1.0 - math.fsum(math.exp(arm_known[i]) for i in known)
    merged = head + _cell(rest_b, rest_a)

    # 2. substituted: the baseline's top-k ids the arm did not return get the arm's smallest;
    # an actual token outside the baseline's top k stays in the remainder (the proof needs S
    # to be exactly the baseline's top k).
    q = {i: arm_known.get(i, smallest) for i in base}
    head = math.fsum(math.exp(base[i]) * (base[i] - q[i]) for i in base)
    mass_b = math.fsum(math.exp(base[i]) for i in base)
    rest_a = 1.0 - math.fsum(math.exp(q[i]) for i in base)
    substituted = head + _cell(1.0 - mass_b, rest_a)
    return {
        "merged": merged,
        "substituted": substituted,
        "bound": max(merged, substituted),
        "mass_topk": min(mass_b, 1.0),
    }


def topk_window_bounds(
    windows: Sequence[Sequence[int]],
    baseline: Sequence[Mapping[str, Any]],
    arm: Sequence[Mapping[str, Any]],
) -> dict[str, list[list]]:
    """kl_topk_bounds and top-1 agreement at every scored position of every window.

    ``baseline`` and ``arm``: per window, what each side returned for positions 1..W-1
    ({"tokens", "top_ids", "top_logprobs", "token_logprobs"}, each list indexed by
    position - 1). Returns, per window, a list per position of: "window_kl" (the bound),
    "window_kl_merged", "window_kl_substituted", "window_mass_topk", "window_top1".
    """
    out: dict[str, list[list]] = {key: [] for key in (
        "window_kl", "window_kl_merged", "window_kl_substituted", "window_mass_topk",
        "window_top1")}
    for w, base, other in zip(windows, baseline, arm, strict=True):
        rows: dict[str, list] = {key: [] for key in out}
        for t in range(base["tokens"]):  # position t + 1 of the window
            bounds = kl_topk_bounds(
                base["top_ids"][t], base["top_logprobs"][t], other["top_ids"][t],
                other["top_logprobs"][t], int(w[t + 1]), base["token_logprobs"][t],
                other["token_logprobs"][t],
            )
            rows["window_kl"].append(bounds["bound"])
            rows["window_kl_merged"].append(bounds["merged"])
            rows["window_kl_substituted"].append(bounds["substituted"])
            rows["window_mass_topk"].append(bounds["mass_topk"])
            rows["window_top1"].append(base["top_ids"][t][0] == other["top_ids"][t][0])
        for key, values in rows.items():
            out[key].append(values)
    return out
