"""The last tier: the whole workflow on a tiny config, in its own directory."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiny_study import ROOT, SNAKEMAKE, TINY, scheduled_jobs, snakemake

pytestmark = [pytest.mark.workflow, pytest.mark.slow]

# finished_study (conftest.py): the tiny study, run once for the session.


def test_report_has_a_row_per_arm_and_engine(finished_study):
    rows = list(csv.DictReader((finished_study / "results/report.tsv").open(), delimiter="\t"))
    config = yaml.safe_load(TINY.read_text())
    # Each engine adds its own baseline row; llama.cpp scores only the GGUF arm.
    assert len(rows) == len(config["arms"]) + len(config["engines"])
    arms = [r for r in rows if r["arm_id"] != "baseline"]
    for row in arms:
        assert float(row["ppl"]) > 0
        assert 4.0 < float(row["bits_per_weight"]) < 6.0  # rtn_mixed_large: 4.5 + 1.07
        # Every arm, llama.cpp's included, against its own dense expansion on its engine.
        assert row["control"] == "faithful", row
        assert float(row["dense_ppl"]) > 0
        # KL from full logits on the study's windows, on every engine
        assert row["kl_from"] == "full logits (exact)" and float(row["kl_mean"]) > 0, row
        if row["engine"].startswith("llamacpp"):
            assert "llama.cpp" in row["runtime"]
        if row["engine"].startswith("llamacpp"):  # timed: paired passes against the f16 GGUF
            assert float(row["tg128_median"]) > 0 and float(row["tg128_ratio"]) > 0
        else:  # the reference engine is not a deployment engine
            assert row["tg128_median"] == "" and "not benchmarked" in row["throughput_note"]
    markdown = (finished_study / "results/report.md").read_text()
    for section in ("## Fidelity to the baseline", "## Throughput", "## Recommendation",
                    "## Quality per bit: the frontier", "## Host"):
        assert section in markdown
    assert (finished_study / "results/report-frontier.png").is_file()


def test_the_imatrix_arms_share_one_importance_matrix_of_the_calibration_windows(finished_study):
    """The two arms of imatrix: calibration name one calibration block: one matrix, computed
    by llama.cpp on exactly the windows a gptq arm with that block fits (each one chunk),
    recorded beside it and in both arms' manifests."""
    results = finished_study / "results"
    [record_path] = results.glob("*/imatrix/*/imatrix.json")
    record = json.loads(record_path.read_text())
    llama = record["llama_cpp"]
    assert record["same_ids"] and record["gptq_windows"] == {"windows": 8, "seq_len": 128,
                                                             "tokens": 8 * 128}
    assert llama["chunks"] == 8 and llama["chunk_size"] == 128 + llama["bos_prepended"]
    assert llama["matrices"] == 7  # the tiny model's one decoder layer; not the head
    for name in ("q4_k_s_imatrix", "iq4_nl_imatrix"):
        arm = json.loads(next(results.glob(f"*/arms/{name}-*/arm.json")).read_text())
        assert arm["imatrix"]["llama_cpp"] == llama
        assert (finished_study / arm["imatrix"]["path"]).parent == record_path.parent
    main_type = {"q4_k_s_imatrix": "Q4_K", "iq4_nl_imatrix": "IQ4_NL"}
    for name, ggml_type in main_type.items():
        arm = json.loads(next(results.glob(f"*/arms/{name}-*/arm.json")).read_text())
        assert ggml_type in arm["storage"]["by_type"], arm["storage"]["by_type"]


