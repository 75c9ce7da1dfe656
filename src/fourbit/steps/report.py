"""workflow/rules/report.smk: rule report (write_report). `results/report.md` and
`results/report.tsv`: one row per arm and engine.

Every number comes from a result file of this run; a missing or unreadable file
stops the report and names the file, instead of leaving a hole in the table.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from fourbit.atomic import write_text
from fourbit.bench.bandwidth import decode_roofline
from fourbit.bench.passes import summarize
from fourbit.checkpoints.quantized import storage_stats
from fourbit.metrics.stats import CONFIDENCE, delta_ppl_interval, overlapping
from fourbit.report.verdicts import (
    below_baseline,
    distribution_measures,
    fmt_value,
    recommend,
    recommendation_rules,
    throughput_span,
)

log = logging.getLogger("fourbit")

COLUMNS = [
    "engine", "arm_id", "method", "group_size", "sym", "bits_per_weight", "file_bits_per_param",
    "size_mib", "ppl", "baseline_ppl", "delta_ppl", "delta_ppl_ci_low", "delta_ppl_ci_high",
    "delta_ppl_pct", "dense_ppl",
    "control_delta_nll", "control", "runtime",
    "pp512_median", "pp512_min", "pp512_max", "pp512_ratio",
    "tg128_median", "tg128_min", "tg128_max", "tg128_ratio",
    "decode_bandwidth_fraction", "max_busy_before_pass", "min_resident_fraction", "throughput_note",
    "kl_mean", "kl_p99", "kl_bound", "top1_agreement", "greedy_identical", "greedy_prompts",
    "ppl_below_baseline",
]
METRICS = {"pp512": "pp512_tok_s", "tg128": "tg128_tok_s"}


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
    study: dict, results: list[str], arm_manifests: list[str], baseline_storage: dict[str, dict],
    benches: dict[str, list[dict]],
) -> list[dict]:
    """``baseline_storage``: by checkpoint kind ("hf", "gguf"), the unquantized baseline's
    storage; ``benches``: each engine's bench records (bench_records)."""
    index = _by_suffix(results)
    arms = {m["id"]: m for m in (read_result(p) for p in arm_manifests)}
    tolerance = study["evaluation"]["control_tolerance"]
    rows = []
    for engine_id, engine in study["engines"].items():
        if engine["unavailable"]:
            continue  # said under the table (unavailable_engines)
        baseline = read_result(index[(engine_id, "baseline", "dense.ppl.json")])
        unquantized = {"quant": {}, "storage": baseline_storage[engine["reads"]]}
        engine_rows = []
        for arm_id, bench in zip(engine["arms"], benches[engine_id]):
            quantized = read_result(index[(engine_id, arm_id, "quantized.ppl.json")])
            dense_path = index.get((engine_id, arm_id, "dense.ppl.json"))
            dense = read_result(dense_path) if dense_path else None
            fidelity = read_result(index[(engine_id, arm_id, "fidelity.json")])
            row = _row(engine_id, arm_id, arms[arm_id], quantized, baseline, dense, tolerance)
            engine_rows.append({**row, **_throughput([bench], "arm"), **_fidelity(fidelity),
                                "_measures": distribution_measures(fidelity)})
        base_row = _row(engine_id, "baseline", unquantized, baseline, baseline, None, tolerance)
        rows += [{**base_row, **_throughput(benches[engine_id], "baseline"), **_fidelity(None),
                  "_measures": None},
                 *engine_rows]
    return rows


