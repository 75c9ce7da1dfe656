"""The report's task part: whether each build still solves the problems of the study's task
sets (the tasks step's one record, tasks.json), as a "Task accuracy" section with a table
per task, a line beside the fidelity verdict, and a plot of Δpass@1 against bits per weight.

The record is read and checked against its schema once (read_tasks), before any output is
written, so a record the report cannot render is named with the field it lacks.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from fourbit import records
from fourbit.metrics.passrate import PairedComparison, paired
from fourbit.report.loading import WRITTEN_BY, Record, ReportInputError, read_result

SIGNIFICANCE = 0.05  # McNemar's two-sided p below which a difference in pass@1 is separable


@dataclass(frozen=True)
class ScoredArm:
    """One (engine, arm) of one task: its pass@1 and its pairing with its engine's baseline."""

    engine_id: str
    engine: str
    arm: str
    arm_name: str
    status: str  # "measured" or "refused"
    reason: str | None  # refused only
    command: list[str] | None  # measured only, like the rest
    pass_at_1: Mapping | None  # value, solved, problems, lower, upper (Wilson 95%)
    vs_baseline: Mapping | None  # delta_pass_at_1, newly_failed, newly_passed, mcnemar_p; None for a baseline
    passed: Mapping[str, bool] | None  # problem id -> solved; measured only
    generation_s: float | None
    checking_s: float | None

    @property
    def label(self) -> str:
        return f"`{self.arm}` on {self.engine_id}"

    @property
    def separably_worse(self) -> bool:
        """Worse than its baseline on the task beyond chance (separable)."""
        return self.vs_baseline is not None and separable(self.vs_baseline["delta_pass_at_1"],
                                                          self.vs_baseline["mcnemar_p"])


@dataclass(frozen=True)
class TaskResult:
    task: str
    source: str
    prompt_format: Mapping  # chat_template, stop, max_tokens, temperature
    problems: list[str]
    arms: list[ScoredArm]


def read_tasks(path: str | os.PathLike) -> tuple[Record, list[TaskResult]]:
    """The tasks record as read (for the weights check) and as the report renders it;
    ReportInputError naming the file when it is missing, corrupt or lacks a field."""
    data = read_result(path)
    try:
        records.check("tasks", data, path)
    except records.RecordError as error:
        raise ReportInputError(f"{error}; remake it: snakemake --forcerun {WRITTEN_BY['tasks']}") from None
    results = [TaskResult(t["task"], t["source"], t["prompt_format"], list(t["problems"]),
                          [_scored(a) for a in t["arms"]]) for t in data["tasks"]]
    return Record(str(path), data), results


def _scored(entry: dict) -> ScoredArm:
    measured = entry["status"] == "measured"
    return ScoredArm(
        engine_id=entry["engine_id"], engine=entry["engine"], arm=entry["arm"],
        arm_name=entry["arm_name"], status=entry["status"], reason=entry.get("reason"),
        command=entry["command"] if measured else None,
        pass_at_1=entry["pass_at_1"] if measured else None,
        vs_baseline=entry["vs_baseline"] if measured else None,
        passed={pid: o["status"] == "passed" for pid, o in entry["outcomes"].items()} if measured else None,
        generation_s=entry["generation_s"] if measured else None,
        checking_s=entry["checking_s"] if measured else None)


def bits_per_weight(rows: list[dict]) -> dict[tuple[str, str], float | None]:
    """Bits per weight over all matrices, by (engine id, arm id), from the report's rows."""
    return {(r["engine"], r["arm_id"]): r["matrix_bits_per_weight"] for r in rows}


def tasks_section(results: list[TaskResult] | None, rows: list[dict]) -> list[str]:
    """What each task asked, then its table; nothing when no task was enabled."""
    if not results:
        return []
    lines = ["", "## Task accuracy", ""]
    bits = bits_per_weight(rows)
    for result in results:
        fmt = result.prompt_format
        template = "through the model's chat template" if fmt["chat_template"] else "as plain text to complete"
        lines += [
            f"### {result.task}", "",
            f"{len(result.problems)} problems of {result.source}, each put to every build {template}, "
            f"greedy (temperature {fmt['temperature']:g}), at most {fmt['max_tokens']} new tokens, "
            f"cut at the first of {', '.join(repr(s) for s in fmt['stop'])}; each completion "
            "executed against the problem's tests in the sandbox (README, \"Task accuracy\").",
            "",
            *task_table(result, bits),
            "",
        ]
        lines += [f"- **Not scored: {a.label}** ({a.engine}): {a.reason}." for a in result.arms
                  if a.status == "refused"]
        lines += [f"- {a.label}: `{shlex.join(a.command)}`" for a in result.arms if a.status == "measured"]
    return lines


