import math

import pytest

from fourbit.metrics.stats import delta_ppl_interval, overlapping


def test_interval_contains_the_point_and_is_deterministic():
    tokens = [100] * 50
    base = [300.0 + (i % 7) * 10 for i in range(50)]
    arm = [b + 5.0 + (i % 3) for i, b in enumerate(base)]
    point, lo, hi = delta_ppl_interval(arm, base, tokens)
    assert lo <= point <= hi and lo > 0
    assert (point, lo, hi) == delta_ppl_interval(arm, base, tokens)
    assert math.isclose(point, math.exp(sum(arm) / 5000) - math.exp(sum(base) / 5000))


def test_paired_differences_give_a_narrow_interval_despite_hard_windows():
    tokens = [100] * 40
    base = [200.0 + 100 * (i % 2) for i in range(40)]  # windows differ a lot in difficulty
    arm = [b + 2.0 for b in base]  # the arm is uniformly a little worse
    _, lo, hi = delta_ppl_interval(arm, base, tokens)
    assert lo > 0 and (hi - lo) < 0.5 * (hi + lo) / 2


def test_identical_scores_give_a_zero_interval():
    assert delta_ppl_interval([1.0, 2.0], [1.0, 2.0], [1, 1]) == (0.0, 0.0, 0.0)


def test_unpaired_input_is_refused():
    with pytest.raises(ValueError, match="paired windows"):
        delta_ppl_interval([1.0], [1.0, 2.0], [1, 1])


def test_overlap():
    assert overlapping((0, 2), (1, 3)) and not overlapping((0, 1), (2, 3))