def test_mixed_precision_arms_of_two_budgets_start_from_one_shared_pass(finished_study):
    """The two rtn_mixed arms differ only in extra_bits: one sensitivity job ran, and both
    arms spent their budget on its measurement, the larger budget removing more KL, and
    some set went to a grid narrower than 8 bits (tiny.yaml)."""
    results = finished_study / "results"
    [record_path] = results.glob("*/sensitivity/*/sensitivity.json")
    record = json.loads(record_path.read_text())
    assert record["windows"] == 2 and len(record["sets"]) == 5  # 4 sets of the one layer, the head
    moved, left = {}, {}
    for name in ("rtn_mixed_small", "rtn_mixed_large"):
        arm = json.loads(next(results.glob(f"*/arms/{name}-*/arm.json")).read_text())
        mixed = arm["method_facts"]["mixed_precision"]
        assert mixed["shared_pass"]["id"] == record["id"] == record_path.parent.name
        assert [s["kl"] for s in mixed["sets"]] == [s["kl"] for s in record["sets"]]
        assert mixed["extra_bits_spent"] <= arm["quant"]["mixed_precision"]["extra_bits"]
        moved[name] = mixed["moved"]
        left[name] = sum(next((w["kl"] for w in s["wider"] if w["bits"] == s["bits"]), s["kl"])
                         for s in mixed["sets"])
    assert moved["rtn_mixed_small"] and left["rtn_mixed_large"] < left["rtn_mixed_small"]
    assert {5, 6} & {*moved["rtn_mixed_small"].values(), *moved["rtn_mixed_large"].values()}
    markdown = (results / "report.md").read_text()
    assert f"4-bit pass and measurement: `{record['id']}`" in markdown


# The vLLM engine as the default study runs it (float32, eager, fourbit's plugin for the
# 4-bit arms), added to the finished tiny study in a copy of its folder: only the vLLM
# jobs, the bench (it times every engine's pairs in one job) and the report run again.
VLLM = {"dtype": "float32", "enforce_eager": True, "kv_cache_gib": 1}


