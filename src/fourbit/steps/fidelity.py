"""workflow/rules/fidelity.smk: rule fidelity (compare_arm). Fidelity of an arm to its
engine's unquantized baseline: next-token KL, top-1, greedy.

Definition (written next to every number this module produces):

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

How KL is computed depends on what the engine gives: exactly from full logits
(the reference engine), or as a lower bound from top-k logprobs (vLLM), with
``kl_merged`` and ``kl_substituted`` the means of its two estimates and
``baseline_mass_topk`` the mean baseline mass of its top k (how much of the
distribution was compared id by id); fourbit.metrics.kl derives both and proves
the bounds.

How an engine takes part is its EngineSpec's ``fidelity`` (fourbit.engines.ENGINES).
Fidelity.PER_POSITION: a module-level function

    compare_with_baseline(arm_checkpoint, baseline_checkpoint, windows, settings, threads,
                          *, prompts, new_tokens, top_k) -> dict

returning {"method", "window_kl": [[float] per position] per window,
"window_top1": [[bool]...], "greedy_baseline": [[ids]], "greedy_arm": [[ids]],
"runtime": str, "baseline_runtime": str} and, for a top-k bound,
"window_kl_merged", "window_kl_substituted" and "window_mass_topk" like
window_kl. Fidelity.OWN_KL_MODE: the engine's own aggregate statistics over the
evaluation text, through

    divergence_from_baseline(arm_checkpoint, baseline_checkpoint, text_file, settings,
                             *, ctx, chunks) -> dict

returning "mean_kld", "kld_p99" and "same_top_p_percent" (llama.cpp: llama-perplexity's
KL mode, from full logits but on its own chunking, so labelled with its method), and
greedy continuations through

    greedy_continuations(checkpoint, prompts, new_tokens, settings) -> [[ids]]

Fidelity.NOT_COMPARED: a record saying so.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from fourbit.atomic import write_json
from fourbit.schema import block
from fourbit.engines import Fidelity, engine_spec, get_engine
from fourbit.hashing import require_sha256
from fourbit.metrics.kl import FULL

log = logging.getLogger("fourbit")

DEFINITION = (
    "KL(P_base || P_arm) in nats and top-1 agreement of the next-token distributions at "
    "positions 1..{last} of the first {windows} windows (the ppl positions), both run by the "
    "same engine; greedy: the first {prompt_tokens} tokens of the first {prompts} windows "
    "continued for exactly {new_tokens} tokens by each model (argmax, EOS ignored), "
    "identical = equal token for token"
)

OWN_KL_MODE = "llama-perplexity KL mode"
OWN_KL_DEFINITION = (
    "KL(P_base || P_arm) in nats and top-1 agreement ('same top') computed by llama-perplexity "
    "--kl-divergence from full logits: it tokenizes the evaluation text itself, cuts it into "
    "chunks of {ctx} tokens (BOS first when the vocabulary asks for it) and compares the second "
    "half of each of the first {chunks} chunks; greedy: the first {prompt_tokens} tokens of the "
    "first {prompts} windows continued for exactly {new_tokens} tokens by each model (argmax, EOS "
    "ignored), identical = equal token for token"
)
NOT_COMPARED = (
    "not computed for this engine: it returns neither full logits nor top-k logprobs of "
    "chosen token ids, and has no KL mode of its own"
)


def resolve_settings(given: Mapping) -> dict:
    """The config's ``fidelity`` block: ``given`` checked, the schema's defaults filled."""
    return block("fidelity", given)


def select(
    windows: Sequence[Sequence[int]], settings: Mapping
) -> tuple[list[list[int]], list[list[int]]]:
    """The windows whose positions are compared, and the greedy prompts."""
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


# --- the record's numbers -------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(compared: Mapping) -> dict:
    """Per-position results (an engine's compare_with_baseline) -> the record's numbers."""
    kl = [x for window in compared["window_kl"] for x in window]
    top1 = [x for window in compared["window_top1"] for x in window]
    if not kl or len(kl) != len(top1):
        raise ValueError(f"{len(kl)} KL values and {len(top1)} top-1 values; expected equal, > 0")
    result = {
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
    if "window_mass_topk" in compared:
        mass = [x for window in compared["window_mass_topk"] for x in window]
        result["baseline_mass_topk"] = math.fsum(mass) / len(mass)
        for name in ("merged", "substituted"):
            values = [x for window in compared[f"window_kl_{name}"] for x in window]
            result[f"kl_mean_{name}"] = math.fsum(values) / len(values)
    return result


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


# --- the step ---------------------------------------------------------------------------------


def compare_arm(
    arm_checkpoint: str | os.PathLike,
    baseline_checkpoint: str | os.PathLike,
    windows_path: str | os.PathLike,
    out_path: str | os.PathLike,
    engine_settings: Mapping,
    fidelity_settings: Mapping,
    *,
    threads: int,
    model_weights_sha256: str,
    cache_roots: Mapping[str, str | os.PathLike],
    text_path: str | os.PathLike | None = None,
) -> dict:
    """Compare one arm with the same engine's baseline; write ``out_path`` (JSON, atomically).

    ``model_weights_sha256``: the source model's weights both were made from
    (fourbit.hashing.model_weights_sha256), carried into the record, computed or not.
    ``cache_roots``: compile caches for engines that compile (vLLM), {"arm": .., "baseline":
    ..}, one per checkpoint and never shared between checkpoints; the workflow gives every
    arm's job the same baseline folder, so only the first job compiles the baseline.
    ``text_path``, the evaluation text, is read only by engines with their own KL mode."""
    require_sha256(model_weights_sha256)
    settings = resolve_settings(fidelity_settings)
    windows_file = json.loads(Path(windows_path).read_text())
    compared_windows, prompts = select(windows_file["windows"], settings)
    engine = get_engine(engine_settings["name"])
    record = {
        "definition": DEFINITION.format(
            last=len(compared_windows[0]) - 1, windows=len(compared_windows),
            prompt_tokens=settings["prompt_tokens"], prompts=len(prompts),
            new_tokens=settings["new_tokens"],
        ),
        "token_ids_sha256": windows_file["token_ids_sha256"],
        "model_weights_sha256": model_weights_sha256,
        "engine": dict(engine_settings),
        "settings": settings,
        "checkpoint": str(arm_checkpoint),
        "baseline": str(baseline_checkpoint),
        "windows": len(compared_windows),
    }
    how = engine_spec(engine_settings["name"]).fidelity
    if how is Fidelity.OWN_KL_MODE:
        if text_path is None:
            raise ValueError(f"engine {engine_settings['name']} compares on the evaluation text; "
                             "pass text_path")
        return _own_kl_mode(engine, arm_checkpoint, baseline_checkpoint, text_path, out_path,
                            record, engine_settings, prompts, ctx=len(compared_windows[0]))
    if how is Fidelity.NOT_COMPARED:
        record.update({"computed": False, "method": None, "reason": NOT_COMPARED})
        write_json(out_path, record)
        log.info("%s: %s", engine_settings["name"], NOT_COMPARED)
        return record

    run_settings = {**engine_settings, "cache_root": str(cache_roots["arm"]),
                    "baseline_cache_root": str(cache_roots["baseline"])}
    return _per_position(engine, arm_checkpoint, baseline_checkpoint, out_path, record,
                         run_settings, compared_windows, prompts, threads=threads)


def _per_position(engine, arm_checkpoint, baseline_checkpoint, out_path, record: dict,
                  engine_settings: Mapping, windows: list[list[int]], prompts: list[list[int]],
                  *, threads: int) -> dict:
    """The engine's compare_with_baseline on the compared windows, summarized."""
    settings = record["settings"]
    start = time.perf_counter()
    compared = engine.compare_with_baseline(
        Path(arm_checkpoint), Path(baseline_checkpoint), windows, engine_settings, threads,
        prompts=prompts, new_tokens=settings["new_tokens"], top_k=settings["top_k"],
    )
    record.update(
        {
            "computed": True,
            "method": compared["method"],
            "bound": "exact" if compared["method"] == FULL else "lower bound",
            **summarize(compared),
            "greedy": greedy_summary(compared["greedy_baseline"], compared["greedy_arm"],
                                     settings["new_tokens"]),
            "runtime": compared["runtime"],
            "baseline_runtime": compared["baseline_runtime"],
            "seconds": time.perf_counter() - start,
        }
    )
    return _written(record, out_path, arm_checkpoint, baseline_checkpoint)


def _own_kl_mode(engine, arm_checkpoint, baseline_checkpoint, text_path, out_path, record: dict,
                 engine_settings: Mapping, prompts: list[list[int]], *, ctx: int) -> dict:
    """The engine's own aggregate KL statistics, over as many chunks as windows are compared,
    and the greedy continuations of the same prompts as every other engine."""
    start = time.perf_counter()
    settings, new_tokens = dict(engine_settings), record["settings"]["new_tokens"]
    statistics = engine.divergence_from_baseline(
        Path(arm_checkpoint), Path(baseline_checkpoint), Path(text_path), settings, ctx=ctx,
        chunks=record["windows"],
    )
    greedy = {which: engine.greedy_continuations(Path(checkpoint), prompts, new_tokens, settings)
              for which, checkpoint in (("baseline", baseline_checkpoint), ("arm", arm_checkpoint))}
    record.update(
        {
            "computed": True,
            "method": OWN_KL_MODE,
            "bound": f"exact, its own chunking: {statistics['chunks']} chunks of {ctx} tokens",
            "definition": OWN_KL_DEFINITION.format(
                ctx=ctx, chunks=statistics["chunks"], prompts=len(prompts), new_tokens=new_tokens,
                prompt_tokens=record["settings"]["prompt_tokens"],
            ),
            "kl_mean": statistics["mean_kld"],
            "kl_mean_uncertainty": statistics["mean_kld_uncertainty"],
            "kl_p99": statistics["kld_p99"],
            "top1_agreement": statistics["same_top_p_percent"] / 100,
            "greedy": greedy_summary(greedy["baseline"], greedy["arm"], new_tokens),
            "llama_perplexity": statistics,
            "runtime": engine.runtime(Path(arm_checkpoint), settings),
            "baseline_runtime": engine.runtime(Path(baseline_checkpoint), settings),
            "seconds": time.perf_counter() - start,
        }
    )
    return _written(record, out_path, arm_checkpoint, baseline_checkpoint)


def _written(record: dict, out_path, arm_checkpoint, baseline_checkpoint) -> dict:
    """``record``, once written to ``out_path`` (JSON, atomically) and its numbers logged."""
    write_json(out_path, record)
    log.info("%s vs %s (%s): KL mean %.5f p99 %.5f, top-1 %.4f, greedy %d/%d identical (%.1f s)",
             arm_checkpoint, baseline_checkpoint, record["method"], record["kl_mean"],
             record["kl_p99"], record["top1_agreement"], record["greedy"]["identical"],
             record["greedy"]["prompts"], record["seconds"])
    return record
