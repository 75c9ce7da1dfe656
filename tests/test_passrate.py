"""pass@1's Wilson interval and the exact McNemar test, against values worked by hand."""

import math

import pytest

from fourbit.metrics.passrate import mcnemar_exact, pass_at_1, paired


def _scores(solved: int, problems: int) -> dict[str, bool]:
    return {f"p{i}": i < solved for i in range(problems)}


def test_wilson_interval_of_half_solved():
    # p = 0.5, n = 10, z = 1.959964: centre (p + z²/2n) / (1 + z²/n) = 0.5; half-width
    # z / (1 + z²/n) * sqrt(p(1-p)/n + z²/4n²) = 1.416010 * sqrt(0.025 + 0.0096036) = 0.263407.
    rate = pass_at_1(_scores(5, 10))
    assert (rate.solved, rate.problems, rate.value) == (5, 10, 0.5)
    assert rate.lower == pytest.approx(0.236593, abs=1e-6)
    assert rate.upper == pytest.approx(0.763407, abs=1e-6)


def test_wilson_interval_of_none_solved_is_not_zero_wide():
    # p = 0: centre = half-width = (z²/2n) / (1 + z²/n) = 0.192073 / 1.384146 = 0.138767.
    rate = pass_at_1(_scores(0, 10))
    assert rate.lower == pytest.approx(0.0, abs=1e-12)
    assert rate.upper == pytest.approx(0.277533, abs=1e-6)


def test_wilson_interval_is_symmetric_in_solved_and_unsolved():
    some, rest = pass_at_1(_scores(3, 164)), pass_at_1(_scores(161, 164))
    assert math.isclose(some.lower, 1 - rest.upper) and math.isclose(some.upper, 1 - rest.lower)


def test_no_problems_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        pass_at_1({})


@pytest.mark.parametrize(("b", "c", "p"), [
    (1, 5, 2 * (1 + 6) / 64),  # n = 6: P(X <= 1) = (C(6,0) + C(6,1)) / 2^6
    (0, 6, 2 / 64),
    (6, 0, 2 / 64),
    (3, 3, 1.0),  # 2 * 42/64 > 1: capped
    (0, 0, 1.0),  # no discordant problem: no evidence either way
    (2, 10, 2 * (1 + 12 + 66) / 4096),
])
def test_exact_mcnemar(b, c, p):
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)


def test_paired_comparison_names_the_problems_that_changed():
    baseline = {"a": True, "b": True, "c": False, "d": False, "e": True}
    arm = {"a": True, "b": False, "c": True, "d": False, "e": False}
    result = paired(arm, baseline)
    assert result.newly_failed == ["b", "e"] and result.newly_passed == ["c"]
    assert result.delta == pytest.approx(-1 / 5)
    assert result.p_value == 1.0  # b=2, c=1: n=3, 2 * P(X <= 1) = 2 * 4/8


def test_unpaired_problems_are_refused():
    with pytest.raises(ValueError, match="scored by only one"):
        paired({"a": True}, {"b": True})
