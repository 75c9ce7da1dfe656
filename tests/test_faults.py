"""Every kind of job killed midway, and a job that runs out of disk, on the tiny study.

A kill: in a copy of the finished tiny study (conftest.py's ``finished_study``), one job
runs again (``--force`` on its outputs) and stops itself at a fixed point of its writing
(fault_hook/sitecustomize.py: an audit event of the interpreter, so the same point on
every run, without a polling race), where the test kills the whole run, Snakemake and
the job, with SIGKILL to its process group. Then:

- nothing finished-looking is left: each output is absent, or, for a job killed after
  publishing some of its outputs, those few are complete and Snakemake lists them as
  incomplete; every other new name is a hidden temporary ``.<name>.tmp-<pid>``;
- the same command run again, after what a user must do (``--unlock``;
  ``--rerun-incomplete`` where outputs were published), schedules exactly that job; the
  whole study schedules what forcing that job would (the job and what depends on it)
  where published outputs are newer than what read them, and nothing otherwise;
- the rerun runs that one job, removes the killed job's temporaries, and writes what the
  uninterrupted run wrote: byte for byte, records field by field but for the fields that
  time the run (``EXCLUDED``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import mounted_tmpfs
from tiny_study import command, scheduled_jobs, snakemake

pytestmark = [pytest.mark.workflow, pytest.mark.slow]

HOOK = Path(__file__).resolve().parent / "fault_hook"
ARM = "results/*/arms/int4_g128-*"  # the tiny study's cpu_int4 arm at group 128
GGUF_ARM = "results/*/arms/q4_k_m-*"
IMATRIX = "results/*/imatrix/imatrix-*"  # the one importance matrix of the tiny study
PASS = "results/*/sensitivity/sensitivity-*"  # the tiny study's one shared mixed_precision pass
SCORES = "results/*/eval/*/reference-*/int4_g128-*"  # its records from the reference engine
TEMPORARY = re.compile(r"^\..+\.tmp-\d+$")  # fourbit.atomic's temporary names


@dataclass(frozen=True)
class Fault:
    """Where one kind of job is killed: at the ``nth`` audit ``event`` ("open" for writing,
    "os.rename", which os.replace raises too) on a path matching ``path``."""

    rule: str
    outputs: tuple[str, ...]  # globs (under the study's folder) of the job's outputs
    event: str
    path: str
    where: str  # the point, in words
    published: tuple[str, ...] = ()  # outputs at their final names when it is killed
    nth: int = 1


FAULTS = [
    Fault("quantize", (f"{ARM}/quantized", f"{ARM}/arm.json"), "open",
          r"/\.quantized\.tmp-\d+/config\.json$",
          "the checkpoint folder's tokenizer and weights written, its config.json not yet"),
    Fault("sensitivity", (f"{PASS}/four_bit", f"{PASS}/sensitivity.json"), "open",
          r"/\.four_bit\.tmp-\d+/config\.json$",
          "every set measured, the 4-bit folder's tokenizer and weights written, its config.json "
          "not yet"),
    Fault("dequantize", (f"{ARM}/dense",), "open", r"/\.dense\.tmp-\d+/config\.json$",
          "the dense folder's tokenizer and weights written, its config.json not yet"),
    Fault("convert_gguf", ("results/*/gguf/f16.gguf", "results/*/gguf/f16.storage.json"),
          "os.rename", r"/\.f16\.gguf\.tmp-\d+$",
          "llama.cpp's converter done, the f16 GGUF whole under its temporary name"),
    Fault("imatrix", (f"{IMATRIX}/imatrix.gguf", f"{IMATRIX}/imatrix.json"), "os.rename",
          r"/\.imatrix\.gguf\.tmp-\d+$",
          "fourbit-imatrix done, the matrix whole under its temporary name"),
    Fault("quantize_gguf", (f"{GGUF_ARM}/gguf/model.gguf", f"{GGUF_ARM}/arm.json"), "os.rename",
          r"/\.arm\.json\.tmp-\d+$", "the GGUF published, the arm's manifest whole under its temporary name",
          published=(f"{GGUF_ARM}/gguf/model.gguf",)),
    Fault("dequantize_gguf", (f"{GGUF_ARM}/gguf/dense.gguf",), "os.rename",
          r"/\.dense\.gguf\.tmp-\d+$", "llama-quantize done, the F32 GGUF whole under its temporary name"),
    Fault("ppl", (f"{SCORES}/quantized.ppl.json", f"{SCORES}/dense.ppl.json"), "os.rename",
          r"/\.dense\.ppl\.json\.tmp-\d+$",
          "the quantized form's record published, the dense form's whole under its temporary name",
          published=(f"{SCORES}/quantized.ppl.json",)),
    Fault("fidelity", (f"{SCORES}/fidelity.json",), "os.rename", r"/\.fidelity\.json\.tmp-\d+$",
          "the record whole under its temporary name"),
    Fault("bench", ("results/*/eval/*/*/*/bench.json",), "os.rename", r"/\.bench\.json\.tmp-\d+$",
          "every pass timed, the first record (llama.cpp's first arm, q4_k_m) published, the "
          "second whole under its temporary name",
          published=("results/*/eval/*/llamacpp-*/q4_k_m-*/bench.json",), nth=2),
    Fault("serve", ("results/*/eval/*/serve.json",), "os.rename", r"/\.serve\.json\.tmp-\d+$",
          "every level served and timed, the servers stopped, the record whole under its "
          "temporary name"),
    Fault("report", ("results/report.md", "results/report.tsv", "results/report-quality-vs-bits.png",
                     "results/report-quality-vs-decode.png", "results/report-frontier.png",
                     "results/report-serving-throughput.png", "results/report-serving-pareto.png"),
          "os.rename", r"/\.report\.md\.tmp-\d+$",
          "the plots and the table published, the markdown whole under its temporary name",
          published=("results/report.tsv", "results/report-quality-vs-*.png", "results/report-frontier.png",
                     "results/report-serving-*.png")),
]

# Record fields that differ between two runs of the same job (dotted paths), by record
# file name, and why.
EXCLUDED = {
    # the quantize job's wall time and peak memory, and its model walk's
    "arm.json": {"quantize_seconds", "peak_rss_mib", "method_facts.seconds",
                 "method_facts.peak_rss_mb"},
    # the shared pass's wall times and peak memory, and its model walk's
    "sensitivity.json": {"quantize_seconds", "measure_seconds", "peak_rss_mib", "method_facts.seconds",
                         "method_facts.peak_rss_mb"},
    # the comparison's wall time
    "fidelity.json": {"seconds"},
    # llama.cpp's wall time computing the importance matrix
    "imatrix.json": {"llama_cpp.seconds"},
    # a timed record holds this run's timings and the host's state while it ran (load,
    # bandwidth, page cache); kept: what was timed, against what, and from which weights
    "bench.json": {"arm", "baseline", "ratio", "runs", "job", "contention", "bandwidth",
                   "provenance"},
    # likewise the serve job's: its figures (in served), when, and the host's state
    "serve.json": {"served", "job", "contention", "provenance"},
}


def without(record: dict, paths: set[str]) -> dict:
    """``record`` without the fields at ``paths`` ("a.b": field b of field a)."""
    record = json.loads(json.dumps(record))
    for path in paths:
        *parents, name = path.split(".")
        node = record
        for parent in parents:
            node = node.get(parent, {})
        node.pop(name, None)
    return record


def copy_study(finished: Path, folder: Path) -> Path:
    """A copy of the finished study, times kept, that a test may break."""
    shutil.copytree(finished, folder, symlinks=True)
    return folder


def resolve(workdir: Path, globs: tuple[str, ...]) -> list[str]:
    """The study's paths (relative to its folder) that ``globs`` match, one or more each."""
    found = []
    for pattern in globs:
        matches = sorted(str(p.relative_to(workdir)) for p in workdir.glob(pattern))
        assert matches, f"{pattern} matches nothing in {workdir}"
        found += matches
    return found


