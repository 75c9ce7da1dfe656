"""The tasks a study enables, refused before any job when they cannot run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fourbit.tasks import humaneval, preflight, registry
from fourbit.tasks.registry import TaskError


def test_no_enabled_task_checks_nothing(tmp_path):
    assert preflight.check_tasks({"humaneval": False}, tmp_path / "absent") == []


@pytest.mark.usefixtures("task_sandbox")
def test_an_enabled_task_is_returned_once_it_can_run(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert preflight.check_tasks({"humaneval": True}, tmp_path) == [humaneval.HUMANEVAL]


def test_an_enabled_task_on_a_model_without_a_tokenizer_is_refused(tmp_path):
    with pytest.raises(TaskError, match="needs the model's tokenizer"):
        preflight.check_tasks({"humaneval": True}, tmp_path)


def test_an_enabled_task_whose_data_is_gone_is_refused(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(humaneval, "data_file", lambda: tmp_path / "HumanEval.jsonl.gz")
    with pytest.raises(TaskError, match="HumanEval's data file is missing"):
        preflight.check_tasks({"humaneval": True}, tmp_path)


def test_a_tokenizer_made_by_a_job_has_no_chat_template_so_a_chat_task_is_refused(monkeypatch):
    # No folder yet (builtin and synthetic models: fourbit's own SentencePiece, made by a job):
    # a plain-completion task passes, one through a chat template is refused before any job.
    assert preflight.check_tasks({"humaneval": True, "problems": 3}, None) == [humaneval.HUMANEVAL]
    chat = replace(humaneval.HUMANEVAL, prompt_format=replace(humaneval.PROMPT_FORMAT, chat_template=True))
    monkeypatch.setitem(registry.TASKS, "humaneval", chat)
    with pytest.raises(TaskError, match="has none: use an instruct model's folder"):
        preflight.check_tasks({"humaneval": True}, None)
