"""The quality-per-bit frontier: each family's KL and Δppl against bits per weight over all
matrices, its Pareto front, and at each bit budget the best arm.

Families: fourbit's own methods (gptq, rtn, cpu_int4, ...) on each engine that ran them,
llama.cpp without an importance matrix, llama.cpp with one. The x axis is
``matrix_bits_per_weight`` (the table's "bits/weight, all matrices": every weight matrix as
stored, head and embedding included), the one count that compares builds that keep a head or
an embedding wider than 4 bits. Δppl is taken in percent of the arm's own engine's baseline
and ranked by its absolute value, as the speed verdict does: a drop below the baseline is a
change of the model, not a gain.

Every engine's KL is exact, so the fronts and each budget's best arm order KLs as numbers;
the arms a budget's best cannot be told from are named with it, by the fidelity verdict's
comparison (fourbit.report.verdicts.compare_measure) for KL and by overlapping intervals
for Δppl. Rows are fourbit.report.rows.build_rows' dicts; this module only reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import NormalDist

from fourbit.metrics.stats import CONFIDENCE, overlapping
from fourbit.report.verdicts import Measure, compare_measure, fmt_value

# The values of a llama.cpp arm's ``imatrix`` that mean "none": the schema's ``false`` and
# the spellings an importance-matrix block may use for it.
NO_IMATRIX = (None, False, "none")
_Z = NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)


def family(quant: Mapping, engine_name: str) -> str:
    """The family an arm's row belongs to, from its quant block and the engine that ran it."""
    if quant.get("method") != "llamacpp":
        return f"fourbit on {engine_name}"
    imatrix = quant.get("imatrix")
    label = "llama.cpp, no imatrix" if imatrix in NO_IMATRIX else "llama.cpp + imatrix"
    return label if engine_name == "llamacpp" else f"{label} on {engine_name}"


@dataclass(frozen=True, eq=False)  # two arms with equal numbers are still two points
class Point:
    """One arm on one engine, where the frontier places it."""

    row: dict = field(repr=False, compare=False)
    family: str
    bits: float
    kl: Measure | None
    delta_pct: float  # Δppl in % of its own engine's baseline, and its interval
    delta_low: float
    delta_high: float

    @property
    def label(self) -> str:
        return f"`{self.row['arm_id']}` on {self.row['engine']}"

    @property
    def key(self) -> tuple:  # a fixed order for ties
        return (self.bits, self.family, self.row["arm_id"], self.row["engine"])


@dataclass(frozen=True)
class Frontier:
    """Each family's points and its two fronts (by bits), and the arms left out, with why."""

    points: dict[str, list[Point]]
    kl_front: dict[str, list[Point]]
    delta_front: dict[str, list[Point]]
    left_out: list[str]

    def budgets(self) -> list[tuple[float, list[Point]]]:
        """Every bits at which some family's front has a point (where the best arm can change),
        ascending, with the front points that lie there."""
        at: dict[float, list[Point]] = {}
        for front in (*self.kl_front.values(), *self.delta_front.values()):
            for p in front:
                if p not in at.setdefault(p.bits, []):
                    at[p.bits].append(p)
        return [(bits, sorted(at[bits], key=lambda p: p.key)) for bits in sorted(at)]


def points_of(rows: list[dict]) -> tuple[list[Point], list[str]]:
    """The rows the frontier places (arms whose control did not fail and whose bits over all
    matrices were counted) and the arms it leaves out, with the reason."""
    points, left_out = [], []
    for r in rows:
        if r["arm_id"] == "baseline":
            continue
        label = f"`{r['arm_id']}` on {r['engine']}"
        if r["control"] == "NOT faithful":
            left_out.append(f"{label} (control NOT faithful)")
        elif r["matrix_bits_per_weight"] is None:
            left_out.append(f"{label} (no bits per weight over all matrices: its storage record "
                            "predates the count; rerun its quantize job)")
        else:
            base = r["baseline_ppl"]
            measures = r.get("_measures")
            points.append(Point(r, r["family"], r["matrix_bits_per_weight"],
                                measures["KL"] if measures else None, r["delta_ppl_pct"],
                                100 * r["delta_ppl_ci_low"] / base, 100 * r["delta_ppl_ci_high"] / base))
    return sorted(points, key=lambda p: p.key), left_out


