"""Fidelity of an arm to its engine's unquantized baseline: what is compared, and the
record's numbers from per-position results (fourbit.steps.fidelity writes them; the ppl
step of an engine that keeps fidelity sides selects the same windows and prompts).

Definition (written next to every number these functions produce):

- Positions: the first ``windows`` windows of the study's windows file (the very
  token ids ppl scores), positions 1..W-1 of each, every one predicted from the
  tokens before it in its window, exactly the positions ppl scores. At each, P_b
  and P_a are the baseline's and the arm's next-token distributions, both run by
  the same engine.
- ``kl`` = KL(P_b || P_a) = sum_v P_b(v) (log P_b(v) - log P_a(v)), in nats, per
  position; ``kl_mean`` is its mean over positions and ``kl_p99`` its 99th
  percentile (numpy's linear interpolation).
- ``top1_agreement``: the fraction of those positions where both distributions
  have the same most likely token.
- Greedy fidelity: the first ``prompt_tokens`` tokens of the first ``prompts``
  windows are continued by each model, greedily (argmax), for exactly
  ``new_tokens`` tokens (EOS does not stop them); ``identical`` counts the
  prompts whose two continuations are equal token for token, and
  ``matching_prefix`` gives, per prompt, how many leading tokens agree.

KL is computed exactly from both models' full logits, the same way on every engine
that compares positions (fourbit.metrics.kl).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

DEFINITION = (
    "KL(P_base || P_arm) in nats and top-1 agreement of the next-token distributions at "
    "positions 1..{last} of the first {windows} windows (the ppl positions), both run by the "
    "same engine; greedy: the first {prompt_tokens} tokens of the first {prompts} windows "
    "continued for exactly {new_tokens} tokens by each model (argmax, EOS ignored), "
    "identical = equal token for token"
)


def select(
    windows: Sequence[Sequence[int]], settings: Mapping
) -> tuple[list[list[int]], list[list[int]]]:
    """The windows whose positions are compared, and the greedy prompts, by ``settings``
    (the config's fidelity block, its defaults filled)."""
    if not windows:
        raise ValueError("the windows file holds no windows")
    compared = [list(w) for w in windows[: settings["windows"]]]
    short = [i for i, w in enumerate(windows[: settings["prompts"]])
             if len(w) < settings["prompt_tokens"]]
    if short:
        raise ValueError(
            f"fidelity.prompt_tokens={settings['prompt_tokens']} is longer than window {short[0]} "
            f"({len(windows[short[0]])} tokens); lower it"
        )
    prompts = [list(w[: settings["prompt_tokens"]]) for w in windows[: settings["prompts"]]]
    return compared, prompts


def _percentile(values: Sequence[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(compared: Mapping) -> dict:
    """Per-position results (an engine's compare_with_baseline or compare_sides) -> the
    record's numbers."""
    kl = [x for window in compared["window_kl"] for x in window]
    top1 = [x for window in compared["window_top1"] for x in window]
    if not kl or len(kl) != len(top1):
        raise ValueError(f"{len(kl)} KL values and {len(top1)} top-1 values; expected equal, > 0")
    return {
        "positions": len(kl),
        "kl_mean": math.fsum(kl) / len(kl),
        "kl_p99": _percentile(kl, 99),
        "kl_median": _percentile(kl, 50),
        "kl_max": max(kl),
        "top1_agreement": sum(bool(x) for x in top1) / len(top1),
        "window_kl_sum": [math.fsum(w) for w in compared["window_kl"]],
        "window_top1": [sum(bool(x) for x in w) for w in compared["window_top1"]],
        "window_positions": [len(w) for w in compared["window_kl"]],
    }


def greedy_summary(
    baseline: Sequence[Sequence[int]], arm: Sequence[Sequence[int]], new_tokens: int
) -> dict:
    if len(baseline) != len(arm):
        raise ValueError(f"{len(baseline)} baseline continuations, {len(arm)} arm continuations")
    for side, conts in (("baseline", baseline), ("arm", arm)):
        lengths = {len(c) for c in conts}
        if lengths != {new_tokens}:
            raise ValueError(
                f"{side} continuations have lengths {sorted(lengths)}, not {new_tokens}"
            )
    prefix = []
    for b, a in zip(baseline, arm, strict=True):
        same = 0
        while same < new_tokens and b[same] == a[same]:
            same += 1
        prefix.append(same)
    return {
        "prompts": len(baseline),
        "new_tokens": new_tokens,
        "identical": sum(p == new_tokens for p in prefix),
        "matching_prefix": prefix,
        "matching_prefix_mean": sum(prefix) / len(prefix) if prefix else 0.0,
    }
