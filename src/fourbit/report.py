"""`results/report.md` and `results/report.tsv`: one row per arm and engine.

Every number comes from a result file of this run; a missing or unreadable file
stops the report and names the file, instead of leaving a hole in the table.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from pathlib import Path

from fourbit.atomic import write_text
from fourbit.quantized_checkpoint import storage_stats
from fourbit.stats import CONFIDENCE, delta_ppl_interval, overlapping

log = logging.getLogger("fourbit")

COLUMNS = [
    "engine", "arm_id", "method", "group_size", "sym", "bits_per_weight", "file_bits_per_param",
    "size_mib", "ppl", "baseline_ppl", "delta_ppl", "delta_ppl_ci_low", "delta_ppl_ci_high",
    "delta_ppl_pct", "dense_ppl",
    "control_delta_nll", "control", "runtime", "throughput",
]


class ReportInputError(ValueError):
    """A result file the report needs is missing or corrupt."""


def read_result(path: str | os.PathLike) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as error:
        raise ReportInputError(f"{path}: result file is missing; rerun the step that writes it") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ReportInputError(f"{path}: result file is corrupt ({error}); delete it and rerun") from error


def _by_suffix(paths: list[str]) -> dict[tuple[str, str, str], str]:
    """(engine id, arm id or 'baseline', file name) -> path, from .../<engine>/<arm>/<file>."""
    index = {}
    for path in paths:
        parts = Path(path).parts
        index[(parts[-3], parts[-2], parts[-1])] = path
    return index


def build_rows(
    study: dict, results: list[str], arm_manifests: list[str], baseline_storage: dict[str, dict]
) -> list[dict]:
    """``baseline_storage``: by checkpoint kind ("hf", "gguf"), the unquantized baseline's storage."""
    index = _by_suffix(results)
    arms = {m["id"]: m for m in (read_result(p) for p in arm_manifests)}
    tolerance = study["evaluation"]["control_tolerance"]
    rows = []
    for engine_id, engine in study["engines"].items():
        baseline = read_result(index[(engine_id, "baseline", "dense.ppl.json")])
        unquantized = {"quant": {}, "storage": baseline_storage[engine["reads"]]}
        rows.append(_row(engine_id, "baseline", unquantized, baseline, baseline, None, None, tolerance))
        for arm in (a for a in study["arms"] if a["kind"] == engine["reads"]):
            arm_id = arm["id"]
            quantized = read_result(index[(engine_id, arm_id, "quantized.ppl.json")])
            dense_path = index.get((engine_id, arm_id, "dense.ppl.json"))
            dense = read_result(dense_path) if dense_path else None
            bench = read_result(index[(engine_id, arm_id, "bench.json")])
            rows.append(_row(engine_id, arm_id, arms[arm_id], quantized, baseline, dense, bench, tolerance))
    return rows


def _row(engine_id, arm_id, manifest, scored, baseline, dense, bench, tolerance) -> dict:
    if scored["token_ids_sha256"] != baseline["token_ids_sha256"]:
        raise ReportInputError(f"{arm_id} on {engine_id} scored other token ids than its baseline")
    quant, storage = manifest["quant"], manifest["storage"]
    delta, lower, upper = delta_ppl_interval(
        scored["window_nll_sum"], baseline["window_nll_sum"], baseline["window_tokens"]
    )
    row = {
        "engine": engine_id,
        "arm_id": arm_id,
        "method": quant.get("method", "none (unquantized)"),
        "group_size": quant.get("group_size", ""),
        "sym": quant.get("sym", ""),
        "bits_per_weight": storage.get("quantized_bits_per_weight", ""),
        "file_bits_per_param": storage.get("file_bits_per_param", ""),
        "size_mib": storage.get("size_mib", ""),
        "ppl": scored["ppl"],
        "baseline_ppl": baseline["ppl"],
        "delta_ppl": delta,
        "delta_ppl_ci_low": lower,
        "delta_ppl_ci_high": upper,
        "delta_ppl_pct": 100 * (scored["ppl"] / baseline["ppl"] - 1),
        "dense_ppl": dense["ppl"] if dense else "",
        "control_delta_nll": "",
        "control": "",
        "runtime": scored["runtime"],
        "throughput": "not measured" if bench is None or not bench.get("measured") else "measured",
    }
    if dense:
        delta = scored["mean_nll"] - dense["mean_nll"]
        row["control_delta_nll"] = delta
        row["control"] = "faithful" if abs(delta) <= tolerance else "NOT faithful"
    return row


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-3 and value != 0 else f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value)


