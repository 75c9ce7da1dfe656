"""The tasks a study enables, refused before any job when they cannot run."""

from __future__ import annotations

import pytest

from fourbit.tasks import humaneval, preflight
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
