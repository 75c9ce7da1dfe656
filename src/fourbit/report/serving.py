"""The report's serving part: what each served build gave N concurrent users on its real
server (the serve step's one record, serve.json), as a section with a table per
concurrency level and a recommendation line per level beside the batch-1 ones.

The record is read and its shape checked once (read_serving), before any output is
written, so a record the report cannot render is named with the field it lacks.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from fourbit.metrics.stats import overlapping
from fourbit.report.loading import WRITTEN_BY, Record, ReportInputError, read_result

# A level's summary keys (the serve record's) as the table heads them, in column order.
MEASURES = {"output_tok_s": "output tok/s", "requests_per_s": "requests/s",
            "ttft_ms_p50": "TTFT p50 ms", "ttft_ms_p99": "TTFT p99 ms",
            "tpot_ms_p50": "TPOT p50 ms", "tpot_ms_p99": "TPOT p99 ms"}


@dataclass(frozen=True)
class Spread:
    """One measure over a level's passes: their median, lowest and highest."""

    median: float
    low: float
    high: float

    def shown(self) -> str:
        return f"{_number(self.median)} [{_number(self.low)}–{_number(self.high)}]"


def _number(value: float) -> str:
    # Three significant figures below 10 (requests/s is often a fraction of one).
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


@dataclass(frozen=True)
class Level:
    concurrency: int
    status: str  # "measured" or "over_capacity"
    reason: str | None  # over_capacity only: the server's own limit
    summary: dict[str, Spread] | None  # by MEASURES' keys; measured only
    passes: int
    failed_requests: int


@dataclass(frozen=True)
class Served:
    """One (engine, arm) the serve job started a server for, or refused before timing."""

    engine_id: str
    engine: str  # the engine's name in the config: vllm, vllm_native, llamacpp
    arm: str  # an arm id, or "baseline"
    arm_name: str
    status: str  # "measured" or "refused"
    reason: str | None  # refused only
    runtime: str | None  # measured only, like the three below: what ran, and how it was started
    command: list[str] | None
    startup_s: float | None
    levels: dict[int, Level]  # by concurrency
    # serve.runtime's outcome (the record's runtime_choice): None when served as scored
    variant: str | None = None
    passed_over: tuple[tuple[str, str], ...] = ()  # (variant, why not) preferred but not run

    @property
    def label(self) -> str:
        way = f" as {self.variant}" if self.variant else ""
        return f"`{self.arm}` on {self.engine_id}{way}"


@dataclass(frozen=True)
class Workload:
    """What every served arm was given, the same at every level."""

    source: str  # of the prompts: the evaluation split's token ids, or a seeded random set
    prompt_tokens: int
    output_tokens: int  # fixed: EOS ignored
    requests_per_level: int
    warmup_requests: int
    passes: int


@dataclass(frozen=True)
class Serving:
    path: str
    workload: Workload
    concurrency: list[int]
    tpot_bound_ms: float
    load_generator: str
    started: str | None
    served: list[Served]


def read_serving(path: str | os.PathLike) -> tuple[Record, Serving]:
    """The serve record as read (for the weights check) and as the report renders it;
    ReportInputError naming the file when it is missing, corrupt or lacks a field."""
    data = read_result(path)
    if not data.get("measured"):
        raise ReportInputError(f"{path}: the serve step did not measure ({data.get('reason')}); "
                               f"rerun it: snakemake --forcerun {WRITTEN_BY['serve']}")
    try:
        workload = data["workload"]
        serving = Serving(
            path=str(path),
            workload=Workload(workload["source"], *(int(workload[key]) for key in (
                "prompt_tokens", "output_tokens", "requests_per_level", "warmup_requests", "passes"))),
            concurrency=[int(n) for n in data["concurrency"]],
            tpot_bound_ms=float(data["tpot_bound_ms"]), load_generator=data["load_generator"],
            started=data.get("job", {}).get("started"), served=[_served(s) for s in data["served"]])
    except KeyError as error:
        _unreadable(path, f"it lacks the field {error}")
    except (TypeError, ValueError) as error:
        _unreadable(path, f"a field has the wrong type or value: {error}")
    _check_levels(serving)
    return Record(str(path), data), serving


def _unreadable(path: str | os.PathLike, problem: str) -> NoReturn:
    raise ReportInputError(f"{path}: not a serve record the report can read ({problem}); remake it: "
                           f"snakemake --forcerun {WRITTEN_BY['serve']}")


