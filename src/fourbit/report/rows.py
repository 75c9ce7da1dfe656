"""The report's rows, one per arm and engine (each engine's baseline first), built from
the records; and their TSV form.

A row is a dict with every key of COLUMNS (plus ``_measures``, the distribution
measures verdicts compares); a value the records do not have is None, which the TSV
writes as an empty field and the markdown as a blank or a dash.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping

from fourbit.bench.bandwidth import decode_roofline
from fourbit.bench.passes import summarize
from fourbit.metrics.stats import delta_ppl_interval
from fourbit.report.frontier import family
from fourbit.report.loading import Records, ReportInputError
from fourbit.report.verdicts import distribution_measures

COLUMNS = [
    "engine", "arm_id", "method", "family", "group_size", "sym", "bits_per_weight", "matrix_bits_per_weight",
    "file_bits_per_param",
    "size_mib", "ppl", "baseline_ppl", "delta_ppl", "delta_ppl_ci_low", "delta_ppl_ci_high",
    "delta_ppl_pct", "dense_ppl",
    "control_delta_nll", "control", "numerics", "control_tolerance", "runtime",
    "timed_runtime", "compile_s",
    "pp512_median", "pp512_min", "pp512_max", "pp512_ratio",
    "tg128_median", "tg128_min", "tg128_max", "tg128_ratio",
    "decode_bandwidth_fraction", "max_busy_before_pass", "min_resident_fraction", "throughput_note",
    "kl_mean", "kl_p99", "kl_from", "top1_agreement", "greedy_identical", "greedy_prompts",
    "ppl_below_baseline",
]
METRICS = {"pp512": "pp512_tok_s", "tg128": "tg128_tok_s"}


def build_rows(
    study: dict, records: Records, manifests: list[dict], baseline_storage: dict[str, dict],
    benches: dict[str, list[dict]],
) -> list[dict]:
    """``manifests``: the arms' arm.json records; ``baseline_storage``: by checkpoint kind
    ("hf", "gguf"), the unquantized baseline's storage; ``benches``: each engine's bench
    records (records.bench_records)."""
    arms = {m["id"]: m for m in manifests}
    tolerances = study["evaluation"]["control_tolerance"]  # by numerics
    rows = []
    for engine_id, engine in study["engines"].items():
        if engine["unavailable"]:
            continue  # said under the table (markdown.unavailable_engines)
        baseline = records[engine_id]["baseline"]["ppl_dense"].data
        unquantized = {"quant": {}, "storage": baseline_storage[engine["reads"]]}
        engine_rows = []
        for arm_id, bench in zip(engine["arms"], benches[engine_id]):
            arm = records[engine_id][arm_id]
            fidelity = arm["fidelity"].data
            row = _row(engine_id, arm_id, arms[arm_id], arm["ppl_quantized"].data, baseline,
                       arm["ppl_dense"].data, tolerances)
            engine_rows.append({**row, "family": family(arms[arm_id]["quant"], engine["name"]),
                                **_throughput([bench], "arm"), **_fidelity(fidelity),
                                "_measures": distribution_measures(fidelity),
                                "_variant_tg128": _variant_decode(bench)})
        base_row = _row(engine_id, "baseline", unquantized, baseline, baseline, None, tolerances)
        rows += [{**base_row, "family": None, **_throughput(benches[engine_id], "baseline"),
                  **_fidelity(None), "_measures": None},
                 *engine_rows]
    return rows


def _row(engine_id, arm_id, manifest, scored, baseline, dense, tolerances) -> dict:
    """Quality columns: perplexity, Δppl and its interval, and the control (``dense``,
    the arm's dense expansion; None for a baseline, which has no control), judged at the
    tolerance of what the arm's runtime rounds (``tolerances`` by its record's numerics)."""
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
        "group_size": quant.get("group_size"),
        "sym": quant.get("sym"),
        "bits_per_weight": storage.get("quantized_bits_per_weight"),
        # None for a checkpoint whose storage record predates the count (rerun its quantize)
        "matrix_bits_per_weight": storage.get("matrix_bits_per_weight"),
        "file_bits_per_param": storage.get("file_bits_per_param"),
        "size_mib": storage.get("size_mib"),
        "ppl": scored["ppl"],
        "baseline_ppl": baseline["ppl"],
        "delta_ppl": delta,
        "delta_ppl_ci_low": lower,
        "delta_ppl_ci_high": upper,
        "delta_ppl_pct": 100 * (scored["ppl"] / baseline["ppl"] - 1),
        "dense_ppl": dense["ppl"] if dense else None,
        "control_delta_nll": None,
        "control": None,
        "numerics": scored["numerics"],
        "control_tolerance": None,
        "runtime": scored["runtime"],
        "ppl_below_baseline": upper < 0,
    }
    if dense:
        row.update(control(scored, dense, tolerances))
    return row


def control(scored: dict, dense: dict, tolerances: Mapping[str, float]) -> dict:
    """The control of an arm scored as stored (``scored``) and as its dense expansion
    (``dense``), both ppl records: faithful when their mean NLLs differ by at most the
    tolerance of the arm's numerics (evaluation.control_tolerance)."""
    delta = scored["mean_nll"] - dense["mean_nll"]
    tolerance = tolerances[scored["numerics"]]
    return {"control_delta_nll": delta, "control_tolerance": tolerance,
            "control": "faithful" if abs(delta) <= tolerance else "NOT faithful"}


