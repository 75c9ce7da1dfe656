"""Scoring completions of real HumanEval problems in the real sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from fourbit.tasks import registry, sandbox, scoring
from fourbit.tasks.registry import TaskError

ESCAPED = Path(__file__).parent / "escaped.txt"
# Why the write fails: outside the folders the sandbox hides behind an empty tmpfs the
# checkout is mounted read-only; a checkout under one of them (a clone in /tmp) is not there.
HIDDEN = any(ESCAPED.is_relative_to(place) for place in sandbox.MASKED)
REFUSED_WRITE = "No such file or directory" if HIDDEN else "Read-only file system"
HANDFUL = [f"HumanEval/{i}" for i in (0, 2, 11, 53, 100, 162)]  # 162 imports hashlib


@pytest.fixture(scope="module")
def humaneval():
    return registry.get("humaneval")


@pytest.fixture(scope="module")
def canonical(humaneval):
    return {p.id: p.fields["canonical_solution"] for p in humaneval.load() if p.id in HANDFUL}


@pytest.mark.usefixtures("task_sandbox")
def test_canonical_solutions_all_pass(humaneval, canonical):
    scores = scoring.score(humaneval, canonical, parallel=2)
    assert list(scores.outcomes) == HANDFUL
    assert scores.passed() == dict.fromkeys(HANDFUL, True)
    assert scores.wall_seconds > 0


@pytest.mark.slow
@pytest.mark.usefixtures("task_sandbox")
def test_bad_completions_fail_each_with_its_reason(humaneval, canonical):
    completions = {
        "HumanEval/0": "    return None\n",  # wrong answer
        "HumanEval/2": "    while True:\n        pass\n",  # hangs
        "HumanEval/11": "    import ctypes\n    ctypes.string_at(0)\n",  # crashes
        "HumanEval/53": f"    open({str(ESCAPED)!r}, 'w').write('x')\n    return x + y\n",  # writes elsewhere
        "HumanEval/100": canonical["HumanEval/100"],
    }
    scores = scoring.score(humaneval, completions, parallel=2, limits=sandbox.Limits(wall_seconds=3))
    statuses = {problem: outcome.status for problem, outcome in scores.outcomes.items()}
    assert statuses == {"HumanEval/0": "failed", "HumanEval/2": "timed out", "HumanEval/11": "crashed",
                        "HumanEval/53": "failed", "HumanEval/100": "passed"}
    assert scores.outcomes["HumanEval/0"].detail == "AssertionError"
    assert REFUSED_WRITE in scores.outcomes["HumanEval/53"].detail
    assert not ESCAPED.exists()


def test_a_completion_for_a_problem_the_task_lacks_is_refused(humaneval):
    with pytest.raises(TaskError, match="does not have: HumanEval/999"):
        scoring.score(humaneval, {"HumanEval/999": "pass"}, parallel=1)
