"""The report's markdown: the results table, then a section per question (what the
split can tell apart, fidelity, throughput, how each arm was made, the recommendation,
quality per bit, plots, host, definitions, runtimes), rendered from the rows and the
run's facts.

A value missing from a row (None) shows as a blank cell or a dash, never as "None".
"""

from __future__ import annotations

from collections.abc import Mapping

from fourbit.metrics.stats import CONFIDENCE, overlapping
from fourbit.report.frontier import frontier_section
from fourbit.report import runtimes
from fourbit.report.serving import (
    Serving,
    one_user_against_bench,
    serving_named,
    serving_rules,
    serving_section,
    serving_verdicts,
)
from fourbit.report.tasks import TaskResult, task_rules, task_verdicts, tasks_section
from fourbit.report.verdicts import (
    below_baseline,
    fmt_value,
    recommend,
    recommendation_rules,
    recommended_arms,
    throughput_span,
)


def render_markdown(study: dict, rows: list[dict], facts: dict, settings: Mapping,
                    plots: list[tuple[str, str]], serving: Serving | None = None,
                    tasks: list[TaskResult] | None = None) -> str:
    """``facts``: records.run_facts' plus ``records_weights_sha256``; ``settings``: the
    config's report block; ``plots``: each figure's title and link; ``serving``, ``tasks``:
    the serve and tasks records as read (fourbit.report.serving, .tasks), None if not run."""
    lines = preamble(study, facts) + results_table(rows) + unavailable_engines(study)
    lines += arms_refused_or_falling_back(study, facts["quantization"])
    lines += ["", "## What the evaluation split can and cannot tell apart", ""] + separability(rows)
    lines += ["", "## Fidelity to the baseline", ""] + fidelity_table(rows)
    lines += ["", "## Throughput", ""] + throughput_table(rows)
    timing = bench_job(facts["benches"])
    if timing:
        lines += [""] + timing + runtimes.compile_note(facts["benches"])
        lines += runtimes.variant_tables(study, facts["benches"])
    lines += serving_section(serving) + one_user_against_bench(serving, rows)
    lines += tasks_section(tasks, rows)
    if facts["quantization"]:
        lines += ["", "## How each arm was quantized", ""] + quantization_table(facts["quantization"])
    lines += ["", "## Recommendation for this host", ""] + recommend(rows, settings)
    lines += runtimes.variant_verdicts(study, facts["benches"])
    lines += serving_verdicts(serving, rows)
    lines += task_verdicts(tasks, recommended_arms(rows, settings) + serving_named(serving, rows))
    lines += ["", "## Quality per bit: the frontier", ""] + frontier_section(rows)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{title}]({link})" for title, link in plots]
    lines += ["", "## Host", ""] + host_block(study, facts, rows)
    lines += ["", "## Definitions", ""] + definitions(study, facts, settings) + serving_rules(serving)
    lines += task_rules(tasks)
    lines += ["", "## Runtimes", ""] + [runtimes.runtime_line(r) for r in rows]
    return "\n".join(lines) + "\n"


def preamble(study: dict, facts: dict) -> list[str]:
    """The title, what was studied, and what the reader must know before the numbers."""
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
    return lines


def _cell(value) -> str:
    """A table cell: blank where the row has no value (a baseline has no group or sym)."""
    return "" if value is None else fmt_value(value)