@contextlib.contextmanager
def stopped_at(fault: Fault, workdir: Path, outputs: list[str], scratch: Path):
    """Run the job (``--force`` on its outputs) in its own process group until it stops at
    the fault's point; yield the run and the stopped job's pid. Whatever the test does,
    nothing of the run outlives the block."""
    marker, log = scratch / f"{fault.rule}.stopped", scratch / f"{fault.rule}.run.log"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")])),
           "FOURBIT_TEST_STOP_AT": json.dumps({"event": fault.event, "path": fault.path,
                                               "nth": fault.nth, "marker": str(marker)})}
    with log.open("w") as sink:
        run = subprocess.Popen(command(workdir, "--force", *outputs), env=env, stdout=sink,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            if run.poll() is not None:
                raise AssertionError(f"the run ended before {fault.where}:\n{log.read_text()[-5000:]}")
            assert time.monotonic() < deadline, f"the job never reached {fault.where}"
            time.sleep(0.05)
        yield run, int(marker.read_text())
    finally:
        kill_group(run)


def kill_group(run: subprocess.Popen) -> None:
    """SIGKILL to the run's whole process group, as a lost node or `kill -9 -<pgid>` would;
    returns once no process of the group is left."""
    if _group_alive(run.pid):
        os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=60)
    deadline = time.monotonic() + 30
    while _group_alive(run.pid):  # the job's processes are reaped by init a moment later
        assert time.monotonic() < deadline, f"processes of group {run.pid} outlived SIGKILL"
        time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def planned(output: str) -> set[tuple[str, str]]:
    """(rule, its outputs) of every job a dry run lists."""
    jobs = set()
    for match in re.finditer(r"^(?:local)?rule (\w+):\n((?:    .*\n)*)", output, re.M):
        outputs = re.search(r"^    output: (.*)$", match[2], re.M)
        jobs.add((match[1], outputs[1] if outputs else ""))
    return jobs