def _kl_order(a: Point, b: Point, strict: bool) -> bool:
    if a.kl is None or b.kl is None:
        return False
    return a.kl.value < b.kl.value if strict else a.kl.value <= b.kl.value


def _delta_order(a: Point, b: Point, strict: bool) -> bool:
    return abs(a.delta_pct) < abs(b.delta_pct) if strict else abs(a.delta_pct) <= abs(b.delta_pct)


def pareto_front(points: list[Point], at_most) -> list[Point]:
    """The points no other point dominates, by bits: a point is dominated by one at no more bits
    whose value is at most its own (``at_most(q, p, strict)``), one of the two strictly less.
    Two points with the same bits and value both stay."""
    def dominates(q: Point, p: Point) -> bool:
        return q.bits <= p.bits and at_most(q, p, False) and (q.bits < p.bits or at_most(q, p, True))

    return [p for p in points if not any(dominates(q, p) for q in points if q is not p)]


def frontier_of(rows: list[dict]) -> Frontier:
    points, left_out = points_of(rows)
    families: dict[str, list[Point]] = {}
    for p in points:
        families.setdefault(p.family, []).append(p)
    families = dict(sorted(families.items()))
    with_kl = {name: [p for p in members if p.kl is not None] for name, members in families.items()}
    return Frontier(
        points=families,
        kl_front={name: pareto_front(members, _kl_order) for name, members in with_kl.items()},
        delta_front={name: pareto_front(members, _delta_order) for name, members in families.items()},
        left_out=left_out,
    )


def best_by_kl(candidates: list[Point]) -> Point | None:
    """The arm with the lowest KL (None when no arm has one)."""
    scored = [p for p in candidates if p.kl is not None]
    return min(scored, key=lambda p: (p.kl.value, p.key), default=None)


def best_by_delta(candidates: list[Point]) -> Point | None:
    return min(candidates, key=lambda p: (abs(p.delta_pct), p.key), default=None)


# --- markdown ------------------------------------------------------------------------------


def _kl_text(p: Point) -> str:
    if p.kl is None:
        return "KL not computed"
    se = p.kl.standard_error()
    spread = f" [{p.kl.value - _Z * se:.3g}, {p.kl.value + _Z * se:.3g}]" if se is not None else ""
    return f"KL {p.kl.value:.4g}{spread}"


def _delta_text(p: Point) -> str:
    zero = ", 0 inside" if p.delta_low <= 0 <= p.delta_high else ""
    return f"Δppl {p.delta_pct:+.3g}% [{p.delta_low:+.3g}, {p.delta_high:+.3g}{zero}]"


def _kl_cell(p: Point) -> str:
    return "—" if p.kl is None else _kl_text(p).removeprefix("KL ")


