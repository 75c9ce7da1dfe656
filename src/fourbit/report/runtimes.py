"""The report's lines on what ran: each row's runtime as scored and, where the bench ran
it otherwise, as timed (vLLM timed compiled after scoring eager); what compiling cost the
bench's engine starts; and the runtime variants the bench timed beside the arms chosen for
them (fourbit.bench.variants), with the fastest way to run each for decode and prefill."""

from __future__ import annotations


def runtime_line(row: dict) -> str:
    """What scored the row and, where the bench ran it otherwise, what was timed and how
    long compiling took at its untimed start."""
    line = f"- `{row['arm_id']}` on {row['engine']}: {row['runtime']}"
    timed = row.get("timed_runtime")
    if timed is None or timed == row["runtime"]:
        return line + (" (scored and timed)" if timed else "")
    compiled = (f"; compiling took {row['compile_s']:.1f} s of its untimed start"
                if row.get("compile_s") else "")
    return f"{line} (scored); timed: {timed}{compiled}"


def compile_note(benches: dict[str, list[dict]]) -> list[str]:
    """How the engines that compile were timed, and what compiling cost their starts: a
    paragraph of its own, or nothing when no engine was held open for the job."""
    starts = {}  # one per engine opened: each arm, each engine's baseline once, each variant
    for engine_id, records in benches.items():
        for b in records:
            if b.get("measured"):
                for side in ("arm", "baseline"):
                    starts[(engine_id, b[side].get("checkpoint"))] = b[side].get("start")
                for variant in (b.get("variants") or {}).get("timed", []):
                    starts[(engine_id, b["arm"].get("checkpoint"), variant["name"])] = variant["start"]
    compiled = [s for s in starts.values() if s and s["mode"] == "compiled"]
    eager = [s for s in starts.values() if s and s["mode"] == "eager"]
    lines = []
    if compiled:
        seconds = [s["compile_s"] for s in compiled]
        # The engines of a group start side by side, so their compile times overlap: the
        # longest start, not the sum, is what the job waited.
        lines.append(
            f"{len(compiled)} vLLM engine(s) were timed compiled, as vLLM runs by default "
            "(bench.vllm_compiled; what scored is under Runtimes). Compiling took "
            f"{min(seconds):.1f}-{max(seconds):.1f} s of each engine's start (the engines "
            "start side by side; the longest start took "
            f"{max(s['engine_init_s'] for s in compiled):.1f} s), which no timed pass includes."
        )
    if eager:
        lines.append(f"{len(eager)} vLLM engine(s) were timed eager (bench.vllm_compiled: false).")
    return ["", " ".join(lines)] if lines else []


def runtime_candidates(provenance: dict, benches: dict[str, list[dict]]) -> list[str]:
    """The host's vLLM runtime candidates (the bench's provenance: fourbit.bench.hostprobe's
    vllm_runtimes), each marked timed in this study, runnable here but not in it, or refused
    here with the reason; nothing for a record from before the candidates were recorded."""
    table = provenance.get("vllm_runtimes")
    if not table:
        return []
    measured = [b for records in benches.values() for b in records if b.get("measured")]
    timed = {b[side].get("variant") for b in measured for side in ("arm", "baseline")}
    timed |= {v["name"] for b in measured for v in (b.get("variants") or {}).get("timed", [])}

    def named(r: dict) -> str:
        return f"`{r['name']}`" + (" (AMX)" if r["amx"] else "")

    ran = [named(r) for r in table if r["name"] in timed]
    idle = [named(r) for r in table if r["available"] and r["name"] not in timed]
    refused = [f"`{r['name']}` ({r['reason']})" for r in table if not r["available"]]
    return [f"- vLLM 4-bit runtimes this host was probed for (fourbit.bench.hostprobe): timed in "
            f"this study: {', '.join(ran) or 'none'}; runnable here, not in this study: "
            f"{', '.join(idle) or 'none'}; refused here: {'; '.join(refused) or 'none'}"]


def _timed_ways(bench: dict) -> list[dict]:
    """The arm as scored, then each runtime variant timed beside it: name, runtime,
    numerics, stats and ratio to the arm as scored (1 for itself)."""
    arm = bench["arm"]
    scored = {"name": arm.get("variant") or arm["runtime"], "runtime": arm["runtime"],
              "numerics": None, "stats": arm["stats"], "ratio_to_scored": None}
    return [scored, *bench["variants"]["timed"]]


def _metric(stats: dict, prefix: str) -> str:
    return next(key for key in stats if key.startswith(prefix) and key.endswith("_tok_s"))


def _span(stats: dict) -> str:
    return f"{stats['median']:.1f} [{stats['min']:.1f}–{stats['max']:.1f}]"


