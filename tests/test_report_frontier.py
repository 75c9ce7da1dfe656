"""The quality-per-bit frontier (fourbit.report.frontier), on small hand-made rows: families,
fronts (dominated points out, ties kept), the best arm by KL, the budget lines, the plot."""

import pytest

from fourbit.report.frontier import (
    best_by_kl,
    family,
    frontier_of,
    frontier_section,
)
from fourbit.report.plots import plot
from fourbit.report.verdicts import Measure

BASE_PPL = 10.0


def row(name, fam, bits, kl_value=None, delta_pct=1.0, *, se=None, width=0.2,
        engine="vllm-0000000000", control="faithful"):
    """A report row with what the frontier reads: Δppl in % of a baseline of 10 with an
    interval ± ``width`` points, a KL (over two windows of 100 positions whose sums differ so
    that its standard error is ``se``, if given) or none."""
    units = None if se is None else ((100 * (kl_value + se), 100), (100 * (kl_value - se), 100))
    return {
        "arm_id": f"{name}-0000000000", "engine": engine, "method": "gptq", "family": fam,
        "control": control, "matrix_bits_per_weight": bits, "baseline_ppl": BASE_PPL,
        "delta_ppl": BASE_PPL * delta_pct / 100, "delta_ppl_pct": delta_pct,
        "delta_ppl_ci_low": BASE_PPL * (delta_pct - width) / 100,
        "delta_ppl_ci_high": BASE_PPL * (delta_pct + width) / 100,
        "tg128_median": None,
        "_measures": None if kl_value is None else {"KL": Measure("KL", kl_value, False, units=units)},
    }


def names(points):
    return [p.row["arm_id"].removesuffix("-0000000000") for p in points]


@pytest.mark.parametrize("quant, engine, expected", [
    ({"method": "gptq"}, "vllm", "fourbit on vllm"),
    ({"method": "cpu_int4"}, "reference", "fourbit on reference"),
    ({"method": "llamacpp", "imatrix": False}, "llamacpp", "llama.cpp, no imatrix"),
    ({"method": "llamacpp", "imatrix": "none"}, "llamacpp", "llama.cpp, no imatrix"),
    ({"method": "llamacpp", "imatrix": None}, "llamacpp", "llama.cpp, no imatrix"),
    ({"method": "llamacpp"}, "llamacpp", "llama.cpp, no imatrix"),
    ({"method": "llamacpp", "imatrix": "calibration"}, "llamacpp", "llama.cpp + imatrix"),
    ({"method": "llamacpp", "imatrix": True}, "llamacpp", "llama.cpp + imatrix"),
])
def test_family_of_an_arm(quant, engine, expected):
    assert family(quant, engine) == expected


def test_the_front_leaves_out_dominated_points_and_keeps_ties():
    """By KL: c (more bits, higher KL than a) and e (a's bits, higher KL) are dominated; b and b2
    tie (same bits, same KL) and both stay; d's KL equals a's at more bits, so it is dominated.
    By |Δppl| the order differs: c's -0.1% is the smallest, so c is on that front."""
    rows = [row("a", "F", 4.5, 0.03, 2.0), row("b", "F", 5.0, 0.01, 1.5), row("b2", "F", 5.0, 0.01, 1.5),
            row("c", "F", 6.0, 0.05, -0.1), row("d", "F", 6.5, 0.03, 3.0), row("e", "F", 4.5, 0.04, 2.5)]
    frontier = frontier_of(rows)
    assert names(frontier.kl_front["F"]) == ["a", "b", "b2"]
    assert names(frontier.delta_front["F"]) == ["a", "b", "b2", "c"]
    assert [bits for bits, _ in frontier.budgets()] == [4.5, 5.0, 6.0]


def test_families_have_their_own_fronts():
    rows = [row("a", "fourbit on vllm", 5.0, 0.01), row("q", "llama.cpp, no imatrix", 5.5, 0.02),
            row("qi", "llama.cpp + imatrix", 5.5, 0.015)]
    frontier = frontier_of(rows)
    # q is worse than a at more bits, but a is another family's: q stays on its own front
    assert {name: names(front) for name, front in frontier.kl_front.items()} == {
        "fourbit on vllm": ["a"], "llama.cpp + imatrix": ["qi"], "llama.cpp, no imatrix": ["q"]}


def test_best_by_kl_is_the_lowest_kl_whichever_engine_ran_it():
    """Every KL is exact: the lowest wins across families and engines, a tie goes to fewer
    bits, and an arm without a KL is never the best by KL."""
    rows = [row("v", "fourbit on vllm", 4.5, 0.02), row("q", "llama.cpp, no imatrix", 5.0, 0.01,
                                                         engine="llamacpp-0000000000"),
            row("none", "fourbit on vllm", 4.0)]
    points = [p for members in frontier_of(rows).points.values() for p in members]
    assert names([best_by_kl(points)]) == ["q"]
    tied = [p for members in frontier_of([row("b", "F", 5.0, 0.01), row("a", "F", 4.5, 0.01)]).points.values()
            for p in members]
    assert names([best_by_kl(tied)]) == ["a"]
    assert best_by_kl([p for p in points if p.kl is None]) is None


