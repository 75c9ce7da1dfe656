"""The workflow on a real SLURM cluster, through profiles/slurm.

tests/slurm/start.sh starts a one-node cluster on this machine (Debian's
slurm-wlm and munge, plain daemons, no systemd, no slurmdbd); the tests run the
tiny study, a failing and a retried job, requests no node can satisfy, and a
model folder changed while its job waits, each through ``--profile
profiles/slurm``; tests/slurm/stop.sh stops the cluster. Needs root; installs
slurm-wlm and munge with .ci/install-slurm.sh if missing.

The profiles themselves (both parse, name only real rules) and the rules'
own resources are checked without a cluster, in the fast tier.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "workflow" / "tiny.yaml"
CLUSTER = ROOT / "tests" / "slurm"
PROFILES = ROOT / "profiles"
SLURM_PROFILE = PROFILES / "slurm"
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
STATE_DIR = Path(os.environ.get("FOURBIT_SLURM_DIR", "/var/tmp/fourbit-slurm"))
CONF_MARKER = "# written by fourbit tests/slurm/start.sh"

# Test-only speed-up: the plugin first polls squeue 40 s after a submission and
# adds 10 s per poll while nothing finishes; from 1 s, a short job is seen sooner.
FAST_POLL = ["--slurm-init-seconds-before-status-checks", "1"]
STUDY_RULES = {"prepare_corpus", "download", "untie_head", "tokenize_evaluation", "quantize",
               "dequantize", "ppl", "ppl_baseline", "bench", "fidelity", "serve", "report", "build_llamacpp",
               "convert_gguf", "imatrix", "quantize_gguf", "dequantize_gguf", "sensitivity"}

@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr, interleaved
    seconds: float

    def slurm_ids(self) -> list[str]:
        return re.findall(r"has been submitted with SLURM jobid (\d+)", self.output)


def snakemake(*args: str, timeout: float) -> Run:
    """Snakemake in its own process; on timeout it gets SIGINT, not SIGTERM:
    SIGTERM leaves Snakemake's scheduler loop running, SIGINT stops it and
    cancels its SLURM jobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    start = time.monotonic()
    proc = subprocess.Popen([*SNAKEMAKE, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"snakemake {' '.join(args)} still running after {timeout:.0f}s; "
                    f"stopped with SIGINT. Its output ends:\n{output[-6000:]}")
    return Run(proc.returncode, output, time.monotonic() - start)


def scontrol_job(job_id: str) -> dict[str, str]:
    """A finished job's record (kept MinJobAge = 1 h by the test cluster)."""
    line = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                          text=True, check=True, timeout=30).stdout
    return dict(re.findall(r"(\S+?)=(\S*)", line))


