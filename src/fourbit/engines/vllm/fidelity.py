"""The vllm engine's part in fourbit.steps.fidelity (Fidelity.KEPT_SIDES): the ppl job of
each checkpoint the fidelity step compares keeps that checkpoint's side in the same engine
pass (score_keeping_side: one engine start for both), and the fidelity step compares an
arm with the same engine's baseline from the two sides (compare_sides), starting no engine.

The KL is exact, from the whole next-token distributions of both models as this engine
computes them (fourbit.engines.vllm.distributions): the baseline's ppl job writes its
logits of the compared windows, and each arm's ppl job, which runs after it, computes
the KL against them while it scores the same windows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fourbit.engines.base import WindowScore
from fourbit.engines.vllm.distributions import compare_with_kept, keep_logits
from fourbit.engines.vllm.lifecycle import llm_options, open_llm
from fourbit.engines.vllm.score import greedy_on, logprobs_on
from fourbit.engines.vllm.settings import VllmSettings, resolve
from fourbit.metrics.kl import FULL
from fourbit.threads import torch_threads

log = logging.getLogger(__name__)


def score_keeping_side(
    checkpoint: str | os.PathLike,
    windows: Sequence[Sequence[int]],
    settings: Mapping[str, Any] | VllmSettings,
    threads: int | None,
    *,
    compared: int,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    baseline_logits: str | os.PathLike,
    baseline: Mapping[str, Any] | None,
) -> tuple[list[WindowScore], dict[str, Any]]:
    """What score_windows returns, and in the same engine the checkpoint's side, plain JSON
    data for compare_sides: the greedy continuations (EOS ignored) of ``prompts``, and for
    the first ``compared`` windows, with ``baseline`` None (this checkpoint is the
    baseline), their logits written to ``baseline_logits``; else (an arm; ``baseline`` is
    the baseline's side) per position the KL from the baseline's logits read from there,
    and top-1 agreement. Every window is its own request and the engine holds one sequence
    at a time, so what a window scores does not depend on what else the engine runs."""
    settings = resolve(settings)
    wins = [[int(t) for t in w] for w in windows]
    if not 1 <= compared <= len(wins) or any(len(w) < 2 for w in wins[:compared]):
        raise ValueError(f"{compared} compared windows of {len(wins)}: need 1 <= compared <= "
                         "windows, each of at least 2 tokens")
    if baseline is not None and baseline["positions"] != [len(w) - 1 for w in wins[:compared]]:
        raise ValueError(f"the baseline's side has positions {baseline['positions']}, not those "
                         "of these windows")
    longest = max(max(len(w) + 1 for w in wins), max(len(p) for p in prompts) + int(new_tokens))
    with torch_threads(threads), open_llm(checkpoint, max_model_len=longest,
                                          **llm_options(settings, checkpoint)) as llm:
        side: dict[str, Any] = {"positions": [len(w) - 1 for w in wins[:compared]]}
        if baseline is None:
            scored = keep_logits(llm, wins[:compared], baseline_logits)
        else:
            scored, side["window_kl"], side["window_top1"] = compare_with_kept(
                llm, wins[:compared], baseline_logits)
        scored += logprobs_on(llm, wins[compared:], token_logprobs=False)
        side["greedy"] = greedy_on(llm, prompts, new_tokens)
    log.info("fidelity side of %s: %d windows (%s), %d prompts x %d tokens", checkpoint, compared,
             "logits kept" if baseline is None else "KL against the baseline's logits",
             len(prompts), new_tokens)
    return [{"nll_sum": r["nll_sum"], "tokens": r["tokens"]} for r in scored], side


def compare_sides(
    arm: Mapping[str, Any], baseline: Mapping[str, Any], windows: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """The arm's side against the same engine's baseline's (score_keeping_side's, both on
    the compared ``windows``): per position the KL and top-1 agreement the arm's ppl job
    computed, and both greedy continuations, as fourbit.steps.fidelity's per-position
    results."""
    expected = [len(w) - 1 for w in windows]
    if arm["positions"] != expected or baseline["positions"] != expected:
        raise ValueError(f"sides of {arm['positions']} and {baseline['positions']} positions, "
                         f"not the compared windows' {expected}")
    return {
        "method": FULL,
        "window_kl": arm["window_kl"],
        "window_top1": arm["window_top1"],
        "greedy_baseline": baseline["greedy"],
        "greedy_arm": arm["greedy"],
    }
