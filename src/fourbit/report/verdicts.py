"""The report's verdicts: which arm to ship for speed, which for fidelity, and the
arms whose perplexity fell below their baseline's, each with its reason in numbers.

Rows are fourbit.report.rows.build_rows' dicts (one per arm and engine, None where a
value is missing); this module only reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist

import torch

from fourbit.metrics.stats import CONFIDENCE, overlapping


def fmt_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-3 and value != 0 else f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value)


def throughput_span(r: dict, short: str) -> str:
    if r[f"{short}_median"] is None:
        return "—"
    return (f"{r[f'{short}_median']:.1f} [{r[f'{short}_min']:.1f}–{r[f'{short}_max']:.1f}] "
            f"×{r[f'{short}_ratio']:.2f}")


# --- verdicts -------------------------------------------------------------------------------
#
# The recommendation reads what each number means. Perplexity is a score of text, so a 4-bit
# arm can lower it by changing the model; how close an arm stays to the model it copies is
# what the distribution measures (KL, top-1, greedy) say, so "for fidelity" is chosen by
# them. "For speed" compares decode across engines (one bench job, one host), so its quality
# condition uses the one quality number every engine measures the same way: Δppl in percent
# of its own baseline, on the same token ids.

# Normal quantile of the two-sided interval used when two measures cannot be paired.
_Z = NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)
_DIFFERENCE_RESAMPLES = 2000


@dataclass(frozen=True)
class Measure:
    """One distribution measure of one arm, with what comparing it with another arm's needs."""

    name: str  # "KL", "top-1", "greedy"
    value: float
    higher_is_better: bool
    # Per window (KL, top-1) or per prompt (greedy): (sum, count), in a fixed order ...
    units: tuple[tuple[float, float], ...] | None = None
    # ... which pairs with another arm's units only when these keys are equal.
    pairing: tuple | None = None
    unit_name: str = "windows"

    def standard_error(self) -> float | None:
        if not self.units or len(self.units) < 2:
            return None
        # Ratio estimator sum(s) / sum(n) over units: its delta-method standard error.
        total = sum(n for _, n in self.units)
        residuals = [s - self.value * n for s, n in self.units]
        count = len(self.units)
        return math.sqrt(count / (count - 1) * math.fsum(r * r for r in residuals)) / total

    def shown(self) -> str:
        if self.name == "KL":
            return f"{self.value:.4g}"
        if self.name == "top-1":
            return f"{self.value:.1%}"
        identical = sum(s for s, _ in self.units) if self.units else self.value
        return f"{identical:.0f}/{len(self.units)}" if self.units else f"{self.value:.0%}"


def distribution_measures(record: dict | None) -> dict[str, Measure] | None:
    """KL, top-1 and greedy of a fidelity record, or None when none was computed."""
    if record is None or not record.get("computed", True) or "kl_mean" not in record:
        return None
    windows = record.get("window_positions")
    window_key = (record.get("token_ids_sha256"), tuple(windows)) if windows else None
    kl_units = top1_units = None
    if windows and "window_kl_sum" in record:
        kl_units = tuple(zip(record["window_kl_sum"], windows))
    if windows and "window_top1" in record:
        top1_units = tuple(zip(record["window_top1"], windows))
    greedy = record["greedy"]
    prefix = greedy.get("matching_prefix")
    settings = record.get("settings", {})
    greedy_units = (tuple((float(p == greedy["new_tokens"]), 1.0) for p in prefix)
                    if prefix and "new_tokens" in greedy else None)
    return {
        "KL": Measure("KL", record["kl_mean"], False, units=kl_units, pairing=window_key),
        "top-1": Measure("top-1", record["top1_agreement"], True, units=top1_units,
                         pairing=window_key),
        "greedy": Measure(
            "greedy", greedy["identical"] / greedy["prompts"], True, units=greedy_units,
            pairing=(record.get("token_ids_sha256"), settings.get("prompts"),
                     settings.get("prompt_tokens"), greedy.get("new_tokens")),
            unit_name="prompts",
        ),
    }


