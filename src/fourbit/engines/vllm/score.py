"""Scoring and greedy generation on the vllm engine: one in-process LLM per call.

What this relies on (line numbers are vllm 0.32.0 in site-packages/vllm; the engine's
lifecycle, fourbit.engines.vllm.lifecycle, says how the LLM is opened):

Prompt logprobs. SamplingParams(prompt_logprobs=0, max_tokens=1) with
TokensPrompt(prompt_token_ids=ids). For every prompt position t >= 1 the model runner
computes log_softmax(logits[t-1], dtype=float32) (v1/sample/sampler.py:308-309; logits
in the model dtype, as a transformers reference computing log_softmax(logits.float()))
and gathers the actual token (sampler.py:312-341, runner
v1/worker/gpu_model_runner.py:5306-5413). With flat_logprobs=True the result is a
FlatLogprobs (logprobs.py:32-145) whose position 0 is empty and whose position t holds
the actual token ids[t] and its logprob (logprobs.py:184-205). A k > 0 would add the
top k by rank as Python floats; the fidelity step needs whole distributions, which
fourbit.engines.vllm.distributions takes from inside that computation instead. Prompts
with prompt logprobs are not served from the prefix cache, and
enable_prefix_caching=False makes sure.

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
    token_logprobs: bool = True,
    stats: dict[str, Any] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Score each window of token ids: log p(w[t] | w[:t]) for t = 1 .. len-1.

    ``options``: open_llm's keywords (dtype and kv_cache_bytes at least) except
    max_model_len, which follows from the windows.
    Returns one dict per window, in order:
        nll_sum         -sum of those logprobs (float)
        tokens          how many positions were scored (len - 1)
        token_logprobs  the per-position logprobs (if ``token_logprobs``)
    Logprobs are float32 log_softmax of the model-dtype logits, like a transformers
    reference doing ``logits.float().log_softmax(-1)``.
    """
    wins = _check_windows(windows)
    with open_llm(model_dir, max_model_len=max(len(w) for w in wins) + 1, stats=stats,
                  **options) as llm:
        return logprobs_on(llm, wins, token_logprobs=token_logprobs, stats=stats)


def logprobs_on(llm: Any, windows: list[list[int]], *, token_logprobs: bool,
                stats: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """prompt_logprobs on an open LLM, all windows in one generate call; the results as
    prompt_logprobs returns them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    results = [_empty_result(token_logprobs) for _ in windows]
    scored = [i for i, w in enumerate(windows) if len(w) >= 2]
    if not scored:
        return results
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                            flat_logprobs=True, detokenize=False)
    t0 = time.perf_counter()
    prompts = [TokensPrompt(prompt_token_ids=windows[i]) for i in scored]
    outs = llm.generate(prompts, params, use_tqdm=False)
    if stats is not None:
        stats["run_s"] = time.perf_counter() - t0
        stats["tokens"] = sum(len(windows[i]) for i in scored)
    for i, out in zip(scored, outs, strict=True):
        lps = _read_window(i, windows[i], out.prompt_logprobs)
        r = results[i]
        r["nll_sum"] = -math.fsum(lps)
        r["tokens"] = len(lps)
        if token_logprobs:
            r["token_logprobs"] = lps
    return results


def _empty_result(token_logprobs: bool) -> dict[str, Any]:
    """A window's result before scoring; what a window of fewer than 2 tokens keeps."""
    r: dict[str, Any] = {"nll_sum": 0.0, "tokens": 0}
    if token_logprobs:
        r["token_logprobs"] = []
    return r


def _read_window(i: int, w: list[int], plp: Any) -> list[float]:
    """Window ``i``'s FlatLogprobs -> the logprob of each actual token, positions
    1..len-1; checks that the entry of each position is the actual token."""
    if plp is None or len(plp) != len(w):
        got = None if plp is None else len(plp)
        raise RuntimeError(f"window {i}: {got} prompt positions back, expected {len(w)}")
    lps = []
    for t in range(1, len(w)):
        s = plp.start_indices[t]
        if plp.token_ids[s] != w[t]:
            raise RuntimeError(
                f"window {i} position {t}: first entry is token {plp.token_ids[s]}, not {w[t]}"
            )
        lps.append(float(plp.logprobs[s]))
    return lps


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
