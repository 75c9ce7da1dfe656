"""The report's figures: each arm's Δppl (with its interval) against bits per weight, and
against decode speed; the frontier, KL and Δppl against bits per weight with each
family's Pareto front; and, when the study served its arms, output tok/s against
concurrency and TPOT p99 against output tok/s; when it scored them on a task set, Δpass@1 against
bits per weight. The workflow names the files (rule
report's outputs)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fourbit.report.frontier import Frontier, frontier_of
from fourbit.report.serving import Served, Serving, Spread
from fourbit.report.tasks import TaskResult, bits_per_weight

# By the rule's output name: the title, the row key on the x axis and its label.
FIGURES = {
    "quality_vs_bits": ("Perplexity increase against bits per weight",
                        "matrix_bits_per_weight",
                        "bits per weight, every matrix as stored (head and embedding included)"),
    "quality_vs_decode": ("Perplexity increase against decode speed (Pareto view)",
                          "tg128_median", "decode tg128, tokens/s (median)"),
}
TASKS_FIGURE = ("tasks_delta", "Task accuracy: Δpass@1 against bits per weight")
FRONTIER = ("frontier", "Quality per bit: each family's Pareto front of KL and Δppl")
MARKERS = "osD^vPX*<>"


def plot(rows: list[dict], paths: Mapping[str, str | os.PathLike]) -> list[tuple[str, Path]]:
    """Write each figure of FIGURES, and the frontier, to ``paths[name]`` (PNG, atomically);
    their titles and paths.

    An arm without the x value (None: not measured on this host, or a record older than
    the value) is left out; a figure with no arm at all says so instead of being empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [r for r in rows if r["arm_id"] != "baseline"]
    made = []
    for name, (title, x_key, x_label) in FIGURES.items():
        path = Path(paths[name])
        points = [r for r in arms if r[x_key] is not None]
        figure, axes = plt.subplots(figsize=(7, 4.5))
        if not points:
            axes.text(0.5, 0.5, "no arm has this value (not measured on this host?)", ha="center", va="center",
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
        _save(plt, figure, path)
        made.append((title, path))
    name, title = FRONTIER
    _save(plt, plot_frontier(plt, frontier_of(rows), title), Path(paths[name]))
    return made + [(title, Path(paths[name]))]


def _save(plt, figure, path: Path) -> None:
    figure.tight_layout()
    temp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(temp, dpi=110)
    plt.close(figure)
    os.replace(temp, path)


def plot_frontier(plt, frontier: Frontier, title: str):
    """Two panels, KL and Δppl against bits over all matrices: each family its own marker and
    colour, its front a step line (the best at ≤ x bits), each point labelled by arm name."""
    figure, (kl_axes, delta_axes) = plt.subplots(1, 2, figsize=(13, 5))
    # Each front's last step runs on to the widest arm: the best at ≤ x bits holds from there on.
    widest = max((p.bits for members in frontier.points.values() for p in members), default=0)
    for index, (name, members) in enumerate(frontier.points.items()):
        style = {"marker": MARKERS[index % len(MARKERS)], "color": f"C{index % 10}"}
        for axes, front, value in ((kl_axes, frontier.kl_front[name], lambda p: p.kl.value),
                                   (delta_axes, frontier.delta_front[name], lambda p: p.delta_pct)):
            placed = [p for p in members if axes is delta_axes or p.kl is not None]
            for p in placed:
                error = ([[p.delta_pct - p.delta_low], [p.delta_high - p.delta_pct]]
                         if axes is delta_axes else None)
                axes.errorbar(p.bits, value(p), yerr=error, linestyle="none", capsize=2, **style)
                axes.annotate(p.row["arm_id"].rsplit("-", 1)[0], (p.bits, value(p)), fontsize=6,
                              xytext=(3, 3), textcoords="offset points")
            if front:
                axes.plot([p.bits for p in front] + [widest], [value(p) for p in front] + [value(front[-1])],
                          drawstyle="steps-post", color=style["color"])
            if placed:  # the legend's entry: the family's marker on its front's line
                axes.plot([], [], label=name, **style)
    kls = [p.kl.value for members in frontier.points.values() for p in members if p.kl is not None]
    if kls and min(kls) > 0:
        kl_axes.set_yscale("log")
    kl_axes.set_ylabel("KL from own baseline, nats/token")
    delta_axes.set_ylabel("Δppl, % of own baseline (95% CI); front by |Δppl|")
    delta_axes.axhline(0, color="grey", linewidth=0.5)
    for axes in (kl_axes, delta_axes):
        axes.set_xlabel("bits per weight, all matrices (head and embedding included)")
        if not frontier.points:
            axes.text(0.5, 0.5, "no arm has bits per weight over all matrices", ha="center",
                      va="center", transform=axes.transAxes)
        elif axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    figure.suptitle(title)
    return figure


@dataclass(frozen=True)
class Point:
    """One served build at one level: where the Pareto plot places it."""

    served: Served
    concurrency: int
    tok_s: float  # output tok/s, median over passes
    tpot_p99_ms: float  # median over passes


def timed_levels(serving: Serving) -> list[tuple[Served, list[tuple[int, dict[str, Spread]]]]]:
    """Each served build with its timed levels (concurrency, summary), in the record's order;
    a build with none (refused, or over capacity at every level) left out."""
    timed = []
    for s in serving.served:
        levels = [(n, s.levels[n].summary) for n in serving.concurrency
                  if s.status == "measured" and s.levels[n].status == "measured"]
        if levels:
            timed.append((s, levels))
    return timed


def pareto_front(points: list[Point]) -> list[Point]:
    """The points no other point beats on both axes (at least as many tok/s at no higher TPOT
    p99, better on one), by tok/s."""
    def beaten(p: Point) -> bool:
        return any(q.tok_s >= p.tok_s and q.tpot_p99_ms <= p.tpot_p99_ms
                   and (q.tok_s, q.tpot_p99_ms) != (p.tok_s, p.tpot_p99_ms) for q in points)
    return sorted((p for p in points if not beaten(p)), key=lambda p: p.tok_s)


# By the rule's output name: the title. Written only when the study served its arms.
SERVING_FIGURES = {
    "serving_throughput": "Serving: output tokens/s against concurrent users",
    "serving_pareto": "Serving: TPOT p99 against output tokens/s (Pareto view)",
}


def plot_serving(serving: Serving, paths: Mapping[str, str | os.PathLike]) -> list[tuple[str, Path]]:
    """The two serving figures, to ``paths[name]`` (PNG, atomically); their titles and paths.
    Each served build is one line in both, its own marker and colour; a baseline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = timed_levels(serving)
    throughput, pareto = SERVING_FIGURES
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for index, (s, levels) in enumerate(timed):
        spreads = [m["output_tok_s"] for _, m in levels]
        axes.errorbar([n for n, _ in levels], [x.median for x in spreads],
                      yerr=[[x.median - x.low for x in spreads], [x.high - x.median for x in spreads]],
                      capsize=3, label=_served_name(s), **_style(index, s))
    axes.set_xscale("log", base=2)
    axes.set_xticks(serving.concurrency, [str(n) for n in serving.concurrency])
    axes.set_xlabel("concurrent users (requests in flight)")
    axes.set_ylabel("output tokens/s, median [min–max] over passes")
    _finish(plt, figure, axes, SERVING_FIGURES[throughput], Path(paths[throughput]), timed)

    figure, axes = plt.subplots(figsize=(7, 4.5))
    points = []
    for index, (s, levels) in enumerate(timed):
        placed = [Point(s, n, m["output_tok_s"].median, m["tpot_ms_p99"].median) for n, m in levels]
        axes.plot([p.tok_s for p in placed], [p.tpot_p99_ms for p in placed], label=_served_name(s),
                  **_style(index, s))
        for p in placed:
            axes.annotate(str(p.concurrency), (p.tok_s, p.tpot_p99_ms), fontsize=7, xytext=(3, 3),
                          textcoords="offset points")
        points += placed
    front = pareto_front(points)
    if front:  # ringed, and joined: the best TPOT p99 reachable at each throughput
        axes.plot([p.tok_s for p in front], [p.tpot_p99_ms for p in front], color="black", linewidth=0.8,
                  marker="o", markersize=11, markerfacecolor="none", label="Pareto front")
    axes.axhline(serving.tpot_bound_ms, color="red", linestyle=":", label=f"TPOT bound {serving.tpot_bound_ms:g} ms")
    axes.set_xlabel("output tokens/s (median over passes); numbers: concurrent users")
    axes.set_ylabel("TPOT p99, ms (median over passes)")
    _finish(plt, figure, axes, SERVING_FIGURES[pareto], Path(paths[pareto]), timed)
    return [(title, Path(paths[name])) for name, title in SERVING_FIGURES.items()]


def _served_name(s: Served) -> str:
    return f"{s.arm_name} ({s.variant or s.engine})"


def _style(index: int, s: Served) -> dict:
    return {"marker": MARKERS[index % len(MARKERS)], "color": f"C{index % 10}",
            "linestyle": "--" if s.arm == "baseline" else "-"}


def _finish(plt, figure, axes, title: str, path: Path, timed: list) -> None:
    if timed:
        axes.legend(fontsize=7)
    else:
        axes.text(0.5, 0.5, "no served build was timed at any level", ha="center", va="center",
                  transform=axes.transAxes)
    axes.set_title(title)
    _save(plt, figure, path)


def plot_tasks(results: list[TaskResult], rows: list[dict],
               paths: Mapping[str, str | os.PathLike]) -> list[tuple[str, Path]]:
    """Each scored arm's Δpass@1 against its engine's baseline (its bars: the arm's pass@1
    interval, less the baseline's pass@1) against bits per weight, a series per task and
    engine, written to ``paths["tasks_delta"]``; its title and path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name, title = TASKS_FIGURE
    bits = bits_per_weight(rows)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for result in results:
        baselines = {a.engine_id: a.pass_at_1["value"] for a in result.arms
                     if a.arm == "baseline" and a.status == "measured"}
        for index, engine_id in enumerate(dict.fromkeys(a.engine_id for a in result.arms)):
            points = [(bits.get((a.engine_id, a.arm)), a) for a in result.arms
                      if a.engine_id == engine_id and a.vs_baseline is not None]
            points = [(x, a) for x, a in points if x is not None]
            if not points:
                continue
            base = baselines[engine_id]
            ys = [a.vs_baseline["delta_pass_at_1"] for _, a in points]
            below = [y - (a.pass_at_1["lower"] - base) for (_, a), y in zip(points, ys)]
            above = [(a.pass_at_1["upper"] - base) - y for (_, a), y in zip(points, ys)]
            axes.errorbar([x for x, _ in points], ys, yerr=[below, above], fmt=MARKERS[index % len(MARKERS)],
                          capsize=3, label=f"{result.task}, {engine_id}")
            for (x, a), y in zip(points, ys):
                axes.annotate(a.arm_name, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
            drawn += len(points)
    if not drawn:
        axes.text(0.5, 0.5, "no arm was scored against its baseline", ha="center", va="center",
                  transform=axes.transAxes)
    else:
        axes.legend(fontsize=8)
    axes.axhline(0, color="grey", linewidth=0.5)
    axes.set_xlabel("bits per weight, every matrix as stored (head and embedding included)")
    axes.set_ylabel("Δpass@1 vs own baseline (bars: the arm's 95% interval)")
    axes.set_title(title)
    _save(plt, figure, Path(paths[name]))
    return [(title, Path(paths[name]))]
