"""Scoring and greedy generation on the vllm engine: one in-process LLM per call.

What this relies on (line numbers are vllm 0.32.0 in site-packages/vllm; the engine's
lifecycle, fourbit.engines.vllm.lifecycle, says how the LLM is opened):

Prompt logprobs. SamplingParams(prompt_logprobs=k, max_tokens=1) with
TokensPrompt(prompt_token_ids=ids). For every prompt position t >= 1 the model runner
computes log_softmax(logits[t-1], dtype=float32) (v1/sample/sampler.py:308-309; logits
in the model dtype, as a transformers reference computing log_softmax(logits.float()))
and gathers k top entries *plus the actual token* (sampler.py:312-341, runner
v1/worker/gpu_model_runner.py:5306-5413). With flat_logprobs=True the result is a
FlatLogprobs (logprobs.py:32-145) whose position 0 is empty and whose position t holds,
in order, the actual token ids[t] (with its rank) and then the top-k by rank
(logprobs.py:184-205): entry 0 is log p(ids[t] | ids[<t]) whether or not it is in the
top k. k=0 gives the actual token only; k=-1 the full vocabulary (needs max_logprobs=-1,
sampling_params.py:970-978, gpu_model_runner.py:1292-1297), i.e. vocab-size Python floats
per position: fine for a toy vocabulary, not for 150k. Prompts with prompt logprobs are
not served from the prefix cache, and enable_prefix_caching=False makes sure.

Greedy generation: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) on
TokensPrompt; output.outputs[0].token_ids.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fourbit.engines.vllm.lifecycle import llm_options, open_llm
from fourbit.engines.vllm.settings import VllmSettings, resolve
from fourbit.threads import torch_threads


def _check_windows(windows: Sequence[Sequence[int]]) -> list[list[int]]:
    out = [[int(t) for t in w] for w in windows]
    if not out:
        raise ValueError("no windows")
    return out


def score_windows(
    checkpoint: str | os.PathLike,
    windows: Sequence[Sequence[int]],
    settings: Mapping[str, Any] | VllmSettings,
    threads: int | None,
) -> list[dict[str, Any]]:
    """The engine registry's entry (fourbit/engines/__init__.py): settings from the study
    config; per window its nll_sum and scored tokens (fourbit.steps.evaluate defines them)."""
    settings = resolve(settings)
    with torch_threads(threads):
        return prompt_logprobs(checkpoint, windows, token_logprobs=False,
                               **llm_options(settings, checkpoint))


def prompt_logprobs(
    model_dir: str | os.PathLike,
    windows: Sequence[Sequence[int]],
    *,
    top_k: int = 0,
    token_logprobs: bool = True,
    stats: dict[str, Any] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Score each window of token ids: log p(w[t] | w[:t]) for t = 1 .. len-1.

    ``options``: open_llm's keywords (dtype and kv_cache_bytes at least) except
    max_model_len and max_logprobs, which follow from the windows and top_k.
    Returns one dict per window, in order:
        nll_sum         -sum of those logprobs (float)
        tokens          how many positions were scored (len - 1)
        token_logprobs  the per-position logprobs (if ``token_logprobs``)
        top_ids, top_logprobs   per position, the top_k ids and logprobs by rank (if top_k != 0;
                        top_k=-1 is the whole vocabulary: vocab-size floats per position)
    Logprobs are float32 log_softmax of the model-dtype logits, like a transformers
    reference doing ``logits.float().log_softmax(-1)``.
    """
    wins = _check_windows(windows)
    k = _checked_k(top_k)
    with open_llm(model_dir, max_model_len=max(len(w) for w in wins) + 1,
                  max_logprobs=max_logprobs(k), stats=stats, **options) as llm:
        return logprobs_on(llm, wins, [k] * len(wins), token_logprobs=token_logprobs, stats=stats)


def _checked_k(top_k: int) -> int:
    k = int(top_k)
    if k < -1:
        raise ValueError(f"top_k must be >= 0, or -1 for the whole vocabulary; got {k}")
    return k


def max_logprobs(k: int) -> int:
    """open_llm's max_logprobs for top-k requests of at most ``k`` (-1: the vocabulary)."""
    return -1 if k == -1 else max(k, 20)