def results_table(rows: list[dict]) -> list[str]:
    """One line per row: what was stored, its perplexity, Δppl with its interval, the control."""
    headers = ["engine", "arm", "method", "group", "sym", "bits/weight", "bits/weight, all matrices",
               "file bits/param", "size MiB",
               "ppl", f"Δppl vs baseline [{CONFIDENCE:.0%} CI]", "control (arm vs dense Δ nats/token)"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        control = (f"{r['control']} ({fmt_value(r['control_delta_nll'])}; {r['numerics']} "
                   f"≤ {r['control_tolerance']})" if r["control"] else "—")
        delta = "—" if r["arm_id"] == "baseline" else (
            f"{fmt_value(r['delta_ppl'])} [{fmt_value(r['delta_ppl_ci_low'])}, {fmt_value(r['delta_ppl_ci_high'])}] "
            f"({r['delta_ppl_pct']:+.2f}%)"
        )
        if below_baseline(r):
            delta += " **below its baseline: a finding, not a win** (see Recommendation)"
        cells = [r["engine"], f"`{r['arm_id']}`", r["method"], _cell(r["group_size"]), _cell(r["sym"]),
                 _cell(r["bits_per_weight"]), _cell(r["matrix_bits_per_weight"]),
                 _cell(r["file_bits_per_param"]), _cell(r["size_mib"]),
                 _cell(r["ppl"]), delta, control]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def fidelity_table(rows: list[dict]) -> list[str]:
    headers = ["engine", "arm", "KL mean (nats)", "KL p99", "top-1 agreement", "greedy identical", "from"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in (r for r in rows if r["arm_id"] != "baseline"):
        if r["kl_mean"] is None:
            cells = [r["engine"], f"`{r['arm_id']}`", "—", "—", "—", "—", r["kl_from"] or "not computed"]
        else:
            cells = [r["engine"], f"`{r['arm_id']}`", f"{r['kl_mean']:.4g}", f"{r['kl_p99']:.4g}",
                     f"{r['top1_agreement']:.1%}", f"{r['greedy_identical']}/{r['greedy_prompts']}",
                     r["kl_from"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def bench_job(benches: dict[str, list[dict]]) -> list[str]:
    """How the throughput rows were timed: one job, its arms interleaved in rounds, in
    groups one after the other when their engines did not fit in memory together."""
    measured = [b for records in benches.values() for b in records if b.get("measured")]
    if not measured:
        return []
    engines = sum(1 for records in benches.values() if any(b.get("measured") for b in records))
    job = measured[0]["job"]
    minutes = max(run["started_s"] for b in measured for run in b["runs"]) / 60
    opening = (f"All {len(measured)} arms of {engines} engine(s) were timed in one bench job "
               f"(started {job['started']})")
    rounds = ("each round gave every arm one pass, paired back to back with its engine's "
              "baseline, the arms' order rotated between rounds")
    groups = job.get("groups", 1)
    if groups == 1:
        return [
            f"{opening}, in {measured[0]['passes']} rounds over {minutes:.1f} min: {rounds}. "
            "Every row's passes span the whole job and saw the same host, so absolute tok/s "
            "compare across rows and engines; ×base, a ratio within each pass, cancels the "
            "drift that remains."
        ]
    members = {tuple(b["group"]["pairs"]): b["group"]["number"] for b in measured}
    listing = "; ".join(f"group {number}: " + ", ".join(f"`{name}`" for name in names)
                        for names, number in sorted(members.items(), key=lambda item: item[1]))
    return [
        f"{opening}, but their engines did not fit in memory together "
        f"({job['available_memory_bytes'] / 2**30:.1f} GiB available), so it timed them in "
        f"{groups} groups, one after the other, each with its engine's baseline reopened "
        f"({listing}). Within a group, {measured[0]['passes']} rounds: {rounds}. Absolute "
        "tok/s therefore compare across rows of one group only (the host's speed drifts "
        "over minutes); ×base, a ratio within each pass, compares across all rows."
    ]


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
        measured = r["pp512_median"] is not None
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
        *runtimes.runtime_candidates(host, facts.get("benches", {})),
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


def quantization_table(manifests: list[dict]) -> list[str]:
    """How each fourbit-quantized arm was made, from what its quantize job (and a mixed arm's
    shared pass) recorded."""
    header = ("| arm | algorithm | head | embedding | act-order / static groups | calibration | "
              "search kept (held-out check) | time | peak RSS |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for m in manifests:
        facts, quant = m["method_facts"], m["quant"]
        order = (f"{facts['act_order']} / {facts['static_groups']}" if "act_order" in facts else "—")
        embedding = facts.get("embedding", "dense")  # 4-bit or 8-bit, if the arm asked
        # a mixed_precision arm's own job, and the 4-bit pass it shares
        shared = facts.get("mixed_precision", {}).get("shared_pass")
        took = f"{m['quantize_seconds']:.1f} s" + (
            f" + {shared['seconds']:.1f} s shared" if shared else "")
        peak = f"{m['peak_rss_mib']:.0f} MiB" + (
            f" (shared pass {shared['peak_rss_mib']:.0f})" if shared else "")
        lines.append(f"| `{m['id']}` | {facts['algorithm']} | {facts['head']} | {embedding} | {order} | "
                     f"{_calibration_drawn(quant.get('calibration'))} | "
                     f"{_search_kept(facts.get('heldout_guard'))} | "
                     f"{took} | {peak} |")
    return lines + mixed_precision_lines(manifests)


MOST_SENSITIVE = 5  # sets listed per mixed_precision arm


def mixed_precision_lines(manifests: list[dict]) -> list[str]:
    """Per mixed_precision arm: what moved to which wide grid for how many bits, and the sets
    whose 4-bit error changed the model most (measured, fourbit.quantizers.sensitivity)."""
    lines = []
    for m in manifests:
        mixed = m["method_facts"].get("mixed_precision")
        if mixed is None:
            continue
        ranked = sorted(mixed["sets"], key=lambda s: -s["kl"])
        moved = [_set_label(s) for s in mixed["sets"] if s["bits"] != 4]
        lines.append(
            f"- `{m['id']}`, mixed precision: {len(moved)} of {len(mixed['sets'])} sets on wider grids"
            f" (of {'/'.join(map(str, mixed['grids']))} bits) for +{mixed['extra_bits_spent']:.3f} bits "
            f"per weight (budget {mixed['extra_bits']}): {', '.join(moved) or 'none'}. "
            f"Most sensitive at 4 bits (KL from the unquantized model with only that set at 4 bits, "
            f"nats/token, {mixed['windows']} held-out windows): "
            + "; ".join(_set_label(s, kl=True) for s in ranked[:MOST_SENSITIVE]) + "."
            + (f" 4-bit pass and measurement: `{mixed['shared_pass']['id']}`, shared by the "
               "arms that differ only in their budget." if "shared_pass" in mixed else "")
        )
    return ["", *lines] if lines else []


def _set_label(mixed_set: dict, kl: bool = False) -> str:
    """``model.layers.0.self_attn.q_proj`` + siblings -> ``layers.0.self_attn.q/k/v_proj``."""
    names = [n.removeprefix("model.") for n in mixed_set["members"]]
    parent = names[0].rpartition(".")[0]
    label = names[0] if len(names) == 1 else (
        f"{parent}.{'/'.join(n.rpartition('.')[2].removesuffix('_proj') for n in names)}_proj")
    return (label + (f" {mixed_set['kl']:.3g}" if kl else "")
            + (f" ({mixed_set['bits']}-bit)" if mixed_set["bits"] != 4 else ""))


def _calibration_drawn(calibration: dict | None) -> str:
    if calibration is None:
        return "none"
    held = f"{calibration['heldout']} held out"
    if "samples" not in calibration:  # a search that only the held-out windows check
        return f"none fitted; {held} × {calibration['seq_len']} tokens, seed {calibration['seed']}"
    return f"{calibration['samples']} × {calibration['seq_len']} tokens, seed {calibration['seed']}; {held}"


def _search_kept(guard: dict | None) -> str:
    """How many tensors kept the searched grid; the rest beat it with plain min/max rounding."""
    if guard is None:
        return "—"
    kept, total = len(guard["kept_search"]), len(guard["kept_search"]) + len(guard["kept_minmax"])
    return f"{guard['search']} in {kept} of {total} tensors, minmax in {total - kept}"


def unavailable_engines(study: dict) -> list[str]:
    """Engines of the config that could not run on this host, each with the reason."""
    lines = [f"- **Not run on this host: {engine_id}** ({engine['name']}): {engine['unavailable']}."
             for engine_id, engine in study["engines"].items() if engine["unavailable"]]
    return ["", *lines] if lines else []


def arms_refused_or_falling_back(study: dict, manifests: list[dict]) -> list[str]:
    """Arms the model's shapes refused before any job (fourbit.quantizers.shapes), arms whose
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


def definitions(study: dict, facts: dict, settings: Mapping) -> list[str]:
    """What each column means. Perplexity's definition is the one its records carry."""
    return [
        f"- **ppl**: {facts['definition']}; {facts['windows']} windows, {facts['tokens']} scored tokens, "
        "the same token ids for every row.",
        "- **Δppl vs baseline**: the arm's perplexity minus the unquantized (untied) model's, "
        f"both on the same engine; in brackets a {CONFIDENCE:.0%} interval from a paired bootstrap "
        "over windows (the same windows score both).",
        "- **bits/weight**: bits stored for the linear layers (codes, scales, zeros when "
        "quantized; the plain weights for the baseline) divided by their weight count; "
        "**bits/weight, all matrices**: every weight matrix as stored (each linear and the head, "
        "quantized or kept dense, and the input embedding; llama.cpp's token_embd likewise) over "
        "their weight count, the figure to compare arms by, since a head or embedding kept dense "
        "costs its full width there; **file bits/param**: every stored tensor (embeddings, norms, the "
        "untied head's copy included) divided by the model's parameter count.",
        "- **control**: the arm run by its 4-bit runtime against its dense float32 expansion on the "
        "same engine; the mean NLL difference in nats/token. *faithful* if within the tolerance "
        "of what that runtime rounds beyond the expansion (its **numerics**: "
        + "; ".join(f"{name} {value}" for name, value in
                    sorted(study["evaluation"]["control_tolerance"].items()))
        + " nats/token); otherwise the runtime or the packing, not the quantizer, is wrong. "
        "*exact*: float32 on both sides; *bf16_activations*: activations rounded to bfloat16; "
        "*int8_activations*: activations rounded to int8 per block before integer dot products "
        "(fourbit's W4A8 kernel; llama.cpp's quantized matmuls, Q8_K / Q8_0). A llama.cpp arm's "
        "expansion is its GGUF with every tensor decoded to F32 by llama-quantize.",
        "",
        "- **KL / top-1 / greedy identical**, as the fidelity records define them (every KL "
        "exact, from whole next-token distributions):",
        *(f"  - {', '.join(engines)}: {definition}"
          for definition, engines in facts["fidelity_definitions"].items()),
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
    ]
