"""Before any job: the tasks a study enables, each checked where it can fail early.

The workflow calls ``check_tasks`` with the study's validated ``tasks`` block (the schema
gives every registered task a switch, off by default) and the model's folder; a task that
cannot run stops the study here, naming why, instead of inside a job after the builds.
"""

from __future__ import annotations

from pathlib import Path

from fourbit.tasks import sandbox
from fourbit.tasks.registry import Task, check_model, get


def check_tasks(switches: dict[str, bool], model_folder: str | Path) -> list[Task]:
    """The enabled tasks, in name order, after checking that each one's data loads and the
    model has what its prompts need, and (if any is enabled) that the sandbox runs here.
    TaskError or sandbox.SandboxError otherwise; [] and no check when none is enabled."""
    tasks = [get(name) for name, enabled in sorted(switches.items()) if enabled]
    for task in tasks:
        task.load()
        check_model(task, model_folder)
    if tasks:
        sandbox.check_available()
    return tasks
