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
starts no engine. Fidelity.NOT_COMPARED: a record saying so.
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
from fourbit.engines.base import ComparesPositions, KeepsSides, capable
from fourbit.hashing import require_sha256
from fourbit.metrics.fidelity import DEFINITION, greedy_summary, select, summarize
from fourbit.steps.evaluate import read_side

log = logging.getLogger("fourbit")

NOT_COMPARED = "not computed for this engine: it gives no whole next-token distributions"


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
) -> dict:
    """Compare one arm with the same engine's baseline; write the record to ``out_path``
    (fourbit.records.write: checked against its schema, then atomically).

    ``model_weights_sha256``: the source model's weights both were made from
    (fourbit.hashing.model_weights_sha256), carried into the record, computed or not.
    ``sides``, {"arm": .., "baseline": ..}: the sides the ppl jobs of the two checkpoints
    kept, read by engines that keep them (Fidelity.KEPT_SIDES), which then start no engine."""
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
    return _written(record, out_path)


def _written(record: dict, out_path) -> dict:
    """``record``, once written to ``out_path`` (fourbit.records.write) and its numbers logged."""
    records.write("fidelity", out_path, record)
    log.info("%s vs %s (%s): KL mean %.5f p99 %.5f, top-1 %.4f, greedy %d/%d identical (%.1f s)",
             record["checkpoint"], record["baseline"], record["method"], record["kl_mean"],
             record["kl_p99"], record["top1_agreement"], record["greedy"]["identical"],
             record["greedy"]["prompts"], record["seconds"])
    return record
