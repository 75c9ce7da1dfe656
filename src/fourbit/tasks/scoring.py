"""Check a set of completions: each problem's program in the sandbox, several at a time.

The piece the tasks step calls once an engine's server has answered every prompt; it
knows nothing of engines or files.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fourbit.tasks import sandbox
from fourbit.tasks.registry import Task, TaskError


@dataclass(frozen=True)
class Scores:
    outcomes: dict[str, sandbox.Outcome]  # problem id -> how its program ended, in the task's order
    wall_seconds: float  # checking them all, start to end

    def passed(self) -> dict[str, bool]:
        return {problem: outcome.status == "passed" for problem, outcome in self.outcomes.items()}


def score(task: Task, completions: dict[str, str], *, parallel: int,
          limits: sandbox.Limits = sandbox.Limits()) -> Scores:
    """Run ``task``'s checker on each {problem id: completion} in the sandbox, ``parallel``
    programs at a time. Every id must be one of the task's problems; a subset is scored
    as given (the tiny tier uses a handful). A sandbox that cannot run raises
    sandbox.SandboxError: no problem is scored as failed for the sandbox's fault."""
    if not 1 <= parallel <= sandbox.UIDS_PER_PROCESS:
        raise ValueError(f"parallel={parallel}: between 1 and {sandbox.UIDS_PER_PROCESS}")
    problems = {problem.id: problem for problem in task.load()}
    unknown = sorted(set(completions) - set(problems))
    if unknown:
        raise TaskError(f"completions for problems {task.name!r} does not have: {', '.join(unknown[:5])}"
                        + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
    sandbox.check_available()
    ids = [problem for problem in problems if problem in completions]
    slots: queue.SimpleQueue[int] = queue.SimpleQueue()  # each running program has a user of its own
    for slot in range(parallel):
        slots.put(slot)

    def check(problem: str) -> sandbox.Outcome:
        slot = slots.get()
        try:
            return sandbox.run(task.program(problems[problem], completions[problem]), slot=slot, limits=limits)
        finally:
            slots.put(slot)

    start = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=parallel)
    try:
        outcomes = dict(zip(ids, pool.map(check, ids)))
    finally:
        pool.shutdown(cancel_futures=True)  # a SandboxError stops the rest instead of waiting on them
    return Scores(outcomes, time.monotonic() - start)