def _served(entry: dict) -> Served:
    _known_status(entry["status"], ("measured", "refused"), f"{entry['arm']} on {entry['engine_id']}")
    refused = entry["status"] == "refused"
    choice = entry.get("runtime_choice") or {}
    identity = {"engine_id": entry["engine_id"], "engine": entry["engine"], "arm": entry["arm"],
                "arm_name": entry["arm_name"], "status": entry["status"],
                "variant": choice.get("variant"),
                "passed_over": tuple((p["name"], p["reason"]) for p in choice.get("passed_over", ()))}
    if refused:
        return Served(**identity, reason=entry["reason"], runtime=None, command=None, startup_s=None,
                      levels={})
    return Served(**identity, reason=None, runtime=entry["runtime"], command=list(entry["command"]),
                  startup_s=float(entry["startup_s"]),
                  levels={int(level["concurrency"]): _level(level) for level in entry["levels"]})


def _known_status(status: str, known: tuple[str, ...], what: str) -> None:
    if status not in known:
        raise ValueError(f"{what} has status {status!r}, not one of {', '.join(known)}")


def _level(level: dict) -> Level:
    _known_status(level["status"], ("measured", "over_capacity"), f"concurrency {level['concurrency']}")
    if level["status"] == "over_capacity":
        return Level(int(level["concurrency"]), "over_capacity", level["reason"], None, 0, 0)
    summary = {key: Spread(*(float(level["summary"][key][stat]) for stat in ("median", "min", "max")))
               for key in MEASURES}
    return Level(int(level["concurrency"]), "measured", None, summary, len(level["passes"]),
                 sum(int(p["failed"]) for p in level["passes"]))


def _check_levels(serving: Serving) -> None:
    """Every served entry has an entry at every level of the record (timed or over capacity)."""
    for s in (s for s in serving.served if s.status == "measured"):
        missing = [n for n in serving.concurrency if n not in s.levels]
        if missing:
            _unreadable(serving.path, f"{s.arm} on {s.engine_id} has no entry at concurrency "
                                      f"{', '.join(map(str, missing))} of its {serving.concurrency}")


# --- the section ----------------------------------------------------------------------------


def _users(n: int) -> str:
    return f"{n} concurrent user{'s' if n != 1 else ''}"


def serving_section(serving: Serving | None) -> list[str]:
    """The workload, what was served (and what refused), then a table per concurrency level;
    nothing when serving was not part of the study."""
    if serving is None:
        return []
    w = serving.workload
    started = f" (started {serving.started})" if serving.started else ""
    lines = [
        "", "## Serving", "",
        f"Each served build ran on its engine's own OpenAI-compatible server, started and stopped "
        f"by one serve job{started}. One load generator, {serving.load_generator}, drove every "
        f"server with the same workload: {w.requests_per_level} requests per concurrency level, each "
        f"a {w.prompt_tokens}-token prompt ({w.source}) and exactly {w.output_tokens} output tokens "
        f"(EOS ignored), after {w.warmup_requests} warm-up requests; {w.passes} passes, interleaved "
        "across the builds. Each figure is the median [min–max] over the passes. TPOT bound for the "
        f"recommendation: {serving.tpot_bound_ms:g} ms (TPOT p99, serve.tpot_bound_ms).",
        "",
    ]
    if not serving.served:  # e.g. no arm's fidelity was judged, so none was the best faithful one
        return lines + ["- No build was served: the serve step's selection (the config's serve.arms) "
                        "chose none."]
    for s in serving.served:
        if s.status == "refused":
            lines.append(f"- **Not served: {s.label}** ({s.engine}): {s.reason}.")
        else:
            lines.append(f"- {s.label} ({s.engine}): {s.runtime}; answering after {s.startup_s:.1f} s; "
                         f"`{shlex.join(s.command)}`")
        if s.variant and s.status == "measured":
            lines.append(f"  - served as {s.variant} (serve.runtime), not as it scored: no control "
                         "ran in this runtime, so the quality columns are the scored runtime's.")
        lines += [f"  - preferred (serve.runtime) but not run here: {name}: {why}."
                  for name, why in s.passed_over]
    for n in serving.concurrency:
        lines += ["", f"### {_users(n)}", ""] + level_table(serving, n)
    return lines