def front_table(frontier: Frontier) -> list[str]:
    """The arms on each family's fronts, by bits, with what put them there."""
    headers = ["family", "arm", "method", "bits/weight, all matrices", f"KL (nats) [{CONFIDENCE:.0%} CI]",
               f"Δppl, % of its baseline [{CONFIDENCE:.0%} CI]", "on the front by"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for name, members in frontier.points.items():
        for p in members:
            by = [measure for measure, front in (("KL", frontier.kl_front), ("Δppl", frontier.delta_front))
                  if p in front[name]]
            if by:
                lines.append(f"| {name} | {p.label} | {p.row['method']} | {fmt_value(p.bits)} | "
                             f"{_kl_cell(p)} | {_delta_text(p).removeprefix('Δppl ')} | {', '.join(by)} |")
    return lines


NAMED = 3  # arms named as not separable from a budget's best, the rest counted


def _listed(items: list[str]) -> str:
    more = f"; and {len(items) - NAMED} more" if len(items) > NAMED else ""
    return "; ".join(items[:NAMED]) + more


def _not_separable_kl(best: Point, candidates: list[Point]) -> str:
    """The arms whose KL the best arm's is not separably below (fourbit.report.verdicts), with why."""
    others = sorted((p for p in candidates if p.kl is not None and p is not best),
                    key=lambda p: (p.kl.value, p.key))
    tied = [f"{p.label} ({reason})" for p in others
            for sign, reason in [compare_measure(best.kl, p.kl)] if sign != 1]
    return f"; on KL not separable from {_listed(tied)}" if tied else ""


def _not_separable_delta(best: Point, candidates: list[Point]) -> str:
    """The arms whose Δppl interval overlaps the best arm's."""
    others = sorted((p for p in candidates if p is not best), key=lambda p: (abs(p.delta_pct), p.key))
    tied = [f"{p.label} ({_delta_text(p)})" for p in others
            if overlapping((best.delta_low, best.delta_high), (p.delta_low, p.delta_high))]
    return f"; on Δppl not separable from (intervals overlap) {_listed(tied)}" if tied else ""


def budget_line(bits: float, at: list[Point], candidates: list[Point]) -> str:
    """"at ≤ B bits: best arm X (KL …, Δppl …)", by KL and by |Δppl|, each with its interval
    and the arms it cannot be told from."""
    line = f"- **at ≤ {fmt_value(bits)} bits** ({', '.join(p.label for p in at)}): "
    kl_best = best_by_kl(candidates)
    delta_best = best_by_delta(candidates)
    if len(candidates) == 1:
        return line + f"the only arm, {delta_best.label} ({_kl_text(delta_best)}; {_delta_text(delta_best)})."
    if kl_best is not None and kl_best is delta_best:
        return (line + f"best arm **{kl_best.label}** by KL and by |Δppl| ({_kl_text(kl_best)}; "
                f"{_delta_text(kl_best)}){_not_separable_kl(kl_best, candidates)}"
                f"{_not_separable_delta(kl_best, candidates)}.")
    if kl_best is not None:
        line += (f"best arm by KL **{kl_best.label}** ({_kl_text(kl_best)}; {_delta_text(kl_best)})"
                 f"{_not_separable_kl(kl_best, candidates)}")
    else:
        line += "no arm here has a KL"
    return (line + f". By |Δppl|: **{delta_best.label}** ({_delta_text(delta_best)}; {_kl_text(delta_best)})"
            f"{_not_separable_delta(delta_best, candidates)}.")


def frontier_section(rows: list[dict]) -> list[str]:
    """The report's frontier section: what it plots, each family's front, one line per budget."""
    frontier = frontier_of(rows)
    if not frontier.points:
        return ["No arm has bits per weight over all matrices, so there is no frontier."]
    lines = [
        "Each arm's KL and Δppl against its **bits/weight, all matrices** (`matrix_bits_per_weight`: "
        "every weight matrix as stored, head and embedding included), by family: "
        + ", ".join(f"{name} ({len(members)} arm{'s' * (len(members) != 1)})"
                    for name, members in frontier.points.items())
        + ". An arm is on its family's front when no arm of the family has no more bits and a KL "
        "(or |Δppl|) no larger, one of the two strictly smaller. Δppl is in percent of the arm's "
        "own engine's baseline and ranked by its absolute value. The plot is under Plots.",
        "",
        *front_table(frontier),
    ]
    off = [p.label for members in frontier.points.values() for p in members
           if all(p not in front.get(p.family, []) for front in (frontier.kl_front, frontier.delta_front))]
    if off:
        lines += ["", "On no front (dominated within its family on KL and on |Δppl|): "
                  + ", ".join(off) + "."]
    if frontier.left_out:
        lines += ["", "Not placed: " + "; ".join(frontier.left_out) + "."]
    lines += ["", "Best arm at each bit budget, over every family (a budget at each bits where some "
                  "front has an arm, since only there can the answer change; each holds up to the next):", ""]
    every = [p for members in frontier.points.values() for p in members]
    for bits, at in frontier.budgets():
        lines.append(budget_line(bits, at, [p for p in every if p.bits <= bits]))
    return lines