def logprobs_on(llm: Any, windows: list[list[int]], top_ks: Sequence[int], *,
                token_logprobs: bool, stats: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """prompt_logprobs on an open LLM, window i with its own top_ks[i] (0: the actual token
    only), all in one generate call; the results as prompt_logprobs returns them (top_ids
    and top_logprobs only for windows with a top k)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ks = [_checked_k(k) for k in top_ks]
    results = [_empty_result(k, token_logprobs) for k in ks]
    scored = [i for i, w in enumerate(windows) if len(w) >= 2]
    if not scored:
        return results
    params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=ks[i],
                             flat_logprobs=True, detokenize=False) for i in scored]
    t0 = time.perf_counter()
    prompts = [TokensPrompt(prompt_token_ids=windows[i]) for i in scored]
    outs = llm.generate(prompts, params, use_tqdm=False)
    if stats is not None:
        stats["run_s"] = time.perf_counter() - t0
        stats["tokens"] = sum(len(windows[i]) for i in scored)
    for i, out in zip(scored, outs, strict=True):
        lps, top_ids, top_lps = _read_window(i, windows[i], out.prompt_logprobs, ks[i])
        r = results[i]
        r["nll_sum"] = -math.fsum(lps)
        r["tokens"] = len(lps)
        if token_logprobs:
            r["token_logprobs"] = lps
        if ks[i] != 0:
            r["top_ids"], r["top_logprobs"] = top_ids, top_lps
    return results


def _empty_result(k: int, token_logprobs: bool) -> dict[str, Any]:
    """A window's result before scoring; what a window of fewer than 2 tokens keeps."""
    r: dict[str, Any] = {"nll_sum": 0.0, "tokens": 0}
    if token_logprobs:
        r["token_logprobs"] = []
    if k != 0:
        r["top_ids"], r["top_logprobs"] = [], []
    return r


def _read_window(i: int, w: list[int], plp: Any, k: int) -> tuple[list, list, list]:
    """Window ``i``'s FlatLogprobs -> (logprob of each actual token, top-k ids, top-k
    logprobs), positions 1..len-1; checks that entry 0 of each position is the actual token."""
    if plp is None or len(plp) != len(w):
        got = None if plp is None else len(plp)
        raise RuntimeError(f"window {i}: {got} prompt positions back, expected {len(w)}")
    lps, top_ids, top_lps = [], [], []
    for t in range(1, len(w)):
        s, e = plp.start_indices[t], plp.end_indices[t]
        if plp.token_ids[s] != w[t]:
            raise RuntimeError(
                f"window {i} position {t}: first entry is token {plp.token_ids[s]}, not {w[t]}"
            )
        lps.append(float(plp.logprobs[s]))
        if k != 0:
            top_ids.append([int(x) for x in plp.token_ids[s + 1 : e]])
            top_lps.append([float(x) for x in plp.logprobs[s + 1 : e]])
    return lps, top_ids, top_lps


def greedy(
    model_dir: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    ignore_eos: bool = True,
    stats: dict[str, Any] | None = None,
    **options: Any,
) -> list[list[int]]:
    """Greedy continuation (temperature 0) of each prompt of token ids: the new token ids.

    ``options``: open_llm's keywords (dtype and kv_cache_bytes at least) except
    max_model_len, which follows from the prompts and max_tokens."""
    ps = _checked_prompts(prompts)
    with open_llm(model_dir, max_model_len=max(len(p) for p in ps) + int(max_tokens),
                  stats=stats, **options) as llm:
        return greedy_on(llm, ps, max_tokens, ignore_eos=ignore_eos, stats=stats)


def _checked_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    ps = _check_windows(prompts)
    if any(len(p) == 0 for p in ps):
        raise ValueError("empty prompt")
    return ps


def greedy_on(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int, *,
              ignore_eos: bool = True, stats: dict[str, Any] | None = None) -> list[list[int]]:
    """greedy on an open LLM."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ps = _checked_prompts(prompts)
    params = SamplingParams(
        max_tokens=int(max_tokens), temperature=0.0, ignore_eos=ignore_eos, detokenize=False
    )
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
    if stats is not None:
        stats["run_s"] = time.perf_counter() - t0
        stats["tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    return [list(o.outputs[0].token_ids) for o in outs]