def one_user_against_bench(serving: Serving | None, rows: list[dict]) -> list[str]:
    """Per build served to one user, its decode rate on the server (1000 / TPOT p50: prompt
    processing is not in it) beside the bench's tg128 of the same build in the same runtime
    (as scored, or the variant it was served as, when the bench timed that variant too), and
    whether their [min–max] over passes overlap. A server's per-request work (HTTP,
    detokenizing, scheduling) is what separates them. Nothing when the study did not serve
    one user."""
    if serving is None or 1 not in serving.concurrency:
        return []
    # (engine id, arm id) -> by runtime (None: as scored, else a variant's name): tg128's spread
    tg128 = {(r["engine"], r["arm_id"]): {None: {k: r[f"tg128_{k}"] for k in ("median", "min", "max")},
                                          **r.get("_variant_tg128", {})}
             for r in rows if r.get("tg128_median") is not None}
    lines = []
    for s in serving.served:
        level = s.levels.get(1)
        bench = tg128.get((s.engine_id, s.arm), {}).get(s.variant)
        if s.status != "measured" or level is None or level.status != "measured" or bench is None:
            continue
        tpot = level.summary["tpot_ms_p50"]
        bench_rate = Spread(bench["median"], bench["min"], bench["max"])
        if tpot.low <= 0:  # a pass whose tokens all came in one chunk (a starved server process)
            lines.append(f"- {s.label}: no decode rate from the server: in a pass its tokens arrived "
                         f"in one chunk (TPOT p50 {tpot.shown()} ms), so the time between them is "
                         f"unknown; the bench's tg128 is {bench_rate.shown()}.")
            continue
        served = Spread(1000 / tpot.median, 1000 / tpot.high, 1000 / tpot.low)
        agree = overlapping((served.low, served.high), (bench_rate.low, bench_rate.high))
        verdict = ("their spreads overlap" if agree else
                   f"apart: the server decodes at ×{served.median / bench_rate.median:.2f} the bench's rate")
        lines.append(f"- {s.label}: {served.shown()} tok/s served, against tg128 {bench_rate.shown()} "
                     f"in the bench; {verdict}.")
    if not lines:
        return []
    return ["", "### One user: the server against the batch-1 bench", "",
            "The decode rate a single user sees on the server (1000 / TPOT p50, so the prompt's "
            "processing is left out) beside the bench's tg128 of the same build, in tok/s, median "
            "[min–max] over each one's passes:", "", *lines]


