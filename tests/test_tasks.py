"""fourbit.steps.tasks: which problems are put, how each arm is paired with its baseline,
and the step on a real vLLM server (a tiny 4-bit checkpoint through fourbit's plugin):
its completions checked in the sandbox, and a server killed while it generates failing
the job cleanly. The workflow tier (tests/test_workflow.py) runs the step on the tiny
study through both servers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import save_tiny_tokenizer
from fourbit.serving.process import ServerError
from fourbit.steps.serve import ServedArm
from fourbit.steps.tasks import _pair_with_baselines, _problems, tasks_study
from fourbit.tasks.humaneval import HUMANEVAL
from fourbit.tasks.registry import TaskError
from test_serve import SHA, TOLERANCES, VLLM, _server_pids, killed_at_first_request, no_server_left

TASKS = {"humaneval": True, "problems": 6, "max_tokens": 48, "slots": 2}


def test_the_problems_are_all_the_first_n_or_those_named_in_the_tasks_order():
    assert len(_problems(HUMANEVAL, None)) == 164
    assert [p.id for p in _problems(HUMANEVAL, 2)] == ["HumanEval/0", "HumanEval/1"]
    assert [p.id for p in _problems(HUMANEVAL, ["HumanEval/55", "HumanEval/23"])] == [
        "HumanEval/23", "HumanEval/55"]
    with pytest.raises(TaskError, match=r"tasks.problems names \['HumanEval/999'\]"):
        _problems(HUMANEVAL, ["HumanEval/999"])


def _entry(engine_id: str, arm: str, passed: list[bool]) -> dict:
    return {"engine_id": engine_id, "arm": arm, "status": "measured", "vs_baseline": None,
            "outcomes": {f"p{i}": {"status": "passed" if ok else "failed"} for i, ok in enumerate(passed)}}


def test_each_arm_is_paired_with_its_own_engines_baseline():
    entries = [_entry("a", "baseline", [True, True, False]), _entry("a", "x", [False, True, True]),
               _entry("b", "baseline", [False, False, False]), _entry("b", "y", [True, False, False]),
               {"engine_id": "c", "arm": "z", "status": "refused", "reason": "no"}]
    _pair_with_baselines(entries)
    assert entries[0]["vs_baseline"] is None  # a baseline is not compared with itself
    assert entries[1]["vs_baseline"] == {"delta_pass_at_1": 0.0, "newly_failed": ["p0"],
                                         "newly_passed": ["p2"], "mcnemar_p": 1.0}
    assert entries[3]["vs_baseline"]["newly_passed"] == ["p0"]
    assert "vs_baseline" not in entries[4]


def test_a_study_with_no_task_enabled_is_refused(tmp_path):
    with pytest.raises(TaskError, match="no task enabled"):
        tasks_study([], {"humaneval": False}, {}, {}, out=tmp_path / "tasks.json",
                    server_logs=tmp_path, threads=1, model_weights_sha256=SHA,
                    control_tolerance=TOLERANCES)


@pytest.fixture(scope="module")
def task_checkpoint(int4_checkpoints):
    """The tiny cpu_int4 arm with a tokenizer (vLLM's server loads one)."""
    arm, _ = int4_checkpoints
    save_tiny_tokenizer(arm, vocab=512)
    return arm


def _score(tmp_path: Path, arm: Path) -> dict:
    # serve.arms names the arm; the tasks step adds no baseline that is not there to serve
    return tasks_study([ServedArm("vllm-1", VLLM, "t-0000000000", "t", arm, tmp_path / "cache")],
                       TASKS, {"arms": ["t"], "baseline": False}, {"allow_busy": True},
                       out=tmp_path / "tasks.json", server_logs=tmp_path / "servers", threads=2,
                       model_weights_sha256=SHA, control_tolerance=TOLERANCES, positions=512)


@pytest.mark.slow
def test_vllm_completes_every_problem_and_the_sandbox_checks_them(task_checkpoint, tmp_path, task_sandbox):
    record = _score(tmp_path, task_checkpoint)
    [task] = record["tasks"]
    assert task["problems"] == [f"HumanEval/{i}" for i in range(6)]
    assert task["prompt_format"]["max_tokens"] == 48
    [entry] = task["arms"]
    assert entry["status"] == "measured" and "fourbit_int4 plugin" in entry["runtime"]
    assert set(entry["completions"]) == set(entry["outcomes"]) == set(task["problems"])
    # random weights: nothing passes, and each failure says why
    assert entry["pass_at_1"]["solved"] == 0 and entry["pass_at_1"]["problems"] == 6
    assert all(o["status"] != "passed" and o["detail"] for o in entry["outcomes"].values())
    assert entry["generation_s"] > 0 and entry["checking_s"] > 0
    assert entry["vs_baseline"] is None  # no baseline was given to pair it with
    assert json.loads((tmp_path / "tasks.json").read_text()) == json.loads(json.dumps(record))
    assert _server_pids(task_checkpoint) == []


@pytest.mark.slow
def test_a_server_killed_while_generating_fails_the_job_with_its_log_and_leaves_nothing(
        task_checkpoint, tmp_path, task_sandbox):
    log = tmp_path / "servers" / "humaneval.vllm-1.t-0000000000.log"
    with pytest.raises(ServerError) as error, killed_at_first_request(log, task_checkpoint):
        _score(tmp_path, task_checkpoint)
    message = str(error.value)
    assert "exited with status -9 while in use" in message
    assert "command: " in message and "vllm.entrypoints.openai.api_server" in message
    assert "last lines of" in message
    assert not (tmp_path / "tasks.json").exists()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tasks.json")]
    assert no_server_left(task_checkpoint)
