"""pass@1 on a task set, with its uncertainty, and the paired comparison of an arm with
its engine's baseline on the same problems.

With one greedy completion per problem, pass@1 is the fraction of problems solved. Its
95% interval is Wilson's score interval: closed-form, it stays inside [0, 1] and keeps
close to its nominal coverage at the counts of a task set (n = 164, pass rates near 0 or
1 included), where the normal (Wald) interval collapses to zero width at 0 and 1 and the
exact Clopper-Pearson interval is conservative (wider than 95%).

The arm and the baseline answer the same problems, so their difference is tested paired:
only the discordant problems (solved by one of the two) carry information, and exact
McNemar is the two-sided binomial test of those b newly failed and c newly passed
problems against b = c (each discordant problem equally likely either way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


@dataclass(frozen=True)
class PassRate:
    solved: int
    problems: int
    lower: float  # Wilson 95% interval
    upper: float

    @property
    def value(self) -> float:
        return self.solved / self.problems


def pass_at_1(passed: dict[str, bool]) -> PassRate:
    """pass@1 of {problem id: solved} with its Wilson 95% interval."""
    n = len(passed)
    if n == 0:
        raise ValueError("pass@1 of no problems: score at least one")
    k = sum(passed.values())
    p = k / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 / (1 + Z95**2 / n) * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n))
    return PassRate(k, n, max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class PairedComparison:
    newly_failed: list[str]  # solved by the baseline, not by the arm
    newly_passed: list[str]  # solved by the arm, not by the baseline
    problems: int
    p_value: float  # exact McNemar, two-sided

    @property
    def delta(self) -> float:
        """Δpass@1, arm minus baseline."""
        return (len(self.newly_passed) - len(self.newly_failed)) / self.problems


def paired(arm: dict[str, bool], baseline: dict[str, bool]) -> PairedComparison:
    """The arm against its baseline, problem by problem; both must score the same problems."""
    if set(arm) != set(baseline):
        only = sorted(set(arm) ^ set(baseline))
        raise ValueError(f"paired problems needed: {len(only)} scored by only one of arm and baseline, "
                         f"e.g. {', '.join(only[:3])}")
    failed = [problem for problem in baseline if baseline[problem] and not arm[problem]]
    gained = [problem for problem in baseline if arm[problem] and not baseline[problem]]
    return PairedComparison(failed, gained, len(arm), mcnemar_exact(len(failed), len(gained)))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: twice the smaller binomial tail of b + c discordant
    pairs at probability 1/2, capped at 1 (1 when there are none)."""
    n = b + c
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)
