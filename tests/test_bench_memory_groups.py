"""The memory plan of a bench job: pairs grouped, in order, so that the engines held open
together fit; a shared baseline reopened in each group; a pair too big alone refused."""

from __future__ import annotations

import pytest

from fourbit.bench.memory_groups import plan_groups

GIB = 1 << 30
PAIRS = {"e/a": {"a", "base"}, "e/b": {"b", "base"}, "e/c": {"c", "base"}}


def test_everything_that_fits_is_one_group():
    held = {"a": GIB, "b": GIB, "c": GIB, "base": GIB}
    assert plan_groups(PAIRS, held, available=4 * GIB) == [["e/a", "e/b", "e/c"]]


def test_a_shared_baseline_counts_once_in_a_group_and_is_reopened_in_the_next():
    held = {"a": GIB, "b": GIB, "c": GIB, "base": GIB}
    assert plan_groups(PAIRS, held, available=3 * GIB) == [["e/a", "e/b"], ["e/c"]]


def test_engines_started_per_pass_are_not_held():
    assert plan_groups(PAIRS, {}, available=0) == [["e/a", "e/b", "e/c"]]


def test_a_pair_that_does_not_fit_alone_is_refused():
    with pytest.raises(MemoryError, match=r"bench pair e/a alone needs about 2\.0 GiB with its "
                                          r"baseline.*1\.0 GiB is available"):
        plan_groups(PAIRS, {"a": GIB, "base": GIB}, available=GIB)

