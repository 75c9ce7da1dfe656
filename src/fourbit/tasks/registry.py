"""Task sets a study can score its builds on: one registration per set, with everything
the rest of the code asks of it (STYLE.md 19).

A task is data (its problems, loaded and checked), a prompt format (how every engine is
asked, stated as data so it is the same for each) and a checker (the program that passes
exactly when a completion solves its problem, run by fourbit.tasks.sandbox). A new task
set is one module that builds a Task and calls ``register``; fourbit.tasks imports the
shipped ones, then every Task an installed package names under the ``fourbit.tasks``
entry point group (``load_plugins``), so a user's set plugs in without editing fourbit:

    [project.entry-points."fourbit.tasks"]
    mytask = "mypackage.tasks:MY_TASK"

and the study switches it on like a shipped one (``tasks: {mytask: true}``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable


class TaskError(ValueError):
    """A task cannot run as asked: its data is missing or wrong, or the model lacks what it needs."""


OPENAI_STOPS = 4  # stop sequences an OpenAI-compatible request may carry


@dataclass(frozen=True)
class PromptFormat:
    """How each problem is put to an engine; the same for every engine and arm."""
    chat_template: bool  # False: the prompt text is completed as it is (no chat template applied)
    stop: tuple[str, ...]  # generation ends at the first of these (the stop text itself is dropped)
    max_tokens: int  # new tokens at most per completion
    temperature: float = 0.0  # greedy: one completion per problem, so pass@1 needs no sampling estimate

    def request(self, prompt: str) -> tuple[str, dict]:
        """(path, body) of the OpenAI-compatible request vLLM's and llama.cpp's servers both
        answer for ``prompt``; the caller adds the served model's name. The OpenAI API takes
        at most OPENAI_STOPS stop sequences (vLLM's server answers 400 to more): the first
        of them go to the server, to end generation early, and :meth:`cut` applies them all."""
        common = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                  "stop": list(self.stop[:OPENAI_STOPS])}
        if self.chat_template:
            return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}
        return "/v1/completions", {"prompt": prompt, **common}

    def cut(self, completion: str) -> str:
        """``completion`` up to the first of every stop sequence (the server applied only
        the first OPENAI_STOPS of them)."""
        ends = [completion.find(stop) for stop in self.stop if stop in completion]
        return completion[:min(ends, default=len(completion))]


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str  # the text the engine completes (or, with a chat template, the user's message)
    fields: dict = field(default_factory=dict, compare=False)  # what the task's checker needs


@dataclass(frozen=True)
class Task:
    name: str
    load: Callable[[], list[Problem]]  # every problem, checked (TaskError naming the file otherwise)
    prompt_format: PromptFormat
    program: Callable[[Problem, str], str]  # (problem, completion) -> Python that exits 0 iff it is right
    source: str  # where the data comes from, for the report


TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    if task.name in TASKS:
        raise ValueError(f"task {task.name!r} is registered twice")
    TASKS[task.name] = task
    return task


PLUGIN_GROUP = "fourbit.tasks"  # entry points naming a Task each


def load_plugins() -> None:
    """Register the Task each installed ``fourbit.tasks`` entry point names (once per name:
    importing fourbit.tasks again does not register it twice). TaskError naming the entry
    point when it cannot be loaded, is not a Task, or its name differs from the Task's."""
    for point in entry_points(group=PLUGIN_GROUP):
        if point.name in TASKS:
            continue
        try:
            task = point.load()
        except Exception as error:  # any failure of a user's module is reported as its own
            raise TaskError(f"the {PLUGIN_GROUP} entry point {point.name} = {point.value!r} cannot be "
                            f"loaded: {type(error).__name__}: {error}") from error
        if not isinstance(task, Task):
            raise TaskError(f"the {PLUGIN_GROUP} entry point {point.name} = {point.value!r} names a "
                            f"{type(task).__name__}, not a fourbit.tasks.registry.Task")
        if task.name != point.name:
            raise TaskError(f"the {PLUGIN_GROUP} entry point {point.name} = {point.value!r} names the task {task.name!r}: "
                            "give the entry point the task's name (the study's switch is that name)")
        register(task)


def get(name: str) -> Task:
    if name not in TASKS:
        raise TaskError(f"no task named {name!r}; registered: {', '.join(sorted(TASKS)) or 'none'}")
    return TASKS[name]


# A tokenizer transformers and the servers can load (one of these, see
# fourbit.inputs.tokenizer_files), and where a chat template may live.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def check_model(task: Task, model_folder: str | Path) -> None:
    """TaskError unless the model in ``model_folder`` has what ``task`` asks of it: a
    tokenizer always, a chat template if the task's prompts use one. Reads only small
    files; the workflow calls it for every enabled task before any job runs."""
    folder = Path(model_folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise TaskError(f"task {task.name!r} needs the model's tokenizer, and {folder} has none "
                        f"({' / '.join(TOKENIZER_FILES)}): add the tokenizer files or turn the task off")
    if task.prompt_format.chat_template and not _has_chat_template(folder):
        raise TaskError(
            f"task {task.name!r} puts its prompts through the model's chat template, and {folder} "
            f"has none (no {' / '.join(CHAT_TEMPLATE_FILES)}, no chat_template in "
            "tokenizer_config.json): use an instruct model's folder, or turn the task off")


def _has_chat_template(folder: Path) -> bool:
    if any((folder / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