def _paired_difference_interval(a: Measure, b: Measure) -> tuple[float, float]:
    """Percentile bootstrap over the shared units of mean(a) - mean(b), both ratio means
    (sum of sums over sum of counts) of the same resampled units, like Δppl's interval."""
    a_sums = torch.tensor([s for s, _ in a.units], dtype=torch.float64)
    b_sums = torch.tensor([s for s, _ in b.units], dtype=torch.float64)
    counts = torch.tensor([n for _, n in a.units], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(len(counts), (_DIFFERENCE_RESAMPLES, len(counts)), generator=generator)
    scored = counts[picks].sum(1)  # [R]
    deltas = (a_sums[picks].sum(1) - b_sums[picks].sum(1)) / scored  # [R]
    tail = (1 - CONFIDENCE) / 2
    low, high = torch.quantile(deltas, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high


def compare_measure(a: Measure, b: Measure) -> tuple[int, str]:
    """+1 when a is separably better, -1 when b is, 0 when neither; with the reason.

    Paired (a bootstrap over the windows or prompts both scored) when both recorded the
    same units, else unpaired from standard errors; a difference counts when its
    CONFIDENCE interval excludes 0."""
    if a.units and b.units and a.pairing is not None and a.pairing == b.pairing \
            and len(a.units) == len(b.units):
        low, high = _paired_difference_interval(a, b)
        where = f"the paired {CONFIDENCE:.0%} interval of the difference over {len(a.units)} {a.unit_name}"
    else:
        se_a, se_b = a.standard_error(), b.standard_error()
        if se_a is None or se_b is None:
            return 0, (f"{a.name} {a.shown()} vs {b.shown()}: measured on other positions and no "
                       "uncertainty recorded for one of them")
        spread = _Z * math.hypot(se_a, se_b)
        low, high = a.value - b.value - spread, a.value - b.value + spread
        where = f"the unpaired {CONFIDENCE:.0%} interval of the difference (other positions)"
    pair = f"{a.name} {a.shown()} vs {b.shown()}"
    if low <= 0 <= high:
        return 0, f"{pair}: {where}, [{low:.3g}, {high:.3g}], includes 0"
    a_better = (low > 0) == a.higher_is_better
    return (1 if a_better else -1), f"{pair}: separably {'better' if a_better else 'worse'}"


def compare_arms(a: dict, b: dict) -> tuple[int, list[str]]:
    """+1 when arm a is closer to its baseline than b: separably better on at least one
    distribution measure and separably worse on none; -1 the other way; 0 otherwise, with
    each measure's reason."""
    outcomes = [compare_measure(a["_measures"][name], b["_measures"][name])
                for name in ("KL", "top-1", "greedy")]
    signs = {sign for sign, _ in outcomes}
    if 1 in signs and -1 not in signs:
        return 1, [reason for _, reason in outcomes]
    if -1 in signs and 1 not in signs:
        return -1, [reason for _, reason in outcomes]
    return 0, [reason for _, reason in outcomes]


def _label(r: dict) -> str:
    return f"`{r['arm_id']}` on {r['engine']}"


def _delta(r: dict) -> str:
    return (f"Δppl {fmt_value(r['delta_ppl'])} [{fmt_value(r['delta_ppl_ci_low'])}, "
            f"{fmt_value(r['delta_ppl_ci_high'])}] ({r['delta_ppl_pct']:+.2f}%)")


def below_baseline(r: dict) -> bool:
    """Its whole Δppl interval lies below 0: the arm scores better than its own baseline."""
    return r["arm_id"] != "baseline" and r["delta_ppl_ci_high"] < 0


def _why_not_judged(r: dict) -> str:
    if r["control"] == "NOT faithful":
        return "control NOT faithful"
    return f"fidelity not computed: {r['kl_from'] or 'no reason recorded'}"


def judged_arms(rows: list[dict]) -> list[dict]:
    """The arms the fidelity verdict chooses among: not the baselines, not an arm whose
    control failed, and only arms whose distribution measures were computed."""
    return [r for r in rows if r["arm_id"] != "baseline" and r["control"] != "NOT faithful"
            and r["_measures"]]


def closest_to_baseline(rows: list[dict]) -> dict | None:
    """The arm the fidelity verdict recommends among ``rows`` (None: none was judged): the
    serve step serves it (fourbit.steps.serve, serve.arms: best_faithful)."""
    judged = judged_arms(rows)
    return judged[_closest(judged)[0]] if judged else None


def _closest(judged: list[dict]) -> tuple[int, dict[tuple[int, int], int]]:
    """The index of the closest arm among ``judged`` (not separably farther than any other,
    then the smallest KL, the highest top-1, the most greedy matches), and each pair's sign."""
    # Each pair once (a comparison is symmetric up to its sign); the reasons are recomputed,
    # from the chosen arm's side, only for the arms it cannot be separated from.
    sign = {}
    for i, a in enumerate(judged):
        for j in range(i + 1, len(judged)):
            sign[(i, j)] = compare_arms(a, judged[j])[0]
            sign[(j, i)] = -sign[(i, j)]
    dominated = {j for (i, j), s in sign.items() if s == 1}
    front = [i for i in range(len(judged)) if i not in dominated] or list(range(len(judged)))
    measures = [r["_measures"] for r in judged]
    chosen = min(front, key=lambda i: (measures[i]["KL"].value, -measures[i]["top-1"].value,
                                       -measures[i]["greedy"].value))
    return chosen, sign


def fidelity_verdict(rows: list[dict]) -> str:
    arms = [r for r in rows if r["arm_id"] != "baseline"]
    judged = judged_arms(rows)
    judged_ids = {id(r) for r in judged}
    skipped = [f"{_label(r)} ({_why_not_judged(r)})" for r in arms if id(r) not in judged_ids]
    left_out = f" Not judged: {'; '.join(skipped)}." if skipped else ""
    if not judged:
        return ("- For fidelity: no arm's next-token distribution was compared with its "
                "baseline, so none is recommended (perplexity alone cannot say which arm "
                f"stays closest).{left_out}")
    chosen, sign = _closest(judged)
    best = judged[chosen]
    m = best["_measures"]
    support = _delta(best)
    if best["delta_ppl_ci_low"] <= 0 <= best["delta_ppl_ci_high"]:
        support += ", 0 inside its interval"
    if below_baseline(best):
        support += ", its whole interval below 0 (a finding, below)"
    tied = [(judged[j], compare_arms(best, judged[j])[1]) for j in range(len(judged))
            if j != chosen and sign[(chosen, j)] != 1]
    line = (f"- **For fidelity: {_label(best)}**: the closest to its engine's baseline by the "
            f"distribution measures: KL {m['KL'].shown()} nats, top-1 {m['top-1'].shown()}, "
            f"greedy {m['greedy'].shown()} identical; in support, {support}.")
    farther = len(judged) - 1 - len(tied)
    if farther:
        line += (f" {farther} other arm(s) are separably farther from their baselines on KL, "
                 "top-1 or greedy and closer on none.")
    if tied:
        line += " Not separable from it: " + "; ".join(
            f"{_label(r)} ({'; '.join(reasons)})" for r, reasons in tied) + "."
    return line + left_out


def _speed_candidates(rows: list[dict], bound_pct: float) -> tuple[list[dict], dict | None, float]:
    """The faithful arms, the one with the smallest |Δppl|, and the |Δppl| limit the speed
    verdict chooses under (that smallest plus ``bound_pct`` points)."""
    faithful = [r for r in rows if r["arm_id"] != "baseline" and r["control"] == "faithful"]
    if not faithful:
        return [], None, 0.0
    cheapest = min(faithful, key=lambda r: abs(r["delta_ppl_pct"]))
    return faithful, cheapest, abs(cheapest["delta_ppl_pct"]) + bound_pct


def _timed_within(faithful: list[dict], limit: float) -> list[dict]:
    return [r for r in faithful if abs(r["delta_ppl_pct"]) <= limit and r["tg128_median"] is not None]


def _fastest(timed: list[dict]) -> dict | None:
    return max(timed, key=lambda r: r["tg128_median"]) if timed else None


def fastest_within_bound(rows: list[dict], bound_pct: float) -> dict | None:
    """The arm the speed verdict recommends (None: it names none)."""
    faithful, _, limit = _speed_candidates(rows, bound_pct)
    return _fastest(_timed_within(faithful, limit))


def speed_verdict(rows: list[dict], bound_pct: float) -> str:
    arms = [r for r in rows if r["arm_id"] != "baseline"]
    faithful, cheapest, limit = _speed_candidates(rows, bound_pct)
    if not faithful:
        return "- For speed: no arm's control passed, so none is recommended."
    condition = (f"arms whose control passed and whose |Δppl| is within {bound_pct:g} percentage "
                 f"points (report.speed_quality_bound_pct) of the smallest "
                 f"({abs(cheapest['delta_ppl_pct']):.2f}%, {_label(cheapest)}), so at most {limit:.2f}%")
    timed = _timed_within(faithful, limit)
    fast = _fastest(timed)
    if fast is None:
        return f"- For speed: no throughput was measured on this host for {condition}; none is recommended."
    line = (f"- **For speed: {_label(fast)}**: the fastest decode, {fast['tg128_median']:.1f} tok/s "
            f"[{fast['tg128_min']:.1f}–{fast['tg128_max']:.1f}] (×{fast['tg128_ratio']:.2f} its "
            f"baseline), among {condition}; its {_delta(fast)}.")
    tied = [r for r in timed if r is not fast
            and overlapping((fast["tg128_min"], fast["tg128_max"]), (r["tg128_min"], r["tg128_max"]))]
    if tied:
        line += (" Not separable from it on speed (their tg128 [min–max] overlap its "
                 f"{fast['tg128_min']:.1f}–{fast['tg128_max']:.1f}): "
                 + ", ".join(f"{_label(r)} ({throughput_span(r, 'tg128')})" for r in tied) + ".")
    faster = [r for r in arms if r["tg128_median"] is not None and r["tg128_median"] > fast["tg128_median"]]
    faithful_ids = {id(r) for r in faithful}
    outside = [r for r in faster if id(r) in faithful_ids]
    if outside:
        line += " Faster but outside the quality bound: " + ", ".join(
            f"{_label(r)} ({r['tg128_median']:.1f} tok/s, |Δppl| {abs(r['delta_ppl_pct']):.2f}%)"
            for r in outside) + "."
    unproven = [r for r in faster if id(r) not in faithful_ids]
    if unproven:
        line += " Faster but its control did not pass: " + ", ".join(
            f"{_label(r)} ({r['tg128_median']:.1f} tok/s, control {r['control'] or 'not run'})"
            for r in unproven) + "."
    return line


def findings(rows: list[dict]) -> list[str]:
    """Arms that score better than their own baseline: a finding about the study, not a win."""
    return [
        f"- **A finding, not a win: {_label(r)} scores better than its unquantized baseline**: "
        f"{_delta(r)}, the whole interval below 0. A 4-bit copy of a model should not predict "
        "held-out text better than the model it copies; on a well-trained model and a large "
        "enough corpus it does not. The usual causes: an undertrained model (the rounding "
        "noise acts as a regularizer), an evaluation split too small, or a corpus unlike the "
        "model's training data. How far the arm moved from its baseline is what its KL and "
        "top-1 say, not this drop."
        for r in rows if below_baseline(r)
    ]


def recommendation_rules(settings: Mapping) -> list[str]:
    """The rules the verdicts follow, for the report's definitions."""
    return [
        "- **For fidelity**: among arms whose control did not fail and whose fidelity was "
        "computed, each compared with its own engine's baseline, an arm is closer than another "
        "when it is separably better on at least one of KL, top-1 and greedy and separably "
        "worse on none. Separably: the difference's "
        f"{CONFIDENCE:.0%} interval excludes 0 (a paired bootstrap over the windows or prompts "
        "both scored, across engines too, since every engine scores the same windows; between "
        "arms scored on other windows, from each measure's standard error). The arm named is the one no other arm is "
        "closer than (the lowest KL of them when several); every arm it is not closer than is "
        "named with the reason. Δppl is support, never the criterion: an arm can lower "
        "perplexity by changing the model.",
        "- **For speed**: the fastest decode (tg128 median, absolute tok/s, comparable across "
        "engines because one bench job timed every row) among arms whose control passed and "
        "whose |Δppl| (in percent of its own engine's baseline: the quality number every engine "
        "measures alike, on the same token ids) is at most the smallest such |Δppl| of any faithful arm plus "
        f"{settings['speed_quality_bound_pct']:g} percentage points "
        "(report.speed_quality_bound_pct); arms whose tg128 [min–max] overlaps the chosen "
        "one's are named as not separable from it.",
        "- **Below its baseline**: an arm whose whole Δppl interval lies below 0 scores better "
        "than the unquantized model; the report flags it as a finding about the model or the "
        "corpus, not as a better build.",
    ]


def recommended_arms(rows: list[dict], settings: Mapping) -> list[tuple[str, str, str]]:
    """(engine id, arm id, which verdict) of each arm the speed and fidelity verdicts name."""
    named = [("speed", fastest_within_bound(rows, settings["speed_quality_bound_pct"])),
             ("fidelity", closest_to_baseline(rows))]
    return [(r["engine"], r["arm_id"], verdict) for verdict, r in named if r is not None]


def recommend(rows: list[dict], settings: Mapping) -> list[str]:
    """The arm to ship for speed and the one for fidelity, each with its reason in numbers,
    then the arms whose perplexity fell below their baseline's."""
    return [speed_verdict(rows, settings["speed_quality_bound_pct"]), fidelity_verdict(rows),
            *findings(rows)]
