"""The task registry: lookup, registration, the model check run before any job, and the
config schema's switch for each registered task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from fourbit import schema
from fourbit.tasks import preflight, registry
from fourbit.tasks.registry import TaskError


def test_an_unknown_task_lists_the_registered_ones():
    with pytest.raises(TaskError, match="no task named 'mbpp'; registered: humaneval"):
        registry.get("mbpp")


def test_a_name_registered_twice_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.get("humaneval"))


def test_every_registered_task_has_a_switch_in_the_config_schema_that_defaults_to_off():
    block = schema.load_schema()["properties"]["tasks"]
    # the block's other keys are the tasks step's settings (problems, max_tokens, ...)
    switches = {name: key for name, key in block["properties"].items() if key.get("type") == "boolean"}
    assert set(switches) == set(registry.TASKS)
    # an installed task set's switch: any other key, a boolean (preflight names an unknown one)
    assert block["additionalProperties"] == {"type": "boolean"}
    assert all(key["default"] is False for key in switches.values())


def test_a_switch_no_registered_task_answers_to_is_refused_with_how_to_register_one():
    with pytest.raises(TaskError, match=r"tasks: mbpp is not a registered task \(registered: humaneval\); "
                                        r"a task set of your own registers through the fourbit.tasks entry point"):
        preflight.enabled({"humaneval": True, "mbpp": False})
    assert preflight.enabled({"humaneval": True, "problems": 3}) == ["humaneval"]


PLUGIN = '''
from fourbit.tasks.registry import Problem, PromptFormat, Task

PROBLEMS = [Problem("addone/0", "def add_one(x):\\n", {"test": "assert add_one(1) == 2"})]

ADDONE = Task(name="addone", load=lambda: PROBLEMS,
              prompt_format=PromptFormat(chat_template=False, stop=("\\ndef",), max_tokens=16),
              program=lambda problem, completion: problem.prompt + completion + "\\n" + problem.fields["test"] + "\\n",
              source="a test's own package")
'''

CHECK = '''
import json
from fourbit import schema
from fourbit.tasks import registry, scoring
from fourbit.tasks.preflight import check_tasks

settings = schema.block("tasks", {"addone": True})
[task] = check_tasks(settings, None)
right = scoring.score(task, {"addone/0": "    return x + 1\\n"}, parallel=1).passed()
wrong = scoring.score(task, {"addone/0": "    return x\\n"}, parallel=1).passed()
print(json.dumps({"registered": sorted(registry.TASKS), "settings": settings, "right": right, "wrong": wrong}))
'''


def _install(site, name, value):
    """A package on ``site`` with a fourbit.tasks entry point, as pip would leave it."""
    info = site / "mytasks-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mytasks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fourbit.tasks]\n{name} = {value}\n")


def _python(site, code):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.usefixtures("task_sandbox")
def test_an_installed_packages_task_set_is_registered_switched_on_and_checked(tmp_path):
    """A task set of a package installed beside fourbit (its dist-info names it under the
    fourbit.tasks entry points): importing fourbit.tasks registers it, the schema takes its
    switch, the preflight enables it, and the sandbox passes a right completion and fails
    a wrong one with its checker."""
    site = tmp_path / "site"
    _install(site, "addone", "mytasks:ADDONE")
    (site / "mytasks.py").write_text(PLUGIN)
    done = _python(site, CHECK)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["registered"] == ["addone", "humaneval"]
    assert result["settings"]["addone"] is True and result["settings"]["humaneval"] is False
    assert result["right"] == {"addone/0": True} and result["wrong"] == {"addone/0": False}


@pytest.mark.parametrize(("name", "value", "message"), [
    ("addone", "mytasks:MISSING", "cannot be loaded: AttributeError"),
    ("addone", "mytasks:PROBLEMS", "names a list, not a fourbit.tasks.registry.Task"),
    ("other", "mytasks:ADDONE", "names the task 'addone': give the entry point the task's name"),
])
def test_an_entry_point_that_is_not_a_task_is_named(tmp_path, name, value, message):
    site = tmp_path / "site"
    _install(site, name, value)
    (site / "mytasks.py").write_text(PLUGIN)
    done = _python(site, "import fourbit.tasks")
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert f"the fourbit.tasks entry point {name}" in done.stderr


def test_a_model_without_a_tokenizer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TaskError, match=f"task 'humaneval' needs the model's tokenizer, and {tmp_path} has none"):
        registry.check_model(registry.get("humaneval"), tmp_path)


def test_plain_completion_needs_no_chat_template(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    registry.check_model(registry.get("humaneval"), tmp_path)


def test_a_chat_task_on_a_model_without_a_template_is_refused_and_accepted_with_one(tmp_path):
    humaneval = registry.get("humaneval")
    chat = replace(humaneval, name="chat", prompt_format=replace(humaneval.prompt_format, chat_template=True))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(TaskError, match="puts its prompts through the model's chat template"):
        registry.check_model(chat, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    registry.check_model(chat, tmp_path)


def test_a_prompt_becomes_the_same_request_for_every_engine():
    form = registry.get("humaneval").prompt_format
    assert form.request("def f():\n") == ("/v1/completions", {
        "prompt": "def f():\n", "max_tokens": 384, "temperature": 0.0,
        "stop": ["\nclass", "\ndef", "\n#", "\nif"]})  # the OpenAI API's 4 at most
    # the fifth applies when the completion comes back
    assert form.cut("    return 1\nprint(f())\n#") == "    return 1"
    assert form.cut("    return 1\n") == "    return 1\n"
    chat = replace(form, chat_template=True)
    path, body = chat.request("Write f.")
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "Write f."}]
