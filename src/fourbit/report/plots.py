"""The report's two figures: each arm's Δppl (with its interval) against bits per weight,
and against decode speed. The workflow names the files (rule report's outputs)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# By the rule's output name: the title, the row key on the x axis and its label.
FIGURES = {
    "quality_vs_bits": ("Perplexity increase against bits per weight",
                        "matrix_bits_per_weight",
                        "bits per weight, every matrix as stored (head and embedding included)"),
    "quality_vs_decode": ("Perplexity increase against decode speed (Pareto view)",
                          "tg128_median", "decode tg128, tokens/s (median)"),
}


def plot(rows: list[dict], paths: Mapping[str, str | os.PathLike]) -> list[tuple[str, Path]]:
    """Write each figure of FIGURES to ``paths[name]`` (PNG, atomically); their titles and paths.

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
        figure.tight_layout()
        temp = path.with_name(f".{path.name}.tmp.png")
        figure.savefig(temp, dpi=110)
        plt.close(figure)
        os.replace(temp, path)
        made.append((title, path))
    return made