def separability(rows: list[dict]) -> list[str]:
    """Say which differences the evaluation split resolves, instead of ranking noise."""
    notes = []
    arms = [r for r in rows if r["arm_id"] != "baseline"]
    for r in arms:
        if r["delta_ppl_ci_low"] <= 0 <= r["delta_ppl_ci_high"]:
            notes.append(
                f"- `{r['arm_id']}` ({r['engine']}): its interval includes 0; the evaluation split is "
                "too small to tell it from the unquantized model."
            )
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            if a["engine"] == b["engine"] and overlapping(
                (a["delta_ppl_ci_low"], a["delta_ppl_ci_high"]), (b["delta_ppl_ci_low"], b["delta_ppl_ci_high"])
            ):
                notes.append(
                    f"- `{a['arm_id']}` and `{b['arm_id']}` ({a['engine']}): intervals overlap; "
                    "not separable on this corpus, so the table does not rank them."
                )
    return notes or ["- Every arm's interval excludes 0 and no two arms' intervals overlap."]


def render_tsv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, delimiter="\t", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def render_markdown(study: dict, rows: list[dict], facts: dict) -> str:
    headers = ["engine", "arm", "method", "group", "sym", "bits/weight", "file bits/param", "size MiB",
               "ppl", f"Δppl vs baseline [{CONFIDENCE:.0%} CI]", "control (arm vs dense Δ nats/token)"]
    lines = [
        "# fourbit report",
        "",
        f"Model `{study['model']['id']}`, corpus `{study['corpus']['id']}`.",
        "",
    ]
    if study["model"]["source"] == "synthetic":
        lines += [
            "**The model has random weights (source: synthetic): every quality column below "
            "(ppl, Δppl, control) is meaningless; only sizes and speeds mean anything.**",
            "",
        ]
    if "training" in facts:
        t = facts["training"]
        lines += [
            f"The builtin model was trained by this workflow ({t['train_tokens_seen']} tokens, "
            f"{t['wall_seconds']:.0f} s); its held-out perplexity is {t['held_out_perplexity']:.2f} "
            f"over {t['held_out_tokens']} tokens, against {t['uniform_perplexity']} for a uniform guess.",
            "",
        ]
    lines += [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
    ]
    for r in rows:
        control = f"{r['control']} ({_fmt(r['control_delta_nll'])})" if r["control"] else "—"
        delta = "—" if r["arm_id"] == "baseline" else (
            f"{_fmt(r['delta_ppl'])} [{_fmt(r['delta_ppl_ci_low'])}, {_fmt(r['delta_ppl_ci_high'])}] "
            f"({r['delta_ppl_pct']:+.2f}%)"
        )
        cells = [r["engine"], f"`{r['arm_id']}`", r["method"], r["group_size"], r["sym"],
                 _fmt(r["bits_per_weight"]), _fmt(r["file_bits_per_param"]), _fmt(r["size_mib"]),
                 _fmt(r["ppl"]), delta, control]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "## What the evaluation split can and cannot tell apart", ""] + separability(rows)
    lines += [
        "",
        "## Throughput",
        "",
        "Not measured yet: the bench step is a placeholder in this version, so this report "
        "has no prefill or decode numbers.",
        "",
        "## Definitions",
        "",
        f"- **ppl**: {facts['definition']}; {facts['windows']} windows, {facts['tokens']} scored tokens, "
        "the same token ids for every row.",
        "- **Δppl vs baseline**: the arm's perplexity minus the unquantized (untied) model's, "
        f"both on the same engine; in brackets a {CONFIDENCE:.0%} interval from a paired bootstrap "
        "over windows (the same windows score both).",
        "- **bits/weight**: bits stored for the linear layers (codes, scales, zeros when "
        "quantized; the plain weights for the baseline) divided by their weight count; **file bits/param**: every stored tensor (embeddings, norms, the "
        "untied head's copy included) divided by the model's parameter count.",
        "- **control**: the arm run by its 4-bit runtime against its dense float32 expansion on the "
        "same engine; the mean NLL difference in nats/token. *faithful* if within "
        f"{study['evaluation']['control_tolerance']} nats/token; otherwise the runtime or the "
        "packing, not the quantizer, is wrong. llama.cpp (GGUF) arms have no dense expansion in "
        "this version, so no control (—).",
        "",
        "## Runtimes",
        "",
    ]
    for r in rows:
        lines.append(f"- `{r['arm_id']}` on {r['engine']}: {r['runtime']}")
    return "\n".join(lines) + "\n"


def write_report(
    study: dict,
    *,
    results: list[str],
    arm_manifests: list[str],
    markdown_path: str | os.PathLike,
    table_path: str | os.PathLike,
    baseline_checkpoint: str | os.PathLike,
    gguf_base_storage: str | os.PathLike | None = None,
    training_path: str | os.PathLike | None = None,
) -> None:
    storage = {"hf": storage_stats(baseline_checkpoint)}
    if gguf_base_storage:
        storage["gguf"] = read_result(gguf_base_storage)
    rows = build_rows(study, results, arm_manifests, storage)
    first = read_result(next(p for p in results if p.endswith("dense.ppl.json")))
    facts = {
        "definition": first["definition"],
        "windows": len(first["window_tokens"]),
        "tokens": first["tokens"],
    }
    if training_path and Path(training_path).is_file():
        facts["training"] = read_result(training_path)
    write_text(table_path, render_tsv(rows))
    write_text(markdown_path, render_markdown(study, rows, facts))
    log.info("report: %d rows", len(rows))
