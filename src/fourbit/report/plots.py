"""The report's figures: each arm's Δppl (with its interval) against bits per weight, and
against decode speed; and the frontier, KL and Δppl against bits per weight with each
family's Pareto front. The workflow names the files (rule report's outputs)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from fourbit.report.frontier import Frontier, frontier_of

# By the rule's output name: the title, the row key on the x axis and its label.
FIGURES = {
    "quality_vs_bits": ("Perplexity increase against bits per weight",
                        "matrix_bits_per_weight",
                        "bits per weight, every matrix as stored (head and embedding included)"),
    "quality_vs_decode": ("Perplexity increase against decode speed (Pareto view)",
                          "tg128_median", "decode tg128, tokens/s (median)"),
}
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