def bench_records(study: dict, results: list[str]) -> dict[str, list[dict]]:
    """Each engine that ran here: its arms' bench records, in its arms' order, read once.

    Every measured record must come from the same bench job: rows timed in separate
    jobs saw different hosts (a shared host's speed drifts over minutes), so their
    absolute tok/s are not comparable and their baselines not poolable.
    """
    index = _by_suffix(results)
    benches = {}
    first_job = None
    for engine_id, engine in study["engines"].items():
        if engine["unavailable"]:
            continue
        benches[engine_id] = []
        for arm_id in engine["arms"]:
            path = index[(engine_id, arm_id, "bench.json")]
            bench = read_result(path)
            if bench.get("measured"):
                if "job" not in bench:
                    raise ReportInputError(
                        f"{path}: written by an older fourbit (one bench job per arm); rerun the "
                        "bench step, which times every arm in one job: snakemake --forcerun bench"
                    )
                first_job = first_job or (path, bench["job"])
                if bench["job"] != first_job[1]:
                    raise ReportInputError(
                        f"{path}: timed in another bench job ({bench['job']['started']}) than "
                        f"{first_job[0]} ({first_job[1]['started']}); rows from separate jobs are "
                        "not comparable; rerun the bench step: snakemake --forcerun bench"
                    )
            benches[engine_id].append(bench)
    return benches


# The rule that writes each kind of record: what to rerun when one must be remade.
RECORD_RULES = {"ppl.json": "ppl", "fidelity.json": "fidelity", "bench.json": "bench"}


def _rule_of(path: str) -> str:
    return next(rule for suffix, rule in RECORD_RULES.items() if path.endswith(suffix))


def check_same_weights(study: dict, results: list[str]) -> str | None:
    """Every record must name the weights it was computed from, and all must name the same.

    One model id can come to mean other weights (the builtin model retrained on a host
    whose kernels round differently, a local folder edited in place): records made before
    and after then sit side by side, and a Δppl or a ratio between them compares two
    models. The hash says which weights each record saw."""
    first: tuple[str, str] | None = None
    carriers: dict[str, list[str]] = {}
    for path in results:
        record = read_result(path)
        if "model_weights_sha256" not in record:
            raise ReportInputError(
                f"{path}: has no model_weights_sha256, so it was written by an older fourbit "
                "that did not record which weights it was computed from; rerun it: "
                f"snakemake --forcerun {_rule_of(str(path))}"
            )
        weights = record["model_weights_sha256"]
        carriers.setdefault(weights, []).append(str(path))
        first = first or (str(path), weights)
    if len(carriers) < 2:
        return first[1] if first else None
    other = next(w for w in carriers if w != first[1])
    rules = sorted({_rule_of(p) for p in results})
    raise ReportInputError(
        f"records under model id {study['model']['id']} were computed from different weights: "
        f"{first[0]} from model_weights_sha256 {first[1]} ({len(carriers[first[1]])} records), "
        f"{carriers[other][0]} from {other} ({len(carriers[other])} records)"
        + (f" and {len(carriers) - 2} more hash(es)" if len(carriers) > 2 else "")
        + "; the model under this id changed between runs (e.g. the builtin model retrained on "
        "another CPU). Rerun every record from the weights now in place: "
        f"snakemake --forcerun {' '.join(rules)}"
    )


def _fidelity(record: dict | None) -> dict:
    """KL and top-1 agreement against the baseline's next-token distribution; greedy matches."""
    if record is None or not record.get("computed", True):
        return {"kl_mean": "", "kl_p99": "", "kl_bound": record.get("reason", "") if record else "",
                "top1_agreement": "", "greedy_identical": "", "greedy_prompts": ""}
    return {
        "kl_mean": record["kl_mean"],
        "kl_p99": record["kl_p99"],
        "kl_bound": f"{record['method']} ({record['bound']})",
        "top1_agreement": record["top1_agreement"],
        "greedy_identical": record["greedy"]["identical"],
        "greedy_prompts": record["greedy"]["prompts"],
    }