def new_names(finished: Path, workdir: Path, outputs: list[str]) -> set[str]:
    """Names in the outputs' folders that the finished study does not have."""
    names = set()
    for folder in {Path(o).parent for o in outputs}:
        names |= {str(folder / n) for n in os.listdir(workdir / folder)} - \
                 {str(folder / n) for n in os.listdir(finished / folder)}
    return names


def assert_same(expected: Path, got: Path) -> None:
    """Byte for byte (every file of a folder), records but for EXCLUDED fields."""
    if expected.is_dir():
        files = sorted(str(p.relative_to(expected)) for p in expected.rglob("*"))
        assert sorted(str(p.relative_to(got)) for p in got.rglob("*")) == files, got
        for name in files:
            assert_same(expected / name, got / name)
    elif expected.name in EXCLUDED:
        want, have = (without(json.loads(p.read_text()), EXCLUDED[expected.name])
                      for p in (expected, got))
        assert have == want, got
    else:
        assert got.read_bytes() == expected.read_bytes(), got


@pytest.mark.parametrize("fault", FAULTS, ids=[f.rule for f in FAULTS])
def test_a_killed_job_leaves_nothing_finished_and_reruns_alone(fault, finished_study, tmp_path):
    workdir = copy_study(finished_study, tmp_path / "study")
    outputs = resolve(workdir, fault.outputs)
    published = set(resolve(workdir, fault.published))
    with stopped_at(fault, workdir, outputs, tmp_path) as (run, _):
        kill_group(run)

    # Nothing finished-looking: the outputs published before the point, whole; no other
    # output; any other new name a hidden temporary.
    assert {o for o in outputs if os.path.lexists(workdir / o)} == published
    for output in published:
        assert_same(finished_study / output, workdir / output)
    leftovers = new_names(finished_study, workdir, outputs)
    assert leftovers and all(TEMPORARY.match(Path(n).name) for n in leftovers), leftovers

    # What a user must do: run the same command again (its targets: the job's outputs).
    # The killed Snakemake left its lock: a dry run reads through it, a run is refused
    # until --unlock. Published outputs are marked incomplete: both name them and ask for
    # --rerun-incomplete.
    extra = ["--rerun-incomplete"] if published else []
    dry = snakemake(workdir, "-n", *outputs)
    if published:
        said = dry.stdout + dry.stderr
        assert dry.returncode != 0
        assert "The files below seem to be incomplete" in said, said[-3000:]
        assert "--rerun-incomplete" in said
        listed = set(re.findall(r"^(results/\S+)$", said.split("Incomplete files:")[1], re.M))
        assert listed == published, said[-3000:]
    else:
        assert dry.returncode == 0, dry.stderr[-3000:]
    locked = snakemake(workdir, *extra, *outputs)
    said = locked.stdout + locked.stderr
    assert locked.returncode != 0 and "Directory cannot be locked" in said, said[-3000:]
    assert "--unlock" in said
    unlocked = snakemake(workdir, "--unlock")
    assert unlocked.returncode == 0, unlocked.stderr[-3000:]
    dry = snakemake(workdir, "-n", *extra, *outputs)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert scheduled_jobs(dry.stdout) == {fault.rule: 1}
    # (--rerun-incomplete reruns a job as forced)
    reason = "Forced execution" if published else "Missing output files"
    assert re.search(rf"^rule {fault.rule}:\n(?:    .*\n)*?    reason: {reason}", dry.stdout, re.M)

    # The whole study: Snakemake reruns what is older than its inputs. Outputs published
    # before the kill are newer than what read them, so exactly what forcing the job in
    # the finished study would run is scheduled: the job and what depends on it. With none
    # published, whatever read the job's outputs is as new as before: nothing to do.
    whole = snakemake(workdir, "-n", *extra, "results/report.md")
    assert whole.returncode == 0, whole.stderr[-3000:]
    if published:
        forced = snakemake(finished_study, "-n", "results/report.md", "--forcerun", *outputs)
        assert forced.returncode == 0, forced.stderr[-3000:]
        assert planned(whole.stdout) == planned(forced.stdout)
    else:
        assert "Nothing to be done" in whole.stdout, whole.stdout[-3000:]

    # The rerun: that job alone, and the same outputs; the killed job's temporaries gone.
    rerun = snakemake(workdir, *extra, *outputs)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert scheduled_jobs(rerun.stdout + rerun.stderr) == {fault.rule: 1}
    for output in outputs:
        assert_same(finished_study / output, workdir / output)
    assert new_names(finished_study, workdir, outputs) == set()