def _variant_decode(bench: dict) -> dict[str, dict]:
    """Each runtime variant the bench timed beside the arm (bench.runtimes) by name: its
    tg128 {median, min, max, ...} over passes."""
    timed = (bench.get("variants") or {}).get("timed", []) if bench.get("measured") else []
    return {variant["name"]: variant["stats"][METRICS["tg128"]] for variant in timed}


def _throughput(benches: list[dict], side: str) -> dict:
    """Median [min, max] over passes, the paired ratio, and the checks before the passes.

    ``benches``: the arm's own record for its row; for the baseline's row, every record of
    its engine. The baseline ran one pass paired with each pass of each of its arms, all in
    the one bench job, so its row pools them.
    """
    measured = [b for b in benches if b.get("measured")]
    if not measured:
        note = benches[0].get("reason", "not measured") if benches else "no arm to pair it with"
        return {f"{short}_{stat}": None for short in METRICS for stat in ("median", "min", "max", "ratio")} | {
            "decode_bandwidth_fraction": None, "max_busy_before_pass": None, "min_resident_fraction": None,
            "throughput_note": note, "timed_runtime": None, "compile_s": None,
        }
    out = {}
    for short, metric in METRICS.items():
        stats = summarize([value for b in measured for value in b[side]["stats"][metric]["values"]])
        out |= {f"{short}_median": stats["median"], f"{short}_min": stats["min"], f"{short}_max": stats["max"]}
        out[f"{short}_ratio"] = measured[0]["ratio"][metric]["median"] if side == "arm" else 1.0
    residency = [run["checks"]["residency"][side]["resident_fraction"] for b in measured
                 for run in b["runs"]]
    roofline = decode_roofline(measured[0][side]["weight_bytes_per_token"]["bytes"], out["tg128_median"],
                               measured[0]["bandwidth"]["gbs"])
    passes = sum(b["passes"] for b in measured)
    note = f"{passes} passes" + (f", paired with {len(measured)} arms" if len(measured) > 1 else "")
    if any(b["contention"]["override_used"] for b in measured):
        note += "; busy-core override used"
    # What ran in the timed passes (vLLM compiled, where it scored eager) and the seconds its
    # untimed start spent compiling; a baseline opened once for the job has one start.
    start = measured[0][side].get("start")
    return out | {
        "timed_runtime": measured[0][side].get("runtime"),
        "compile_s": start["compile_s"] if start else None,
        "decode_bandwidth_fraction": roofline["fraction_of_limit"],
        "max_busy_before_pass": max(b["contention"]["max_busy"] for b in measured),
        "min_resident_fraction": min(residency),
        "throughput_note": note,
    }


def _fidelity(record: dict | None) -> dict:
    """KL and top-1 agreement against the baseline's next-token distribution; greedy matches.
    ``kl_from`` says where they came from, or why they were not computed."""
    if record is None or not record.get("computed", True):
        return {"kl_mean": None, "kl_p99": None, "kl_from": record.get("reason") if record else None,
                "top1_agreement": None, "greedy_identical": None, "greedy_prompts": None}
    return {
        "kl_mean": record["kl_mean"],
        "kl_p99": record["kl_p99"],
        "kl_from": f"{record['method']} ({record['bound']})",
        "top1_agreement": record["top1_agreement"],
        "greedy_identical": record["greedy"]["identical"],
        "greedy_prompts": record["greedy"]["prompts"],
    }


def render_tsv(rows: list[dict]) -> str:
    """The rows under COLUMNS' names, tab-separated; a missing value (None) is an empty field."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, delimiter="\t", lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: r[key] for key in COLUMNS} for r in rows)
    return out.getvalue()