def budget_lines(rows):
    return [line for line in frontier_section(rows) if line.startswith("- **at ≤")]


def test_a_budget_line_per_front_bits_with_its_intervals():
    """fourbit's arm at 4.5 bits, llama.cpp's at 5 and 6 (with standard errors): at ≤ 4.5
    fourbit's is the only arm; at ≤ 5 its KL is the lowest, separably, but llama.cpp's |Δppl|
    is smaller, so each measure names its own best; at ≤ 6 llama.cpp's 0.0001 is best by KL and
    by |Δppl|, its KL and Δppl intervals stated."""
    rows = [row("g", "fourbit on vllm", 4.5, 0.004, 3.0, se=0.0004),
            row("q4", "llama.cpp, no imatrix", 5.0, 0.01, 2.0, se=0.001, engine="llamacpp-0000000000"),
            row("q6", "llama.cpp, no imatrix", 6.0, 0.0001, 0.5, se=0.00001, engine="llamacpp-0000000000")]
    first, second, third = budget_lines(rows)
    assert first == ("- **at ≤ 4.5 bits** (`g-0000000000` on vllm-0000000000): the only arm, `g-0000000000` "
                     "on vllm-0000000000 (KL 0.004 [0.00322, 0.00478]; Δppl +3% [+2.8, +3.2]).")
    # separably apart on KL and on Δppl: no tie named on either
    assert second == ("- **at ≤ 5 bits** (`q4-0000000000` on llamacpp-0000000000): best arm by KL "
                      "**`g-0000000000` on vllm-0000000000** (KL 0.004 [0.00322, 0.00478]; Δppl +3% "
                      "[+2.8, +3.2]). By |Δppl|: **`q4-0000000000` on llamacpp-0000000000** (Δppl +2% "
                      "[+1.8, +2.2]; KL 0.01 [0.00804, 0.012]).")
    assert third == ("- **at ≤ 6 bits** (`q6-0000000000` on llamacpp-0000000000): best arm "
                     "**`q6-0000000000` on llamacpp-0000000000** by KL and by |Δppl| (KL 0.0001 "
                     "[8.04e-05, 0.00012]; Δppl +0.5% [+0.3, +0.7]).")


def test_a_budget_names_the_arms_the_best_cannot_be_told_from():
    """Two exact KLs whose unpaired interval of the difference includes 0, and Δppl intervals
    that overlap (the smaller |Δppl| includes 0): the best is named, with both ties."""
    rows = [row("a", "F", 5.0, 0.010, 0.1, se=0.002), row("b", "F", 4.0, 0.011, 0.3, se=0.002)]
    *_, line = budget_lines(rows)
    assert line.startswith("- **at ≤ 5 bits** (`a-0000000000` on vllm-0000000000): best arm **`a-0000000000` "
                           "on vllm-0000000000** by KL and by |Δppl| (KL 0.01 [0.00608, 0.0139]; Δppl +0.1% "
                           "[-0.1, +0.3, 0 inside])")
    assert "; on KL not separable from `b-0000000000` on vllm-0000000000 (KL 0.01 vs 0.011: the unpaired" in line
    assert line.endswith("; on Δppl not separable from (intervals overlap) `b-0000000000` on vllm-0000000000 "
                         "(Δppl +0.3% [+0.1, +0.5]).")


def test_arms_the_frontier_cannot_place_are_named():
    rows = [row("a", "F", 5.0, 0.01), row("bad", "F", 4.0, 0.001, control="NOT faithful"),
            row("old", "F", None, 0.01)]
    section = "\n".join(frontier_section(rows))
    assert ("Not placed: `bad-0000000000` on vllm-0000000000 (control NOT faithful); `old-0000000000` on "
            "vllm-0000000000 (no bits per weight over all matrices") in section
    assert frontier_section([row("old", "F", None)]) == [
        "No arm has bits per weight over all matrices, so there is no frontier."]


def test_the_frontier_plot_is_written(tmp_path):
    rows = [row("g", "fourbit on vllm", 4.5, 0.004, 3.0),
            row("q4", "llama.cpp, no imatrix", 5.0, 0.01, 2.0, se=0.001),
            row("x", "llama.cpp + imatrix", 5.0, None, 1.0)]
    paths = {name: tmp_path / f"{name}.png" for name in ("quality_vs_bits", "quality_vs_decode", "frontier")}
    made = plot(rows, paths)
    assert made[-1] == ("Quality per bit: each family's Pareto front of KL and Δppl", paths["frontier"])
    assert paths["frontier"].read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frontier.png", "quality_vs_bits.png",
                                                          "quality_vs_decode.png"]  # no temp left
    plot([], paths)  # no arm at all: the figure says so instead of failing
    assert paths["frontier"].stat().st_size > 0
