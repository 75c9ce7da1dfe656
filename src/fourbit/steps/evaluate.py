"""workflow/rules/evaluate.smk: rules tokenize_evaluation (tokenize_windows) and ppl,
with its variants ppl_baseline and *_with_side (score_checkpoint). Teacher-forced
perplexity, defined once and applied identically to every engine.

Definition (written next to every number this module produces):
the evaluation split is tokenized once, as one stream, without BOS or other
special tokens; the stream is cut into non-overlapping windows of W tokens (a
trailing partial window is dropped; at most ``max_windows`` windows, from the
start). Each window is scored on its own: position 0 is context only, positions
1..W-1 are scored as -log p(token_t | tokens_<t of the same window). So every
window contributes W-1 scored tokens, and perplexity is exp(total NLL / total
scored tokens). Every engine scores exactly the same token ids, read from one
windows file, so tokenizer and chunking differences cannot enter.

Outputs keep per-window NLL sums and token counts, so confidence intervals and
paired comparisons need no rerun.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

from fourbit import records
from fourbit.atomic import write_json
from fourbit.schema import block
from fourbit.engines import engine_spec, get_engine
from fourbit.engines.base import Engine, KeepsSides, WindowScore, capable
from fourbit.hashing import canonical_json, file_sha256, require_sha256
from fourbit.metrics.fidelity import select

log = logging.getLogger("fourbit")

DEFINITION = (
    "teacher-forced; evaluation split tokenized as one stream without BOS; "
    "non-overlapping windows of {window} tokens; positions 1..{last} of each window "
    "scored (position 0 is context only); ppl = exp(sum NLL / scored tokens)"
)


def tokenize_windows(
    model_dir: str | os.PathLike,
    evaluation_text: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    window: int,
    max_windows: int,
) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = Path(evaluation_text).read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    available = len(ids) // window
    if available == 0:
        raise ValueError(
            f"{evaluation_text}: {len(ids)} tokens is less than one window of {window}; "
            "use a larger evaluation split or a smaller evaluation.window"
        )
    count = min(available, max_windows)
    windows = [ids[i * window : (i + 1) * window] for i in range(count)]
    result = {
        "definition": DEFINITION.format(window=window, last=window - 1),
        "window": window,
        "windows": windows,
        "available_windows": available,
        "scored_tokens": count * (window - 1),
        "evaluation_sha256": file_sha256(evaluation_text),
        "token_ids_sha256": hashlib.sha256(canonical_json(windows).encode()).hexdigest(),
    }
    write_json(out_path, result)
    log.info("%d windows of %d tokens (%d available); %d tokens scored per engine",
             count, window, available, result["scored_tokens"])
    return result


def score_checkpoint(
    checkpoint: str | os.PathLike,
    windows_path: str | os.PathLike,
    out_path: str | os.PathLike,
    engine_settings: dict,
    *,
    threads: int,
    model_weights_sha256: str,
    cache_root: str | os.PathLike,
    side_path: str | os.PathLike | None = None,
    fidelity_settings: Mapping | None = None,
    baseline_logits: str | os.PathLike | None = None,
    baseline_side: str | os.PathLike | None = None,
) -> dict:
    """Score ``checkpoint`` on the windows; write the record to ``out_path``
    (fourbit.records.write). ``model_weights_sha256``: the source model's weights this
    checkpoint was made from (fourbit.hashing.model_weights_sha256), carried into the
    record so the report never mixes records of other weights.
    ``cache_root``: vLLM's compile caches for this checkpoint alone (vLLM's cache shared
    between arms can load another arm's graph); the workflow names it.
    ``side_path``: for a checkpoint the fidelity step compares, on an engine that keeps its
    side (EngineSpec.keeps_fidelity_side), where to write that side, computed in the same
    engine pass with ``fidelity_settings`` (the config's fidelity block); the scores are
    the same either way. With it, ``baseline_logits``: the baseline's logits of the
    compared windows, which the baseline's job (``baseline_side`` None) writes there and an
    arm's job (``baseline_side``, the side the baseline's job wrote) compares with."""
    require_sha256(model_weights_sha256)
    windows_file = json.loads(Path(windows_path).read_text())
    windows = windows_file["windows"]
    engine = get_engine(engine_settings["name"])
    settings = {**engine_settings, "cache_root": str(cache_root)}
    if side_path is None:
        per_window = engine.score_windows(Path(checkpoint), windows, settings, threads)
    else:
        per_window = _score_keeping_side(engine, checkpoint, windows_file, settings, threads,
                                         block("fidelity", fidelity_settings), side_path,
                                         baseline_logits, baseline_side)
    nll = [w["nll_sum"] for w in per_window]
    tokens = [w["tokens"] for w in per_window]
    total_nll, total_tokens = math.fsum(nll), sum(tokens)
    result = {
        "definition": windows_file["definition"],
        "token_ids_sha256": windows_file["token_ids_sha256"],
        "model_weights_sha256": model_weights_sha256,
        "engine": engine_settings,
        "checkpoint": str(checkpoint),
        "runtime": engine.runtime(Path(checkpoint), engine_settings),
        # What the runtime rounds beyond the dense expansion, for the control's tolerance.
        "numerics": engine.numerics(Path(checkpoint), engine_settings,
                                    rows=min(len(w) for w in windows)),
        "window_nll_sum": nll,
        "window_tokens": tokens,
        "nll_sum": total_nll,
        "tokens": total_tokens,
        "mean_nll": total_nll / total_tokens,
        "ppl": math.exp(total_nll / total_tokens),
    }
    records.write("ppl", out_path, result)
    log.info("%s: ppl %.4f over %d tokens (%s)", checkpoint, result["ppl"], total_tokens, result["runtime"])
    return result


def _score_keeping_side(engine: Engine, checkpoint, windows_file: dict, settings: dict,
                        threads: int, fidelity: dict, side_path, baseline_logits,
                        baseline_side) -> list[WindowScore]:
    """The engine's score_keeping_side: the per-window scores, and the side written to
    ``side_path`` (JSON, atomically) with the fidelity settings and token ids it was
    computed for, which every reader of a side checks (read_side)."""
    if not engine_spec(settings["name"]).keeps_fidelity_side:
        raise ValueError(f"engine {settings['name']} keeps no fidelity side; pass no side_path")
    if baseline_logits is None:
        raise ValueError("a fidelity side needs baseline_logits: where the baseline's job writes "
                         "its logits, and an arm's job reads them")
    token_ids = windows_file["token_ids_sha256"]
    baseline = None if baseline_side is None else read_side(baseline_side, fidelity, token_ids)
    compared, prompts = select(windows_file["windows"], fidelity)
    per_window, side = capable(engine, KeepsSides).score_keeping_side(
        Path(checkpoint), windows_file["windows"], settings, threads, compared=len(compared),
        prompts=prompts, new_tokens=fidelity["new_tokens"], baseline_logits=Path(baseline_logits),
        baseline=baseline)
    write_json(side_path, {**side, "fidelity": fidelity, "token_ids_sha256": token_ids})
    log.info("%s: fidelity side kept in %s", checkpoint, side_path)
    return per_window


def read_side(path: str | os.PathLike, fidelity: Mapping, token_ids_sha256: str) -> dict:
    """The side in ``path`` if its ppl job kept it for these fidelity settings (the
    config's block, its defaults filled) and token ids; else an error naming what differs."""
    side = json.loads(Path(path).read_text())
    kept_for = {"settings": side["fidelity"], "token_ids_sha256": side["token_ids_sha256"]}
    wanted = {"settings": dict(fidelity), "token_ids_sha256": token_ids_sha256}
    if kept_for != wanted:
        raise ValueError(f"{path} was kept for {kept_for}, not {wanted}; rerun the ppl job that "
                         "writes it")
    return side