def _missing_tools() -> list[str]:
    tools = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")
    return [tool for tool in tools
            if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("the SLURM cluster test starts munged, slurmctld and slurmd: needs root")
    if _missing_tools():
        install = subprocess.run([str(ROOT / ".ci" / "install-slurm.sh")], capture_output=True,
                                 text=True, timeout=900)
        if install.returncode != 0 or _missing_tools():
            pytest.skip(f"slurm-wlm/munge not installed ({', '.join(_missing_tools())} missing)"
                        f" and .ci/install-slurm.sh failed: {install.stderr[-1000:]}")
    conf = Path("/etc/slurm/slurm.conf")
    if conf.exists() and CONF_MARKER not in conf.read_text(errors="replace"):
        pytest.skip(f"{conf} belongs to a real SLURM installation; the test will not replace it")
    env = {**os.environ, "FOURBIT_SLURM_DIR": str(STATE_DIR)}
    started = subprocess.run([str(CLUSTER / "start.sh")], capture_output=True, text=True,
                             timeout=180, env=env)
    assert started.returncode == 0, \
        f"tests/slurm/start.sh failed:\n{started.stdout}{started.stderr}"
    try:
        yield STATE_DIR
    finally:
        subprocess.run([str(CLUSTER / "stop.sh")], capture_output=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def study(cluster, tmp_path_factory):
    """The tiny study, every job submitted with sbatch under profiles/slurm."""
    workdir = tmp_path_factory.mktemp("slurm-study")
    run = snakemake("--snakefile", str(ROOT / "Snakefile"), "--profile", str(SLURM_PROFILE),
                    "--configfile", str(TINY), "--directory", str(workdir), *FAST_POLL,
                    "results/report.md", timeout=480)
    return workdir, run


# ---- the study ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.workflow
def test_study_runs_through_slurm(study):
    workdir, run = study
    assert run.returncode == 0, run.output[-8000:]
    assert (workdir / "results" / "report.md").is_file()
    ids = run.slurm_ids()
    stats = run.output.split("Job stats:")[1].split("\n\n")[0]
    total = int(re.search(r"^total\s+(\d+)$", stats, re.M)[1])
    assert len(ids) == len(set(ids)) == total, f"{len(ids)} sbatch submissions for {total} jobs"
    jobs = {job_id: scontrol_job(job_id) for job_id in ids}
    for job_id, job in jobs.items():
        assert job["JobState"] == "COMPLETED", (job_id, job)
        assert job["WorkDir"] == str(workdir), (job_id, job)
    rules = {re.match(r"rule_([a-z_]+?)(?:_wildcards_|$)", job["Comment"])[1]: job
             for job in jobs.values()}
    assert set(rules) == STUDY_RULES


@pytest.mark.slow
@pytest.mark.workflow
def test_study_jobs_get_the_profiles_resources(study):
    """What profiles/slurm asks for per rule is what SLURM allocated."""
    _, run = study
    assert run.returncode == 0, run.output[-3000:]
    by_rule: dict[str, list[dict]] = {}
    for job_id in run.slurm_ids():
        job = scontrol_job(job_id)
        rule = re.match(r"rule_([a-z_]+?)(?:_wildcards_|$)", job["Comment"])[1]
        by_rule.setdefault(rule, []).append(job)
    node_cpus = int(subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True,
                                   check=True).stdout.split()[0].rstrip("+"))
    for job in by_rule["report"]:
        assert job["TimeLimit"] == "00:15:00" and job["MinMemoryNode"] == "2000M", job
    # a mixed_precision arm's quantize job only spends its budget on its shared pass (the
    # sensitivity job ran GPTQ): an hour, where the others ask for GPTQ's twelve
    mixed = {job["JobId"] for job in by_rule["quantize"] if "rtn_mixed" in job["Comment"]}
    assert 0 < len(mixed) < len(by_rule["quantize"])
    for job in by_rule["quantize"] + by_rule["sensitivity"]:
        assert job["TimeLimit"] == ("01:00:00" if job["JobId"] in mixed else "12:00:00"), job
        assert int(job["MinMemoryNode"].rstrip("M")) >= 8000, job  # held("model", 3, 8000)
        assert int(job["NumCPUs"]) == node_cpus, job  # threads: workflow.cores = the node
    for job in by_rule["bench"] + by_rule["serve"]:
        assert job["OverSubscribe"] == "NO", job  # --exclusive: the node to itself
        assert int(job["NumCPUs"]) == node_cpus, job
    for job in by_rule["prepare_corpus"]:
        assert job["NumCPUs"] == "1" and job["OverSubscribe"] != "NO", job


# ---- failures -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.workflow
def test_failed_job_is_reported_and_retried(cluster, tmp_path):
    run = snakemake("--snakefile", str(CLUSTER / "Snakefile"), "--profile", str(SLURM_PROFILE),
                    "--directory", str(tmp_path), *FAST_POLL, "--keep-going",
                    "flaky.txt", "broken.txt", timeout=300)
    assert run.returncode != 0, run.output[-5000:]
    # Reported: the rule by name and the SLURM job that failed, both attempts.
    failed = re.findall(r"Error in rule broken:\n\s+message: SLURM-job '(\d+)' failed, "
                        r"SLURM status is: 'FAILED'", run.output)
    assert len(set(failed)) == 2, run.output[-5000:]
    assert "Trying to restart job" in run.output
    assert not (tmp_path / "broken.txt").exists()
    # Retried: profiles/slurm's restart-times: 1 resubmits, attempt 2 succeeds.
    assert "Error in rule flaky:" in run.output
    assert (tmp_path / "flaky.txt").read_text().startswith("attempt 2 "), run.output[-5000:]
    assert "Nothing to be done" not in run.output


@pytest.mark.slow
@pytest.mark.workflow
def test_bad_requests_fail_fast_with_the_schedulers_message(cluster, tmp_path):
    """A profile naming a CPU feature or partition the cluster lacks, or asking for
    more memory than any node has, is refused by sbatch at once (EnforcePartLimits=ALL)
    and Snakemake reports sbatch's words; a feature the node has is honoured."""
    features = subprocess.run(["sinfo", "-h", "-o", "%f"], capture_output=True, text=True,
                              check=True).stdout.split()[0].split(",")
    node_mb = int(subprocess.run(["sinfo", "-h", "-o", "%m"], capture_output=True, text=True,
                                 check=True).stdout.split()[0].rstrip("+"))
    overlay = tmp_path / "site-profile"
    overlay.mkdir()
    (overlay / "config.yaml").write_text(yaml.safe_dump({"set-resources": {
        "targeted": {"constraint": features[-1]},
        "oversized": {"mem_mb": 4 * node_mb},
        "unknown_feature": {"constraint": "no_such_cpu"},
        "unknown_partition": {"slurm_partition": "no_such_partition"},
    }}))
    workdir = tmp_path / "work"
    run = snakemake("--snakefile", str(CLUSTER / "Snakefile"), "--profile", str(SLURM_PROFILE),
                    "--profile", str(overlay), "--directory", str(workdir), *FAST_POLL,
                    "--keep-going", "targeted.txt", "oversized.txt", "unknown_feature.txt",
                    "unknown_partition.txt", timeout=300)
    assert run.returncode != 0, run.output[-5000:]
    for rule, message in [("oversized", "Requested node configuration is not available"),
                          ("unknown_feature", "Invalid feature specification"),
                          ("unknown_partition", "Invalid partition name specified")]:
        reported = re.search(rf"Error in rule {rule}:\n\s+message: SLURM sbatch failed\. "
                             rf"The error message was '[^']*{message}", run.output)
        assert reported, f"{rule}: no '{message}' from sbatch in:\n{run.output[-5000:]}"
        assert not (workdir / f"{rule}.txt").exists()
    assert run.seconds < 150, f"bad requests took {run.seconds:.0f}s to fail"
    targeted = (workdir / "targeted.txt").read_text().strip()
    assert scontrol_job(targeted)["Features"] == features[-1]


@pytest.mark.slow
@pytest.mark.workflow
def test_a_model_folder_changed_while_its_job_waits_is_refused_on_the_node(cluster, tmp_path):
    """The submitting host records a path model's folder (rule record_model_folder, a
    local rule) and submits the download; the folder's config.json changes while the job
    pends (the partition held down); on the node, where Snakemake builds the DAG again
    and the new config.json makes another model id, the job is refused naming the
    change (before that record, Snakemake itself stopped there with an AttributeError)."""
    from conftest import save_tiny_llama, save_tiny_tokenizer

    from fourbit.config import Study

    folder = tmp_path / "model"
    save_tiny_llama(folder, tied=True)
    save_tiny_tokenizer(folder)
    config = {"model": {"source": "path", "path": str(folder)}, "corpus": {"source": "builtin"},
              "arms": [{"name": "g64", "quant": {"method": "cpu_int4", "group_size": 64}}],
              "results": "results"}
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump(config))
    model_id = Study.from_config(config).model_id
    output = tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    subprocess.run(["scontrol", "update", "PartitionName=debug", "State=DOWN"], check=True)
    try:
        with output.open("w") as log:
            proc = subprocess.Popen(
                [*SNAKEMAKE, "--snakefile", str(ROOT / "Snakefile"), "--profile", str(SLURM_PROFILE),
                 "--configfile", str(study), "--directory", str(tmp_path), *FAST_POLL,
                 "--restart-times", "0", f"results/{model_id}/source"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 120
            while "submitted with SLURM jobid" not in output.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
                time.sleep(1)
            assert (tmp_path / "results" / model_id / "source.planned.json").is_file()
            edited = {**json.loads((folder / "config.json").read_text()), "max_position_embeddings": 1024}
            (folder / "config.json").write_text(json.dumps(edited))
    finally:
        subprocess.run(["scontrol", "update", "PartitionName=debug", "State=UP"], check=True)
    assert proc.wait(timeout=300) != 0
    job_log = next((tmp_path / ".snakemake" / "slurm_logs" / "rule_download").rglob("*.log")).read_text()
    assert (f"the model folder {folder} changed after the workflow built its DAG: "
            f"{folder / 'config.json'} (max_position_embeddings 512 then, 1024 now). The study was "
            f"planned on the files as they were (recorded in results/{model_id}/source.planned.json "
            "when the DAG was built)") in job_log, job_log[-3000:]
    assert "AttributeError" not in job_log
    assert not (tmp_path / "results" / model_id / "source").exists()


# ---- the profiles, without a cluster --------------------------------------------

def _profile(name: str) -> dict:
    import yte

    with (PROFILES / name / "config.yaml").open() as stream:
        return yte.process_yaml(stream)


def _rule_bodies() -> dict[str, str]:
    """Each rule of the workflow and the text of its body."""
    bodies = {}
    for path in [ROOT / "Snakefile", *sorted((ROOT / "workflow" / "rules").glob("*.smk"))]:
        text = path.read_text()
        # `rule name:`, and `use rule parent as name with:` (its body: what it changes)
        heads = list(re.finditer(r"^([ ]*)(?:use )?rule (?:\w+ as )?(\w+)(?: with)?:\n", text, re.M))
        for head, following in zip(heads, [*heads[1:], None]):
            bodies[head[2]] = text[head.end(): following.start() if following else len(text)]
    return bodies


def test_profiles_name_only_rules_that_exist():
    """Snakemake ignores set-resources for an unknown rule name without a word:
    a typo (or a renamed rule) would silently drop what a site asked for."""
    rules = set(_rule_bodies())
    for name in ("local", "slurm"):
        profile = _profile(name)
        named = set(profile.get("set-resources", {})) | set(profile.get("set-threads", {}))
        assert named <= rules, f"profiles/{name} names rules the workflow lacks: {named - rules}"


def test_every_study_rule_declares_its_memory_and_runtime():
    """The rules, not the profiles, say what a job needs, so every profile (and a
    site's own) schedules the same requests."""
    bodies = _rule_bodies()
    assert STUDY_RULES <= set(bodies)
    for rule in STUDY_RULES:
        resources = re.search(r"^\s+resources:.*?\n((?:\s+\w+=.*\n)+)", bodies[rule], re.M)
        assert resources, f"rule {rule} declares no resources"
        assert {"mem_mb", "runtime"} <= set(re.findall(r"(\w+)=", resources[1])), rule


def test_slurm_profile_settings_that_keep_runs_from_hanging():
    slurm = _profile("slurm")
    assert slurm["executor"] == "slurm"
    assert slurm["slurm-status-command"] == "squeue"  # sacct hangs without slurmdbd
    assert slurm["restart-times"] >= 1
    assert "--exclusive" in slurm["set-resources"]["bench"]["slurm_extra"]
    assert "--exclusive" in slurm["set-resources"]["serve"]["slurm_extra"]
    assert {"runtime", "mem_mb"} <= set(slurm["default-resources"])


@pytest.mark.slow
@pytest.mark.workflow
def test_local_profile_schedules_the_study(tmp_path):
    run = snakemake("--snakefile", str(ROOT / "Snakefile"), "--profile", str(PROFILES / "local"),
                    "--configfile", str(TINY), "--directory", str(tmp_path), "-n",
                    "results/report.md", timeout=300)
    assert run.returncode == 0, run.output[-3000:]
    assert re.search(r"rule quantize:.*?resources: .*?mem_mb=8000.*?runtime=720", run.output, re.S)