def fidelity_table(rows: list[dict]) -> list[str]:
    headers = ["engine", "arm", "KL mean (nats)", "KL p99", "top-1 agreement", "greedy identical", "from"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in (r for r in rows if r["arm_id"] != "baseline"):
        if r["kl_mean"] == "":
            cells = [r["engine"], f"`{r['arm_id']}`", "—", "—", "—", "—", r["kl_bound"] or "not computed"]
        else:
            lower = "≥ " if "lower" in r["kl_bound"] else ""
            cells = [r["engine"], f"`{r['arm_id']}`", f"{lower}{r['kl_mean']:.4g}", f"{lower}{r['kl_p99']:.4g}",
                     f"{r['top1_agreement']:.1%}", f"{r['greedy_identical']}/{r['greedy_prompts']}",
                     r["kl_bound"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _throughput(benches: list[dict], side: str) -> dict:
    """Median [min, max] over passes, the paired ratio, and the checks before the passes.

    ``benches``: the arm's own record for its row; for the baseline's row, every record of
    its engine. The baseline ran one pass paired with each pass of each of its arms, all in
    the one bench job, so its row pools them.
    """
    measured = [b for b in benches if b.get("measured")]
    if not measured:
        note = benches[0].get("reason", "not measured") if benches else "no arm to pair it with"
        return {key: "" for key in COLUMNS if key.startswith(("pp512", "tg128"))} | {
            "decode_bandwidth_fraction": "", "max_busy_before_pass": "", "min_resident_fraction": "",
            "throughput_note": note,
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
    return out | {
        "decode_bandwidth_fraction": roofline["fraction_of_limit"],
        "max_busy_before_pass": max(b["contention"]["max_busy"] for b in measured),
        "min_resident_fraction": min(residency),
        "throughput_note": note,
    }


def bench_job(benches: dict[str, list[dict]]) -> list[str]:
    """How the throughput rows were timed: one job, its arms interleaved in rounds."""
    measured = [b for records in benches.values() for b in records if b.get("measured")]
    if not measured:
        return []
    engines = sum(1 for records in benches.values() if any(b.get("measured") for b in records))
    job = measured[0]["job"]
    minutes = max(run["started_s"] for b in measured for run in b["runs"]) / 60
    return [
        f"All {len(measured)} arms of {engines} engine(s) were timed in one bench job (started "
        f"{job['started']}), in {measured[0]['passes']} rounds over {minutes:.1f} min: each round "
        "gave every arm one pass, paired back to back with its engine's baseline, the arms' "
        "order rotated between rounds. Every row's passes span the whole job and saw the same "
        "host, so absolute tok/s compare across rows and engines; ×base, a ratio within each "
        "pass, cancels the drift that remains."
    ]


def _row(engine_id, arm_id, manifest, scored, baseline, dense, tolerance) -> dict:
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
        "ppl_below_baseline": upper < 0,
    }
    if dense:
        delta = scored["mean_nll"] - dense["mean_nll"]
        row["control_delta_nll"] = delta
        row["control"] = "faithful" if abs(delta) <= tolerance else "NOT faithful"
    return row


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


def throughput_table(rows: list[dict]) -> list[str]:
    headers = ["engine", "arm", "pp512 tok/s [min–max] ×base", "tg128 tok/s [min–max] ×base",
               "decode BW", "busy", "resident", "note"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        measured = r["pp512_median"] != ""
        cells = [r["engine"], f"`{r['arm_id']}`", throughput_span(r, "pp512"), throughput_span(r, "tg128"),
                 _bandwidth(r["decode_bandwidth_fraction"]) if measured else "—",
                 f"{r['max_busy_before_pass']:.0%}" if measured else "—",
                 f"{r['min_resident_fraction']:.0%}" if measured else "—", r["throughput_note"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _bandwidth(fraction: float) -> str:
    # Above the DRAM triad, the weights are being read from the CPU's caches.
    return f"{fraction:.0%}" + (" (in cache)" if fraction > 1 else "")


def host_block(study: dict, facts: dict, rows: list[dict]) -> list[str]:
    engines = {r["engine"]: r["runtime"] for r in rows if r["arm_id"] == "baseline"}
    lines = [
        f"- Model: `{study['model']['id']}` ({study['model']['source']}); weights sha256: "
        + ", ".join(f"{k} {v[:16]}…" for k, v in facts.get("model_sha256", {}).items()),
        f"- Every record above computed from the weights with model_weights_sha256 "
        f"{facts.get('records_weights_sha256')}",
        f"- Corpus: `{study['corpus']['id']}` ({study['corpus']['source']}); split sha256: "
        + ", ".join(f"{k} {v[:16]}…" for k, v in facts.get("corpus_sha256", {}).items()),
        *(f"- Engine {engine}: {runtime} (its 4-bit runtimes: under Runtimes)"
          for engine, runtime in engines.items()),
    ]
    host = facts.get("provenance")
    if host is None:
        return lines + ["- No benchmark ran, so no host measurements were recorded."]
    isa = ", ".join(flag for flag, present in host["isa"].items() if present) or "none of interest"
    versions = ", ".join(f"{k} {v}" for k, v in sorted(host["versions"].items()))
    return lines + [
        f"- CPU: {host['cpu_model']}; ISA: {isa}",
        f"- Cores used: {host['cores']} ({host['threads']} threads); load average {' '.join(f'{x:.2f}' for x in host['load_average'])}",
        f"- Memory bandwidth (STREAM-like triad at the start of the bench job, on its cores): "
        f"{_bandwidth_measured(facts['bandwidth'])}",
        f"- Versions: {versions}",
        f"- Environment: {host['env'] or 'no OMP_/VLLM_/KMP_ variables set'}",
    ]


def _bandwidth_measured(bandwidth: dict) -> str:
    repeats = bandwidth.get("gbs_per_repeat", [])
    if len(repeats) < 2:
        return f"{bandwidth['gbs']:.1f} GB/s"
    return f"{bandwidth['gbs']:.1f} GB/s (best of {len(repeats)} repeats; slowest {min(repeats):.1f})"


PLOTS = ("report-quality-vs-bits.png", "report-quality-vs-decode.png")


def plot(rows: list[dict], folder: Path) -> list[tuple[str, str]]:
    """Quality against bits per weight, and against decode speed; PNGs next to the report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [r for r in rows if r["arm_id"] != "baseline"]
    made = []
    for name, title, x_key, x_label in (
        (PLOTS[0], "Perplexity increase against bits per weight",
         "bits_per_weight", "bits per weight (quantized layers, as stored)"),
        (PLOTS[1], "Perplexity increase against decode speed (Pareto view)",
         "tg128_median", "decode tg128, tokens/s (median)"),
    ):
        points = [r for r in arms if r[x_key] != ""]
        figure, axes = plt.subplots(figsize=(7, 4.5))
        if not points:
            axes.text(0.5, 0.5, "not measured on this host", ha="center", va="center",
                      transform=axes.transAxes)
        for r in points:
            low, high = r["delta_ppl_ci_low"], r["delta_ppl_ci_high"]
            axes.errorbar(r[x_key], r["delta_ppl"], yerr=[[r["delta_ppl"] - low], [high - r["delta_ppl"]]],
                          fmt="o", capsize=3)
            axes.annotate(f"{r['arm_id'].rsplit('-', 1)[0]} ({r['engine'].split('-')[0]})",
                          (r[x_key], r["delta_ppl"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
        axes.axhline(0, color="grey", linewidth=0.5)
        axes.set_xlabel(x_label)
        axes.set_ylabel("Δ perplexity vs own baseline (95% CI)")
        axes.set_title(title)
        figure.tight_layout()
        temp = folder / f".{name}.tmp.png"
        figure.savefig(temp, dpi=110)
        plt.close(figure)
        os.replace(temp, folder / name)
        made.append((title, name))
    return made


def render_tsv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, delimiter="\t", lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: r[key] for key in COLUMNS} for r in rows)
    return out.getvalue()


def quantization_table(manifests: list[dict]) -> list[str]:
    """How each fourbit-quantized arm was made, from what its quantize job recorded."""
    header = ("| arm | algorithm | head | embedding | act-order / static groups | calibration | "
              "time | peak RSS |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for m in manifests:
        facts, quant = m["method_facts"], m["quant"]
        calibration = quant.get("calibration")
        drawn = (f"{calibration['samples']} × {calibration['seq_len']} tokens, seed {calibration['seed']}"
                 if calibration else "none")
        order = (f"{facts['act_order']} / {facts['static_groups']}" if "act_order" in facts else "—")
        embedding = facts.get("embedding", "dense")  # only cpu_int4 can quantize it
        lines.append(f"| `{m['id']}` | {facts['algorithm']} | {facts['head']} | {embedding} | {order} | "
                     f"{drawn} | {m['quantize_seconds']:.1f} s | {m['peak_rss_mib']:.0f} MiB |")
    return lines


def unavailable_engines(study: dict) -> list[str]:
    """Engines of the config that could not run on this host, each with the reason."""
    lines = [f"- **Not run on this host: {engine_id}** ({engine['name']}): {engine['unavailable']}."
             for engine_id, engine in study["engines"].items() if engine["unavailable"]]
    return ["", *lines] if lines else []


def arms_refused_or_falling_back(study: dict, manifests: list[dict]) -> list[str]:
    """Arms the model's shapes refused before any job (fourbit.quant.shapes), arms whose
    ``fallback: dense`` kept linears unquantized (with the bits per weight counting them),
    and llama.cpp arms whose tensors llama-quantize stores in a fallback type."""
    lines = []
    for r in study.get("refused_arms", []):
        head, *rest = r["reason"].splitlines()  # "...do not fit:", one line per layer, the fix
        lines.append(f"- **Not run on this model: arm {r['name']}** (`{r['id']}`): {head} "
                     + "; ".join(line.strip() for line in rest) + ".")
    plans = {arm["id"]: arm.get("plan", {}) for arm in study["arms"]}
    for m in manifests:
        storage = m["storage"]
        if storage.get("fallback_dense"):
            lines.append(
                f"- **`{m['id']}` kept {len(storage['fallback_dense'])} linears dense** (fallback: dense; "
                f"with the linears vLLM merges them with): {'; '.join(plans.get(m['id'], {}).get('misfits', []))}. "
                f"Bits per weight over every matrix it was asked to quantize, those stored dense: "
                f"{storage['bits_per_weight_with_fallback']:.3f} (bits/weight above counts the quantized "
                "ones only); vllm_native does not run it.")
    for arm_id, plan in plans.items():
        if plan.get("llamacpp_fallback"):
            shown = plan["llamacpp_fallback"]
            lines.append(f"- `{arm_id}`: llama-quantize stores these tensors in a fallback type (its own "
                         f"per-tensor rule, not an error; bits/weight counts the file): {'; '.join(shown[:4])}"
                         + (f"; and {len(shown) - 4} more kinds" if len(shown) > 4 else "") + ".")
    return ["", *lines] if lines else []


def render_markdown(study: dict, rows: list[dict], facts: dict, settings: Mapping) -> str:
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
        control = f"{r['control']} ({fmt_value(r['control_delta_nll'])})" if r["control"] else "—"
        delta = "—" if r["arm_id"] == "baseline" else (
            f"{fmt_value(r['delta_ppl'])} [{fmt_value(r['delta_ppl_ci_low'])}, {fmt_value(r['delta_ppl_ci_high'])}] "
            f"({r['delta_ppl_pct']:+.2f}%)"
        )
        if below_baseline(r):
            delta += " **below its baseline: a finding, not a win** (see Recommendation)"
        cells = [r["engine"], f"`{r['arm_id']}`", r["method"], r["group_size"], r["sym"],
                 fmt_value(r["bits_per_weight"]), fmt_value(r["file_bits_per_param"]), fmt_value(r["size_mib"]),
                 fmt_value(r["ppl"]), delta, control]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += unavailable_engines(study)
    lines += arms_refused_or_falling_back(study, facts.get("quantization", []))
    lines += ["", "## What the evaluation split can and cannot tell apart", ""] + separability(rows)
    lines += ["", "## Fidelity to the baseline", ""] + fidelity_table(rows)
    lines += ["", "## Throughput", ""] + throughput_table(rows)
    if facts.get("bench_job"):
        lines += [""] + facts["bench_job"]
    if facts.get("quantization"):
        lines += ["", "## How each arm was quantized", ""] + quantization_table(facts["quantization"])
    lines += ["", "## Recommendation for this host", ""] + recommend(rows, settings)
    if facts.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{title}]({name})" for title, name in facts["plots"]]
    lines += ["", "## Host", ""] + host_block(study, facts, rows)
    lines += [
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
        "packing, not the quantizer, is wrong. A llama.cpp arm's expansion is its GGUF with "
        "every tensor decoded to F32 by llama-quantize; llama.cpp's quantized matmuls also round "
        "the activations to 8 bits, which this difference includes.",
        "",
        "- **KL / top-1**: per scored position, KL(baseline ‖ arm) of the next-token "
        "distributions and whether their most likely tokens agree, on the first windows of the "
        "same token ids. From full logits where the engine gives them; vLLM returns only top-k "
        "logprobs, so its KL is a lower bound (≥); llama.cpp's come from llama-perplexity's own KL "
        "mode against the f16 GGUF (full logits, but its own tokenization of the evaluation text "
        "and the second half of each chunk). **greedy identical**: of N fixed prompts, how "
        "many continue exactly like the baseline's greedy continuation.",
        "- **pp512 / tg128**: tokens/s for a 512-token prompt (one output token) and for 128 "
        "greedy tokens after a one-token prompt (the one-token run subtracted), batch 1, synthetic "
        "ids, as llama-bench defines them; median [min–max] over counted passes after a warm-up. "
        "**×base** is the median of the pass-by-pass ratio to the same engine's baseline, timed "
        "back to back in each pass, alternately first (A B, B A, ...). One bench job times every "
        "row, the arms' passes interleaved in rounds; a baseline row pools the passes it ran "
        "with each of its engine's arms.",
        "- **decode BW**: bytes of weights one decoded token reads, times tokens/s, as a fraction "
        "of the memory bandwidth measured by a STREAM-like triad in the bench job; above 100% "
        "(in cache) the weights fit in the CPU's caches, so memory bandwidth is not what limits it.",
        "- **busy**: the busiest pinned core's busy fraction just before a pass (the gate refuses "
        "to time above its threshold); **resident**: the smallest fraction of the checkpoint's "
        "pages in the page cache (mincore) before a pass.",
        *recommendation_rules(settings),
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
    report_settings: Mapping,
    results: list[str],
    arm_manifests: list[str],
    markdown_path: str | os.PathLike,
    table_path: str | os.PathLike,
    baseline_checkpoint: str | os.PathLike,
    gguf_base_storage: str | os.PathLike | None = None,
    training_path: str | os.PathLike | None = None,
    corpus_manifest: str | os.PathLike | None = None,
) -> None:
    """``report_settings``: the config's validated ``report`` block (the schema's defaults
    filled in; this module has none of its own)."""
    weights = check_same_weights(study, results)
    storage = {"hf": storage_stats(baseline_checkpoint)}
    if gguf_base_storage:
        storage["gguf"] = read_result(gguf_base_storage)
    benches = bench_records(study, results)
    rows = build_rows(study, results, arm_manifests, storage, benches)
    manifests = [read_result(p) for p in arm_manifests]
    first = read_result(next(p for p in results if p.endswith("dense.ppl.json")))
    facts = {
        "definition": first["definition"],
        "windows": len(first["window_tokens"]),
        "tokens": first["tokens"],
    }
    if training_path and Path(training_path).is_file():
        facts["training"] = read_result(training_path)
    source = Path(baseline_checkpoint) / "fourbit-source.json"
    if source.is_file():
        facts["model_sha256"] = read_result(source)["weights_sha256"]
    if corpus_manifest:
        splits = read_result(corpus_manifest).get("splits", {})
        facts["corpus_sha256"] = {name: split["sha256"] for name, split in splits.items()}
    measured = [b for records in benches.values() for b in records if b.get("measured")]
    if measured:
        facts["provenance"] = measured[0]["provenance"]
        facts["bandwidth"] = measured[0]["bandwidth"]
    facts["records_weights_sha256"] = weights
    facts["bench_job"] = bench_job(benches)
    facts["quantization"] = [m for m in manifests if "method_facts" in m]
    facts["plots"] = plot(rows, Path(markdown_path).parent)
    write_text(table_path, render_tsv(rows))
    write_text(markdown_path, render_markdown(study, rows, facts, report_settings))
    log.info("report: %d rows", len(rows))
