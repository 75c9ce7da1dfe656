"""The vllm engine's part in fourbit.steps.fidelity (Fidelity.KEPT_SIDES): the ppl job of
each checkpoint the fidelity step compares keeps that checkpoint's side in the same engine
pass (score_keeping_side: one engine start for both), and the fidelity step compares an
arm with the same engine's baseline from the two sides (compare_sides), starting no engine.

vLLM gives the logprobs of each model's own top k and of the actual token, not of ids of
our choosing: SamplingParams.prompt_logprob_token_ids would, but it needs the V2 model
runner (v1/engine/input_processor.py:163-169), which needs Triton, absent on CPU. So KL is
a lower bound (fourbit.metrics.kl explains which and why); top-1 agreement compares the
rank-1 ids.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fourbit.threads import torch_threads
from fourbit.engines.base import WindowScore
from fourbit.engines.vllm.lifecycle import llm_options, open_llm
from fourbit.engines.vllm.score import greedy_on, logprobs_on, max_logprobs
from fourbit.engines.vllm.settings import VllmSettings, resolve
from fourbit.metrics.kl import TOPK, topk_window_bounds

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
    top_k: int,
) -> tuple[list[WindowScore], dict[str, Any]]:
    """What score_windows returns, and in the same engine the checkpoint's side: the first
    ``compared`` windows' prompt_logprobs with their top k, and the greedy continuations
    (EOS ignored) of ``prompts``, {"scored": [...], "greedy": [[ids]]}, plain JSON data for
    compare_sides. Every window is its own request and the engine holds one sequence at a
    time, so what a window scores does not depend on what else the engine runs."""
    settings = resolve(settings)
    wins = [[int(t) for t in w] for w in windows]
    k = int(top_k)
    if not 1 <= compared <= len(wins) or k < 1:
        raise ValueError(f"{compared} compared windows of {len(wins)}, top_k {k}: need 1 <= compared "
                         "<= windows and top_k >= 1")
    longest = max(max(len(w) + 1 for w in wins), max(len(p) for p in prompts) + int(new_tokens))
    with torch_threads(threads), open_llm(checkpoint, max_model_len=longest, max_logprobs=max_logprobs(k),
                                          **llm_options(settings, checkpoint)) as llm:
        scored = logprobs_on(llm, wins, [k] * compared + [0] * (len(wins) - compared),
                             token_logprobs=True)
        continued = greedy_on(llm, prompts, new_tokens)
    log.info("fidelity side of %s: %d windows (top %d), %d prompts x %d tokens", checkpoint,
             compared, k, len(prompts), new_tokens)
    scores: list[WindowScore] = [{"nll_sum": r["nll_sum"], "tokens": r["tokens"]} for r in scored]
    return scores, {"scored": scored[:compared], "greedy": continued}


def compare_sides(
    arm: Mapping[str, Any], baseline: Mapping[str, Any], windows: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """The arm's side against the same engine's baseline's (score_keeping_side's, both on
    the compared ``windows``): per position the top-k KL bounds and top-1 agreement, and
    both greedy continuations, as fourbit.steps.fidelity's per-position results."""
    return {
        "method": TOPK,
        **topk_window_bounds(windows, baseline["scored"], arm["scored"]),
        "greedy_baseline": baseline["greedy"],
        "greedy_arm": arm["greedy"],
    }
