"""The task registry: lookup, registration, the model check run before any job, and the
config schema's switch for each registered task."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fourbit import schema
from fourbit.tasks import registry
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
    assert block["additionalProperties"] is False
    assert all(key["default"] is False for key in switches.values())


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