def _cells(way: dict, prefix: str) -> str:
    """tok/s and the ratio to the arm as scored, two table cells."""
    metric = _metric(way["stats"], prefix)
    ratio = way["ratio_to_scored"]
    if ratio is None:
        return f"{_span(way['stats'][metric])} | 1"
    r = ratio[metric]
    return f"{_span(way['stats'][metric])} | ×{r['median']:.2f} [{r['min']:.2f}–{r['max']:.2f}]"


def _with_variants(study: dict, benches: dict[str, list[dict]]) -> list[tuple[str, dict]]:
    """(arm id, its bench record) of every arm whose runtime variants were chosen."""
    return [(arm_id, b) for engine_id, records in benches.items()
            for arm_id, b in zip(study["engines"][engine_id]["arms"], records)
            if b.get("measured") and (b.get("variants") or {}).get("chosen")]


def variant_tables(study: dict, benches: dict[str, list[dict]]) -> list[str]:
    """Under Throughput: each arm whose runtime variants were timed (bench.runtimes), as
    scored and in every other way this host runs it, side by side in the bench job's
    rounds, each paired pass by pass with the arm as scored; then the variants refused."""
    lines = []
    for arm_id, bench in _with_variants(study, benches):
        lines += ["", f"Runtime variants of `{arm_id}` (bench.runtimes; ×: pass-by-pass ratio "
                  "to the arm as scored, median [min–max]; numerics per decode row / prompt):", "",
                  "| runtime | numerics | pp tok/s | ×as scored | tg tok/s | ×as scored |",
                  "|---|---|---|---|---|---|"]
        for way in _timed_ways(bench):
            numerics = ("as scored" if way["numerics"] is None else
                        f"{way['numerics']['decode']} / {way['numerics']['prefill']}")
            lines.append(f"| `{way['name']}` | {numerics} | {_cells(way, 'pp')} | {_cells(way, 'tg')} |")
        lines += ["", "What ran each way:", ""] + [f"- `{way['name']}`: {way['runtime']}"
                                                   for way in _timed_ways(bench)]
        refused = bench["variants"]["refused"]
        if refused:
            lines += ["", "Asked for, not run here: " + "; ".join(
                f"`{v['name']}` ({v['reason']})" for v in refused)]
        if len(_timed_ways(bench)) == 1:
            lines += ["", "No other runtime variant was timed for it (Host lists this CPU's "
                      "candidates)."]
    return lines


def _ratio_range(way: dict, metric: str) -> tuple[float, float]:
    if way["ratio_to_scored"] is None:
        return 1.0, 1.0
    ratio = way["ratio_to_scored"][metric]
    return ratio["min"], ratio["max"]


def _fastest(ways: list[dict], what: str, prefix: str) -> str:
    """The fastest of ``ways`` for one phase, ranked by the pass-by-pass ratio to the arm
    as scored (1 for itself): each variant ran beside it in every pass, so that ratio, not
    tok/s taken in other pairs' passes, is what compares them. The ways whose ratio range
    reaches the fastest one's are named as not separable from it."""
    metric = _metric(ways[0]["stats"], prefix)

    def median(way: dict) -> float:
        return 1.0 if way["ratio_to_scored"] is None else way["ratio_to_scored"][metric]["median"]

    best = max(ways, key=median)  # the first, as scored, on a tie
    low = _ratio_range(best, metric)[0]
    close = [w for w in ways if w is not best and _ratio_range(w, metric)[1] >= low]
    text = f"for {what} `{best['name']}` ({_span(best['stats'][metric])} tok/s"
    if best["ratio_to_scored"] is None:
        text += ", as scored"
    else:
        ratio = best["ratio_to_scored"][metric]
        text += (f", ×{ratio['median']:.2f} [{ratio['min']:.2f}–{ratio['max']:.2f}] the arm as "
                 f"scored; it rounds {best['numerics'][what]}, and no control ran in this runtime: "
                 "the quality columns are the scored runtime's")
    if close:
        text += "; not separable from " + ", ".join(
            f"`{w['name']}` (×{median(w):.2f}, {'as scored' if w['ratio_to_scored'] is None else 'overlapping'})"
            for w in close)
    return text + ")"


def variant_verdicts(study: dict, benches: dict[str, list[dict]]) -> list[str]:
    """For each arm whose variants were timed: the fastest of the ways the bench ran it,
    for decode and for prefill, against the arm as scored, and what its quality rests on."""
    return [f"- **The fastest of the {len(_timed_ways(bench))} ways the bench ran `{arm_id}` "
            "on this host**: " + "; ".join(_fastest(_timed_ways(bench), what, prefix)
                                            for what, prefix in (("decode", "tg"), ("prefill", "pp")))
            + "."
            for arm_id, bench in _with_variants(study, benches)]