def test_a_job_that_fills_the_disk_says_so_and_the_rerun_with_space_succeeds(finished_study, tmp_path):
    """The dense expansion of one arm, its arm folder a 16 MB tmpfs that another writer
    fills while the job starts: the job stops at its first write (the same hook as the
    kills), the test fills the filesystem to 64 kB, the job goes on and fails."""
    workdir = copy_study(finished_study, tmp_path / "study")
    arm = workdir / resolve(workdir, (ARM,))[0]
    dense = str((arm / "dense").relative_to(workdir))
    aside = tmp_path / "aside"
    shutil.move(arm, aside)  # the arm's files, times kept, back onto the tmpfs
    with mounted_tmpfs(arm, 16 * 10**6):
        for path in aside.iterdir():
            if path.name != "dense":
                (shutil.copytree if path.is_dir() else shutil.copy2)(path, arm / path.name)
        shutil.copystat(aside, arm)
        fault = Fault("dequantize", (dense,), "open", r"/\.dense\.tmp-\d+/", "its first file")
        with stopped_at(fault, workdir, [dense], tmp_path) as (run, job):
            free = shutil.disk_usage(arm).free
            (arm / "ballast").write_bytes(b"\0" * (free - 64_000))  # another writer fills the disk
            os.kill(job, signal.SIGCONT)
            assert run.wait(timeout=600) != 0
        log = next(workdir.glob("results/logs/dequantize/*/int4_g128-*.log")).read_text()
        message = log.strip().splitlines()[-1]
        assert re.search(
            rf"ERROR fourbit: the disk is full: writing {re.escape(dense)} failed on "
            rf"{re.escape(str(arm))} \(tmpfs\), which had [\d.]+ k?B free of 16\.0 MB when the "
            r"write failed; the job had written [\d.]+ [kM]B of this output \(under \.dense\.tmp-\d+, "
            r"now removed, so nothing finished-looking is left\)\. This job's outputs need about "
            r"[\d.]+ MB \(its disk_mb", message), message
        assert sorted(p.name for p in arm.iterdir()) == ["arm.json", "ballast", "quantized"]

        # Short of space before any job: the study is refused, naming both figures.
        refused = snakemake(workdir, "-n", "results/report.md")
        assert refused.returncode != 0
        assert re.search(rf"{re.escape(dense.removesuffix('dense'))} is on a filesystem "
                         rf"\({re.escape(str(arm))}, tmpfs\) with [\d.]+ kB free; this study needs "
                         r"about [\d.]+ MB more there \(1 float32 dense expansion [\d.]+ MB; \+10%\)",
                         refused.stdout + refused.stderr), refused.stdout[-3000:]

        (arm / "ballast").unlink()  # space again: the rerun succeeds
        rerun = snakemake(workdir, dense)
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
        assert scheduled_jobs(rerun.stdout + rerun.stderr) == {"dequantize": 1}
        assert_same(aside / "dense", arm / "dense")
