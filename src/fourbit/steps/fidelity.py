"""workflow/rules/fidelity.smk: rule fidelity (compare_arm). Fidelity of an arm to its
engine's unquantized baseline: next-token KL, top-1, greedy.

The definition of every number, and the arithmetic from per-position results to the
record's numbers: fourbit.metrics.fidelity.

How an engine takes part is its EngineSpec's ``fidelity`` (fourbit.engines.ENGINES),
and its class implements the capability that asks for (fourbit.engines.base).
Fidelity.PER_POSITION, a ComparesPositions:

    compare_with_baseline(arm_checkpoint, baseline_checkpoint, windows, settings, threads,
                          *, prompts, new_tokens) -> dict

returning {"method": fourbit.metrics.kl.FULL, "window_kl": [[float] per position] per
window, "window_top1": [[bool]...], "greedy_baseline": [[ids]], "greedy_arm": [[ids]],
"runtime": str, "baseline_runtime": str}: the KL exact, from both models' full logits.
Fidelity.KEPT_SIDES, a KeepsSides: the same from the two sides the ppl jobs of the
baseline and of the arm (as quantized, against the logits the baseline's job kept) kept
(fourbit.steps.evaluate), which the workflow declares as their outputs and passes here,
through

    compare_sides(arm_side, baseline_side, windows) -> dict

(all of the above but the runtimes, which come from the engine's runtime()): the job
starts no engine. Fidelity.OWN_KL_MODE, a HasOwnKlMode: the engine's own aggregate
statistics over the evaluation text, through

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
import os
import time
from collections.abc import Mapping
from pathlib import Path

from fourbit import records
from fourbit.schema import block
from fourbit.engines import Fidelity, engine_spec, get_engine
from fourbit.engines.base import ComparesPositions, HasOwnKlMode, KeepsSides, capable
from fourbit.hashing import require_sha256
from fourbit.metrics.fidelity import DEFINITION, greedy_summary, select, summarize
from fourbit.steps.evaluate import read_side

log = logging.getLogger("fourbit")

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
    "not computed for this engine: it gives no whole next-token distributions and has no KL "
    "mode of its own"
)


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
    sides: Mapping[str, str | os.PathLike] | None = None,
    text_path: str | os.PathLike | None = None,
) -> dict:
    """Compare one arm with the same engine's baseline; write the record to ``out_path``
    (fourbit.records.write: checked against its schema, then atomically).

    ``model_weights_sha256``: the source model's weights both were made from
    (fourbit.hashing.model_weights_sha256), carried into the record, computed or not.
    ``sides``, {"arm": .., "baseline": ..}: the sides the ppl jobs of the two checkpoints
    kept, read by engines that keep them (Fidelity.KEPT_SIDES), which then start no engine.
    ``text_path``, the evaluation text, is read only by engines with their own KL mode."""
    require_sha256(model_weights_sha256)
    settings = block("fidelity", fidelity_settings)
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
        return _own_kl_mode(capable(engine, HasOwnKlMode), arm_checkpoint, baseline_checkpoint,
                            text_path, out_path, record, engine_settings, prompts,
                            ctx=len(compared_windows[0]))
    if how is Fidelity.NOT_COMPARED:
        record.update({"computed": False, "method": None, "reason": NOT_COMPARED})
        records.write("fidelity", out_path, record)
        log.info("%s: %s", engine_settings["name"], NOT_COMPARED)
        return record

    start = time.perf_counter()
    if how is Fidelity.KEPT_SIDES:
        compared = _from_sides(capable(engine, KeepsSides), sides, record, compared_windows)
    else:
        compared = capable(engine, ComparesPositions).compare_with_baseline(
            Path(arm_checkpoint), Path(baseline_checkpoint), compared_windows,
            dict(engine_settings), threads, prompts=prompts, new_tokens=settings["new_tokens"])
    return _per_position(compared, record, out_path, start)


def _from_sides(engine: KeepsSides, sides: Mapping[str, str | os.PathLike] | None, record: dict,
                windows: list[list[int]]) -> dict:
    """The engine's compare_sides on the two kept sides, each checked to be of this
    comparison, and what runs each checkpoint (read from its files: no engine starts)."""
    if sides is None:
        raise ValueError(f"engine {record['engine']['name']} compares the sides its ppl jobs "
                         "kept; pass sides")
    kept = {which: read_side(sides[which], record["settings"], record["token_ids_sha256"])
            for which in ("arm", "baseline")}
    return {
        **engine.compare_sides(kept["arm"], kept["baseline"], windows),
        "runtime": engine.runtime(Path(record["checkpoint"]), record["engine"]),
        "baseline_runtime": engine.runtime(Path(record["baseline"]), record["engine"]),
    }


def _per_position(compared: dict, record: dict, out_path, start: float) -> dict:
    """``record`` with per-position results (an engine's compare_with_baseline or
    compare_sides) summarized, written."""
    new_tokens = record["settings"]["new_tokens"]
    record.update(
        {
            "computed": True,
            "method": compared["method"],
            "bound": "exact",
            **summarize(compared),
            "greedy": greedy_summary(compared["greedy_baseline"], compared["greedy_arm"],
                                     new_tokens),
            "runtime": compared["runtime"],
            "baseline_runtime": compared["baseline_runtime"],
            "seconds": time.perf_counter() - start,
        }
    )
    return _written(record, out_path, record["checkpoint"], record["baseline"])


def _own_kl_mode(engine: HasOwnKlMode, arm_checkpoint, baseline_checkpoint, text_path, out_path, record: dict,
                 engine_settings: Mapping, prompts: list[list[int]], *, ctx: int) -> dict:
    """The engine's own aggregate KL statistics, over as many chunks as windows are compared,
    and the greedy continuations of the same prompts as every other engine."""
    if text_path is None:
        raise ValueError(f"engine {record['engine']['name']} compares on the evaluation text; "
                         "pass text_path")
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
    """``record``, once written to ``out_path`` (fourbit.records.write) and its numbers logged."""
    records.write("fidelity", out_path, record)
    log.info("%s vs %s (%s): KL mean %.5f p99 %.5f, top-1 %.4f, greedy %d/%d identical (%.1f s)",
             arm_checkpoint, baseline_checkpoint, record["method"], record["kl_mean"],
             record["kl_p99"], record["top1_agreement"], record["greedy"]["identical"],
             record["greedy"]["prompts"], record["seconds"])
    return record
