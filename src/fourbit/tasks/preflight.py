"""Before any job: the tasks a study enables, each checked where it can fail early.

The workflow calls ``check_tasks`` with the study's validated ``tasks`` block (the schema
gives every registered task a switch, off by default) and the model's folder; a task that
cannot run stops the study here, naming why, instead of inside a job after the builds.
"""

from __future__ import annotations

from pathlib import Path

from fourbit.tasks import sandbox
from fourbit.tasks.registry import TASKS, Task, TaskError, check_model, get


def check_tasks(switches: dict, model_folder: str | Path | None) -> list[Task]:
    """The enabled tasks, in name order, after checking that each one's data loads and the
    model has what its prompts need, and (if any is enabled) that the sandbox runs here.
    ``switches`` is the study's tasks block (its other keys, settings such as
    tasks.problems, are not switches). ``model_folder`` None: the model's tokenizer is
    made by a job (fourbit's own SentencePiece for builtin and synthetic models, which has
    no chat template). TaskError or sandbox.SandboxError otherwise; [] and no check when
    none is enabled."""
    tasks = [get(name) for name in enabled(switches)]
    for task in tasks:
        task.load()
        if model_folder is not None:
            check_model(task, model_folder)
        elif task.prompt_format.chat_template:
            raise TaskError(f"task {task.name!r} puts its prompts through the model's chat "
                            "template, and this model's tokenizer (fourbit's own, made by a "
                            "job) has none: use an instruct model's folder, or turn the task off")
    if tasks:
        sandbox.check_available()
    return tasks


def enabled(switches: dict) -> list[str]:
    """The registered tasks switched on in the study's tasks block, in name order; TaskError
    for a switch no registered task answers to (the schema takes any boolean key there, so
    that an installed task set can be switched on)."""
    unknown = sorted(name for name, value in switches.items() if isinstance(value, bool) and name not in TASKS)
    if unknown:
        raise TaskError(f"tasks: {', '.join(unknown)} is not a registered task (registered: "
                        f"{', '.join(sorted(TASKS))}); a task set of your own registers through "
                        "the fourbit.tasks entry point group (README, \"Task accuracy\")")
    return [name for name in sorted(TASKS) if switches.get(name) is True]