@pytest.fixture(scope="module")
def vllm_study(finished_study, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm-study")
    shutil.copytree(finished_study, workdir, symlinks=True, dirs_exist_ok=True)
    config = yaml.safe_load(TINY.read_text())
    config["engines"]["vllm"] = VLLM
    path = workdir / "with-vllm.yaml"
    path.write_text(yaml.safe_dump(config))
    dry = snakemake(workdir, "-n", "results/report.md", config=path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    run = snakemake(workdir, "results/report.md", config=path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return workdir, scheduled_jobs(dry.stdout)


def test_vllm_engine_runs_the_study_end_to_end(vllm_study):
    workdir, scheduled = vllm_study
    arms = sum(arm["quant"]["method"] != "llamacpp"  # all but the GGUF arms
               for arm in yaml.safe_load(TINY.read_text())["arms"])
    # Its baseline, and every fourbit arm quantized and dense in one job; each arm's fidelity.
    # (its ppl jobs keep the fidelity sides: the *_with_side rules)
    assert scheduled == {"ppl_baseline_with_side": 1, "ppl_with_side": arms, "fidelity": arms,
                         "bench": 1, "serve": 1, "report": 1}
    rows = [r for r in csv.DictReader((workdir / "results/report.tsv").open(), delimiter="\t")
            if r["engine"].startswith("vllm")]
    assert len(rows) == 1 + arms
    for row in rows:
        assert float(row["ppl"]) > 0
        # The tiny model holds 128 positions; vLLM refuses pp512's prompt, so the bench
        # records why (found before any job) instead of failing the study.
        assert row["tg128_median"] == "" and "exceeds the model's 128 positions" in row["throughput_note"]
        if row["arm_id"] != "baseline":
            assert row["control"] == "faithful", row
            assert "fourbit" in row["runtime"], row  # the plugin ran the 4-bit weights
            assert float(row["kl_mean"]) > 0 and 0 < float(row["top1_agreement"]) <= 1, row
            assert row["kl_from"] == "full logits (exact)", row


def _serve_record(workdir: Path) -> dict:
    [path] = (workdir / "results").glob("*/eval/*/serve.json")
    return json.loads(path.read_text())


def test_the_tiny_study_serves_its_best_llamacpp_arm_on_llama_server(finished_study):
    record = _serve_record(finished_study)
    # the reference engine has no server; no baselines (tiny.yaml)
    [served] = record["served"]
    assert served["engine"] == "llamacpp" and served["status"] == "measured", served
    assert Path(served["command"][0]).name == "llama-server"
    assert [level["concurrency"] for level in served["levels"]] == [1, 2]
    for level in served["levels"]:
        assert level["status"] == "measured" and len(level["passes"]) == 3
        assert all(p["completed"] == 4 and p["failed"] == 0 for p in level["passes"])
    assert record["workload"]["output_tokens"] == 16 and record["load_generator"].startswith("fourbit")


def test_vllm_and_llama_server_both_serve_the_study_end_to_end(vllm_study):
    """The best faithful arm of each engine, each on its own real server, in one job."""
    workdir, _ = vllm_study
    served = {s["engine"]: s for s in _serve_record(workdir)["served"]}
    assert set(served) == {"vllm", "llamacpp"}
    for engine, entry in served.items():
        assert entry["status"] == "measured", entry
        assert all(level["status"] == "measured" for level in entry["levels"]), entry
    assert "vllm.entrypoints.openai.api_server" in served["vllm"]["command"]
    assert "fourbit_int4 plugin" in served["vllm"]["runtime"]  # the 4-bit arm ran through fourbit
    # no server outlived the job
    for entry in served.values():
        model = entry["command"][entry["command"].index("--model") + 1]
        assert not any(model in p.read_bytes().decode(errors="replace")
                       for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists()), model


# HumanEval on the tiny study with vLLM (tasks are off in tiny.yaml, as by default): three
# problems whose prompts fit the tiny model's 128 positions with 16 new tokens (its
# tokenizer gives them 67-79 tokens), on the best faithful arm and the baseline of each
# engine with a server. Only the tasks job and the report run again.
TASKS = {"humaneval": True, "problems": ["HumanEval/23", "HumanEval/53", "HumanEval/55"], "max_tokens": 16}


@pytest.fixture(scope="module")
def tasks_study(vllm_study, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tasks-study")
    shutil.copytree(vllm_study[0], workdir, symlinks=True, dirs_exist_ok=True)
    config = yaml.safe_load((workdir / "with-vllm.yaml").read_text())
    config["tasks"] = TASKS
    path = workdir / "with-tasks.yaml"
    path.write_text(yaml.safe_dump(config))
    # The record is asked for by name: the report job gains an input and an output (the plot),
    # and Snakemake counts it done while report.md exists ("Nothing to be done"; README).
    [eval_dir] = (workdir / "results").glob("*/eval/*")
    record = str((eval_dir / "tasks.json").relative_to(workdir))
    dry = snakemake(workdir, "-n", record, "results/report.md", config=path)
    assert dry.returncode == 0 and "Job stats:" in dry.stdout, dry.stdout[-3000:] + dry.stderr[-3000:]
    run = snakemake(workdir, record, "results/report.md", config=path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return workdir, scheduled_jobs(dry.stdout)


def test_the_tasks_step_scores_a_vllm_and_a_llamacpp_arm_on_their_servers(tasks_study):
    workdir, scheduled = tasks_study
    assert scheduled == {"tasks": 1, "report": 1}
    [path] = (workdir / "results").glob("*/eval/*/tasks.json")
    [task] = json.loads(path.read_text())["tasks"]
    assert task["problems"] == TASKS["problems"]
    entries = {(e["engine"], e["arm"] == "baseline"): e for e in task["arms"]}
    assert set(entries) == {("vllm", True), ("vllm", False), ("llamacpp", True), ("llamacpp", False)}
    for (engine, baseline), entry in entries.items():
        assert entry["status"] == "measured", entry
        assert set(entry["completions"]) == set(entry["outcomes"]) == set(TASKS["problems"])
        assert entry["pass_at_1"]["problems"] == 3 and entry["generation_s"] > 0
        assert (entry["vs_baseline"] is None) == baseline, entry
        if not baseline:
            paired = entry["vs_baseline"]
            assert paired["delta_pass_at_1"] == (len(paired["newly_passed"]) - len(paired["newly_failed"])) / 3
    assert "vllm.entrypoints.openai.api_server" in entries[("vllm", False)]["command"]
    assert Path(entries[("llamacpp", False)]["command"][0]).name == "llama-server"
    report = (workdir / "results/report.md").read_text()
    assert "## Task accuracy" in report and "- **On humaneval**: `" in report and "for fidelity" in report
    assert (workdir / "results/report-tasks-delta.png").stat().st_size > 0


def test_tasks_are_off_in_the_tiny_study_as_by_default(finished_study):
    assert not list((finished_study / "results").glob("*/eval/*/tasks.json"))
    assert "## Task accuracy" not in (finished_study / "results/report.md").read_text()


def test_vllm_exact_kl_equals_the_reference_engines_on_every_arm(vllm_study):
    """On the builtin tiny model in float32, each arm's KL as vLLM computes it (fourbit's
    plugin running the 4-bit weights) is the reference engine's within 1e-6 nats per
    position: one measure whichever engine ran the arm."""
    workdir, _ = vllm_study
    kl = {}
    for path in (workdir / "results").glob("*/eval/*/*/*/fidelity.json"):
        record = json.loads(path.read_text())
        kl.setdefault(path.parent.name, {})[record["engine"]["name"]] = record
    compared = {arm: by for arm, by in kl.items() if {"vllm", "reference"} <= set(by)}
    arms = yaml.safe_load(TINY.read_text())["arms"]
    assert len(compared) == sum(arm["quant"]["method"] != "llamacpp" for arm in arms)  # GGUFs aside
    for arm, by in compared.items():
        vllm, reference = by["vllm"], by["reference"]
        assert vllm["method"] == reference["method"] == "full logits", arm
        assert vllm["positions"] == reference["positions"], arm
        assert abs(vllm["kl_mean"] - reference["kl_mean"]) <= 1e-6, (arm, vllm["kl_mean"],
                                                                     reference["kl_mean"])


def test_the_fidelity_job_reads_the_sides_the_ppl_jobs_declare(tmp_path):
    """vLLM's ppl jobs write the fidelity sides of the arm (as quantized) and of the
    baseline as declared outputs, and its fidelity job reads them: forcing those two jobs
    again reschedules the arm's fidelity job because both sides changed, and forcing the
    baseline's alone reschedules the arm's ppl job, which reads its logits. The reference
    engine keeps no side, so forcing its ppl jobs reschedules no fidelity job. Dry runs
    only, on a study whose every output is stood in for by an empty file or folder."""
    config = yaml.safe_load(TINY.read_text())
    config["engines"] = {"reference": config["engines"]["reference"], "vllm": VLLM}
    config["arms"] = config["arms"][:1]
    path = tmp_path / "sides.yaml"
    path.write_text(yaml.safe_dump(config))
    dry = snakemake(tmp_path, "-n", "results/report.md", config=path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    for listed in re.findall(r"^    output: (.*)$", dry.stdout, re.M):
        for output in (tmp_path / name for name in listed.split(", ")):
            output.parent.mkdir(parents=True, exist_ok=True)
            # the checkpoint folders (directory() outputs) are the outputs without a suffix
            output.touch() if output.suffix else output.mkdir(exist_ok=True)
    touched = snakemake(tmp_path, "--touch", "results/report.md", config=path)  # all up to date
    assert touched.returncode == 0, touched.stderr[-3000:]

    def forced(*rules):
        run = snakemake(tmp_path, "-n", "--forcerun", *rules, "results/report.md", config=path)
        assert run.returncode == 0, run.stderr[-3000:]
        # the report (and the default target rule all, which has no output) follow any job,
        # and the serve job any vLLM record (serve.arms: best_faithful reads them)
        jobs = {k: v for k, v in scheduled_jobs(run.stdout).items()
                if k not in ("report", "all", "serve")}
        reasons = re.findall(r"^rule fidelity:\n(?:    .*\n)*?    reason: (.*)$", run.stdout, re.M)
        return jobs, reasons

    jobs, reasons = forced("ppl_with_side", "ppl_baseline_with_side")
    assert jobs == {"ppl_with_side": 1, "ppl_baseline_with_side": 1, "fidelity": 1}
    # the arm's side holds its KL against the baseline's kept logits: it is made again too
    assert forced("ppl_baseline_with_side")[0] == jobs
    updated = [Path(f) for f in reasons[0].removeprefix(
        "Input files updated by another job: ").split(", ")]
    assert sorted((f.parents[1].name.split("-")[0], f.parent.name == "baseline", f.name)
                  for f in updated) == [("vllm", False, "quantized.side.json"),
                                        ("vllm", True, "dense.side.json")]
    assert forced("ppl", "ppl_baseline") == ({"ppl": 1, "ppl_baseline": 1}, [])


def test_a_mispacked_checkpoint_fails_the_control_at_every_tolerance(finished_study, tmp_path):
    """The control catches a wrong runtime: the int4_g128 arm's checkpoint with the two codes
    of every byte swapped (a nibble-order bug), scored by the reference engine on the
    study's windows, is farther from the arm's dense expansion than any numerics' tolerance
    allows, the loosest (int8 activations) included."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from fourbit.schema import block
    from fourbit.steps.evaluate import score_checkpoint

    results = finished_study / "results"
    arm = next(results.glob("*/arms/int4_g128-*/quantized"))
    mispacked = tmp_path / "mispacked"
    shutil.copytree(arm, mispacked, symlinks=True)
    weights = mispacked / "model.safetensors"
    with safe_open(weights, "pt") as stored:
        metadata, tensors = stored.metadata(), {k: stored.get_tensor(k) for k in stored.keys()}
    for name in [n for n in tensors if n.endswith(".qweight")]:
        packed = tensors[name]  # uint8 [N, K/2], two 4-bit codes per byte
        tensors[name] = ((packed >> 4) | (packed << 4)).to(torch.uint8)
    weights.unlink()
    save_file(tensors, weights, metadata=metadata)
    reference = next(results.glob("*/eval/*/reference-*"))
    dense = json.loads(next(reference.glob(f"{arm.parent.name}/dense.ppl.json")).read_text())
    scored = score_checkpoint(
        mispacked, next(results.glob("*/eval/*/windows.json")), tmp_path / "mispacked.ppl.json",
        dense["engine"], threads=2, model_weights_sha256=dense["model_weights_sha256"],
        cache_root=tmp_path / "cache")
    loosest = max(block("evaluation")["control_tolerance"].values())
    assert abs(scored["mean_nll"] - dense["mean_nll"]) > loosest, (scored["mean_nll"], dense["mean_nll"])

def test_html_report_builds_with_captions(finished_study):
    run = snakemake(finished_study, "--report", "report.html")
    assert run.returncode == 0, run.stderr[-3000:]
    html = (finished_study / "report.html").read_text(errors="replace")
    assert "report-quality-vs-bits.png" in html and "paired-bootstrap" in html


def test_changing_one_arm_reschedules_only_that_arm(finished_study, tmp_path):
    config = yaml.safe_load(TINY.read_text())
    config["arms"][1]["quant"]["shrink_steps"] += 1
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(config))
    dry = snakemake(finished_study, "-n", "results/report.md", config=changed)
    assert dry.returncode == 0, dry.stderr[-3000:]
    # One new arm: quantize, dequantize, its ppl job (both forms), bench, fidelity, the report.
    expected = {"quantize": 1, "dequantize": 1, "ppl": 1, "bench": 1, "fidelity": 1, "report": 1}
    assert scheduled_jobs(dry.stdout) == expected


def test_unchanged_config_schedules_nothing(finished_study):
    dry = snakemake(finished_study, "-n", "results/report.md")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "Nothing to be done" in dry.stdout + dry.stderr


def test_config_error_stops_before_any_job(tmp_path):
    config = yaml.safe_load(TINY.read_text())
    config["arms"][0]["quant"]["gruop_size"] = 64
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    run = snakemake(tmp_path, "results/report.md", config=bad)
    assert run.returncode != 0
    assert "gruop_size" in run.stderr and "allowed keys" in run.stderr
    assert not (tmp_path / "results").exists()


def test_lint_is_clean(tmp_path):
    run = subprocess.run([*SNAKEMAKE, "--lint", "--configfile", str(TINY), "--directory", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.skipif(shutil.which("snakefmt") is None and not (Path(sys.executable).parent / "snakefmt").exists(),
                    reason="snakefmt not installed")
def test_snakefmt_is_clean():
    snakefmt = shutil.which("snakefmt") or str(Path(sys.executable).parent / "snakefmt")
    files = [str(ROOT / "Snakefile"), *map(str, (ROOT / "workflow" / "rules").glob("*.smk"))]
    run = subprocess.run([snakefmt, "--check", *files], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