def level_table(serving: Serving, n: int) -> list[str]:
    """One row per served (engine, arm) at concurrency ``n``; a refused build or a level over
    the server's capacity says why instead of showing figures."""
    headers = ["engine", "arm", *MEASURES.values(), "note"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for s in serving.served:
        level = s.levels.get(n)
        if s.status == "refused":
            cells, note = ["refused"] + ["—"] * (len(MEASURES) - 1), s.reason
        elif level.status == "over_capacity":
            cells, note = ["over capacity"] + ["—"] * (len(MEASURES) - 1), level.reason
        else:
            cells = [level.summary[key].shown() for key in MEASURES]
            note = f"{level.passes} passes, {level.failed_requests} failed requests"
        arm = f"`{s.arm}`" + (f" as {s.variant}" if s.variant else "")
        lines.append("| " + " | ".join([s.engine_id, arm, *cells, note]) + " |")
    return lines


# --- the recommendation ---------------------------------------------------------------------


def serving_verdicts(serving: Serving | None, rows: list[dict]) -> list[str]:
    """A line per concurrency level: the served 4-bit arm with the most output tok/s within
    the record's TPOT p99 bound, or why none is named. ``rows``: the report's rows, whose
    controls say which arms are not faithful."""
    if serving is None:
        return []
    unfaithful = {(r["engine"], r["arm_id"]) for r in rows if r["control"] == "NOT faithful"}
    return [level_verdict(serving, n, unfaithful) for n in serving.concurrency]


def serving_named(serving: Serving | None, rows: list[dict]) -> list[tuple[str, str, str]]:
    """(engine id, arm id, which verdict) of each arm a concurrency level's verdict names."""
    if serving is None:
        return []
    unfaithful = {(r["engine"], r["arm_id"]) for r in rows if r["control"] == "NOT faithful"}
    named = []
    for n in serving.concurrency:
        _, _, within = _level_candidates(serving, n, unfaithful)
        named += [(s.engine_id, s.arm, _users(n)) for s, _ in _level_choice(within)]
    return named


def _level_candidates(serving: Serving, n: int, unfaithful: set[tuple[str, str]]) -> tuple[list, list, list]:
    """The served 4-bit arms left out of level ``n`` (with why), those timed, and those
    timed within the TPOT p99 bound."""
    left_out, timed = [], []
    for s in (s for s in serving.served if s.arm != "baseline"):
        if s.status == "refused":
            left_out.append(f"{s.label} (refused: {s.reason})")
        elif (s.engine_id, s.arm) in unfaithful:
            left_out.append(f"{s.label} (control NOT faithful)")
        elif s.levels[n].status == "over_capacity":
            left_out.append(f"{s.label} (over capacity: {s.levels[n].reason})")
        else:
            timed.append((s, s.levels[n].summary))
    return left_out, timed, [(s, m) for s, m in timed if m["tpot_ms_p99"].median <= serving.tpot_bound_ms]


def _level_choice(within: list) -> list:
    """What a level's verdict names: the most output tok/s within the bound, and the arms
    whose [min–max] overlaps it (not separable); nothing when none is within."""
    if not within:
        return []
    fast, best = max(within, key=lambda t: t[1]["output_tok_s"].median)
    spread = best["output_tok_s"]
    return [(fast, best)] + [(s, m) for s, m in within if s is not fast and overlapping(
        (spread.low, spread.high), (m["output_tok_s"].low, m["output_tok_s"].high))]


def level_verdict(serving: Serving, n: int, unfaithful: set[tuple[str, str]]) -> str:
    bound = serving.tpot_bound_ms
    head = f"For {_users(n)} within a TPOT p99 of {bound:g} ms"
    left_out, timed, within = _level_candidates(serving, n, unfaithful)
    if not timed:
        line = f"- {head}: no served 4-bit arm was timed at this level, so none is recommended."
    elif not within:
        lowest, m = min(timed, key=lambda t: t[1]["tpot_ms_p99"].median)
        line = (f"- {head}: no served 4-bit arm keeps within the bound, so none is recommended; "
                f"the lowest TPOT p99 is {lowest.label}'s, {m['tpot_ms_p99'].shown()} ms.")
    else:
        (fast, best), *tied = _level_choice(within)
        spread = best["output_tok_s"]
        if tied:
            line = (f"- {head}: not separable, their output tok/s [min–max] overlap: "
                    + ", ".join(f"{s.label} ({_figures(m)})" for s, m in [(fast, best), *tied]) + ".")
        else:
            line = f"- **{head}: {fast.label}** ({_figures(best)})."
        faster = [(s, m) for s, m in timed if m["output_tok_s"].median > spread.median
                  and m["tpot_ms_p99"].median > bound]
        if faster:
            line += " Faster but over the bound: " + ", ".join(f"{s.label} ({_figures(m)})" for s, m in faster) + "."
    if left_out:
        line += " Not in the running: " + "; ".join(left_out) + "."
    return line


def _figures(m: Mapping[str, Spread]) -> str:
    return f"{m['output_tok_s'].shown()} output tok/s, TPOT p99 {m['tpot_ms_p99'].shown()} ms"


def serving_rules(serving: Serving | None) -> list[str]:
    """The serving figures' and verdicts' definitions, for the report's definitions."""
    if serving is None:
        return []
    return [
        f"- **Serving** (as {serving.load_generator} measures them, over one level's requests): "
        "**output tok/s** and **requests/s**, every generated token (request) over the level's "
        "wall time; **TTFT**, the time from sending a request to its first token; **TPOT**, the "
        "time per output token after the first; p50 and p99 over the level's requests; each "
        "shown as the median [min–max] over the passes. **over capacity**: the server's own "
        "limit (its KV cache or slots) cannot hold that many requests at once, so the level was "
        "not timed as a queue.",
        "- **For N concurrent users**: among the served 4-bit arms (a baseline is served as a "
        "reference, not a candidate) that the server accepted, whose control did not fail and "
        "whose level was not over capacity, those whose TPOT p99 (median over passes) is within "
        f"{serving.tpot_bound_ms:g} ms (serve.tpot_bound_ms); the one with "
        "the most output tok/s (median) is named, unless another's output tok/s [min–max] "
        "overlaps its: then they are named together as not separable.",
    ]