def task_table(result: TaskResult, bits: Mapping[tuple[str, str], float | None]) -> list[str]:
    headers = ["engine", "arm", "bits/weight, all matrices", "pass@1 [95% CI]", "Δpass@1 vs baseline",
               "newly failed", "newly passed", "McNemar p", "separably worse", "generation s",
               "checking s"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for a in result.arms:
        width = bits.get((a.engine_id, a.arm))
        shown_bits = "—" if width is None else f"{width:.3f}"
        if a.status != "measured":
            cells = [shown_bits, "refused"] + ["—"] * (len(headers) - 4)
        else:
            p = a.pass_at_1
            rate = f"{p['value']:.1%} ({p['solved']}/{p['problems']}) [{p['lower']:.1%}, {p['upper']:.1%}]"
            if a.vs_baseline is None:
                paired = ["—"] * 5
            else:
                v = a.vs_baseline
                paired = [f"{v['delta_pass_at_1']:+.1%}", _ids(v["newly_failed"]), _ids(v["newly_passed"]),
                          f"{v['mcnemar_p']:.3g}", "**yes**" if a.separably_worse else "no"]
            cells = [shown_bits, rate, *paired, f"{a.generation_s:.1f}", f"{a.checking_s:.1f}"]
        lines.append("| " + " | ".join([a.engine_id, f"`{a.arm}`", *cells]) + " |")
    return lines


def _ids(ids: list[str], shown: int = 5) -> str:
    if not ids:
        return "none"
    listed = ", ".join(ids[:shown])
    return f"{len(ids)}: {listed}" + (" …" if len(ids) > shown else "")


def separable(delta_pass_at_1: float, mcnemar_p: float) -> bool:
    """Worse beyond chance: fewer problems solved and McNemar's p below SIGNIFICANCE."""
    return delta_pass_at_1 < 0 and mcnemar_p < SIGNIFICANCE


def separably_worse_than(arm: ScoredArm, other: ScoredArm) -> PairedComparison | None:
    """``arm`` against ``other`` problem by problem (newly failed: problems only ``other``
    solves), when ``arm`` is separably worse; else None."""
    comparison = paired(arm.passed, other.passed)
    return comparison if separable(comparison.delta, comparison.p_value) else None


def task_verdicts(results: list[TaskResult] | None, named: list[tuple[str, str, str]]) -> list[str]:
    """Per task and per arm the recommendation names (``named``: engine id, arm id and the
    verdict naming it, in the recommendation's order), whether it is separably worse on the
    task than its engine's baseline, and every scored 4-bit arm it is separably worse than,
    so that the recommendation never names such an arm without its better alternative.
    Nothing when no task was enabled."""
    if not results:
        return []
    verdicts: dict[tuple[str, str], list[str]] = {}
    for engine_id, arm, verdict in named:
        verdicts.setdefault((engine_id, arm), [])
        if verdict not in verdicts[(engine_id, arm)]:
            verdicts[(engine_id, arm)].append(verdict)
    lines = []
    for result in results:
        if not verdicts:
            lines.append(f"- **On {result.task}**: the recommendation names no arm, so none is judged.")
        for (engine_id, arm), why in verdicts.items():
            lines.append(_task_verdict(result, engine_id, arm, " and for ".join(why)))
    return lines


def _task_verdict(result: TaskResult, engine_id: str, arm: str, why: str) -> str:
    label = f"`{arm}` on {engine_id}"
    head = f"- **On {result.task}**: {label}, named for {why},"
    scored = next((a for a in result.arms if (a.engine_id, a.arm) == (engine_id, arm)), None)
    if scored is None or scored.status != "measured":
        reason = scored.reason if scored is not None and scored.reason else "the tasks step did not serve it"
        return f"{head} was not scored ({reason}), so whether it does the task as well is unknown."
    if scored.vs_baseline is None:
        line = f"{head} has no measured baseline on its engine to be paired with."
    else:
        v = scored.vs_baseline
        verdict = ("**separably worse on the task** than its baseline" if scored.separably_worse
                   else "not separably worse on the task than its baseline")
        line = (f"{head} is {verdict} (Δpass@1 {v['delta_pass_at_1']:+.1%}, {len(v['newly_failed'])} "
                f"newly failed, {len(v['newly_passed'])} newly passed, McNemar p = {v['mcnemar_p']:.3g}).")
    better = [(other, comparison) for other in result.arms
              if other.status == "measured" and other.arm != "baseline" and other is not scored
              for comparison in [separably_worse_than(scored, other)] if comparison is not None]
    if better:
        line += (" **It is separably worse on the task than** " + "; ".join(
            f"{other.label} (pass@1 {other.pass_at_1['value']:.1%} against its "
            f"{scored.pass_at_1['value']:.1%}: {len(c.newly_failed)} problems only that arm solves, "
            f"{len(c.newly_passed)} only this one, McNemar p = {c.p_value:.3g})" for other, c in better)
            + f", so for this task ship {'that arm' if len(better) == 1 else 'one of those'} instead.")
    else:
        line += " No other scored 4-bit arm solves separably more of the problems."
    return line


def task_rules(results: list[TaskResult] | None) -> list[str]:
    """The task figures' and verdict's definitions, for the report's definitions."""
    if not results:
        return []
    return [
        "- **pass@1**: the fraction of the task's problems whose one greedy completion passes all "
        "the problem's tests; in brackets Wilson's 95% score interval. **Δpass@1**: the arm's "
        "pass@1 minus its own engine's baseline's, on the same problems; **newly failed / newly "
        "passed**: problems the baseline solved and the arm does not, and the reverse; **McNemar "
        "p**: the exact two-sided McNemar test of those two counts (only problems where the two "
        "differ carry information).",
        f"- **Separably worse on the task**: Δpass@1 < 0 and McNemar p < {SIGNIFICANCE:g}. An arm "
        "that is not separably worse may still be worse: with few discordant problems the test "
        "cannot tell.",
        "- **The task check of the recommendation**: every arm a verdict above names (for speed, "
        "for fidelity, for N concurrent users) is paired on the task's problems with its own "
        "engine's baseline and with every other scored 4-bit arm, of any engine (the same "
        "prompts, the same checker); each arm it is separably worse than is named beside it as "
        "the build to ship for that task. The verdicts themselves do not read the task: they "
        "choose on perplexity, distributions and speed, and the task check says where the task "
        "disagrees.",
    ]
