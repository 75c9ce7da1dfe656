"""fourbit.steps.serve: which arms are served, and the step on a real vLLM server (a tiny
4-bit checkpoint through fourbit's plugin): levels timed or over capacity by the server's
own KV cache count, and a server killed in the middle of a level failing the job cleanly.
The workflow tier (tests/test_workflow.py) serves the tiny study through both servers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from arm_records import arm_records
from conftest import save_tiny_tokenizer
from fourbit.serving.process import ServerError
from fourbit.bench.hostprobe import vllm_runtimes
from fourbit.bench.variants import probed_by_name
from fourbit.cpuinfo import isa_flags
from fourbit.steps.serve import ServedArm, as_deployed, choose_arms, serve_study
from test_hostprobe import EPYC_AVX512, LAPTOP_AVX2, SAPPHIRE_RAPIDS

SHA = "0" * 64
TOLERANCES = {"exact": 1e-4, "bf16_activations": 1e-2, "int8_activations": 1e-2}
VLLM = {"name": "vllm", "dtype": "float32", "enforce_eager": True, "kv_cache_gib": 0.25,
        "max_num_seqs": 1, "quant": {}}
SERVE = {"arms": ["t"], "baseline": False, "concurrency": [1, 2], "prompt_tokens": 32,
         "output_tokens": 16, "requests_per_level": 4, "warmup_requests": 1, "passes": 3}


def _arm(tmp_path: Path, name: str, engine: str = "vllm-1", **records) -> ServedArm:
    return ServedArm(engine, VLLM, f"{name}-0000000000", name, tmp_path / name,
                     records=arm_records(tmp_path / "records" / engine / name, **records) if records else {})


def test_best_faithful_serves_each_engines_closest_arm_and_its_baseline(tmp_path):
    arms = [ServedArm("vllm-1", VLLM, "baseline", "baseline", tmp_path / "b"),
            _arm(tmp_path, "far", kl=0.5, control_delta=0.0),
            _arm(tmp_path, "close", kl=0.01, control_delta=0.0),
            # closest of all, but its control failed: the report would not judge it
            _arm(tmp_path, "unfaithful", kl=0.001, control_delta=0.5)]
    chosen = choose_arms(arms, {"arms": "best_faithful", "baseline": True}, TOLERANCES)
    assert [a.arm_name for a in chosen] == ["baseline", "close"]
    chosen = choose_arms(arms, {"arms": "best_faithful", "baseline": False}, TOLERANCES)
    assert [a.arm_name for a in chosen] == ["close"]


def test_named_arms_are_served_on_every_engine_that_runs_them(tmp_path):
    arms = [_arm(tmp_path, "a"), _arm(tmp_path, "b"), _arm(tmp_path, "a", engine="llamacpp-2")]
    chosen = choose_arms(arms, {"arms": ["a", "not-here"], "baseline": False}, TOLERANCES)
    assert [(a.engine_id, a.arm_name) for a in chosen] == [("vllm-1", "a"), ("llamacpp-2", "a")]


def _checkpoint(folder: Path, quantized: bool) -> Path:
    """A checkpoint folder as the engine reads it to name how it runs it: its config.json."""
    folder.mkdir()
    quant = {"quantization_config": {"quant_method": "fourbit_int4", "kernel": "w4a16"}} if quantized else {}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **quant}))
    return folder


@pytest.mark.parametrize(("flags", "variant", "passed_over"), [
    (SAPPHIRE_RAPIDS, "vllm bfloat16 w4a8_group", []),
    (EPYC_AVX512, "vllm bfloat16 w4a8_group", []),
    (LAPTOP_AVX2, "vllm float32 w4a8_group", ["vllm bfloat16 w4a8_group"]),
], ids=["amx", "avx512", "avx2"])
def test_serve_runtime_takes_the_first_preferred_variant_this_host_runs(tmp_path, flags, variant, passed_over):
    arm = ServedArm("vllm-1", {**VLLM, "name": "vllm"}, "t-0000000000", "t",
                    _checkpoint(tmp_path / "t", quantized=True), tmp_path / "cache")
    preferred = ["vllm bfloat16 w4a8_group", "vllm float32 w4a8_group"]
    deployed = as_deployed(arm, preferred, probed_by_name(flags))
    dtype, kernel = variant.split()[1:]
    assert (deployed.engine["dtype"], deployed.engine["quant"]["kernel"]) == (dtype, kernel)
    assert deployed.cache == tmp_path / "cache" / variant.replace(" ", "-")  # its own compiled graph
    assert deployed.runtime_choice["variant"] == variant
    assert [p["name"] for p in deployed.runtime_choice["passed_over"]] == passed_over
    assert all("avx512_bf16" in p["reason"] for p in deployed.runtime_choice["passed_over"])
    # as_scored, a refused arm and an engine without variants are served as they come
    assert as_deployed(arm, "as_scored", probed_by_name(flags)) is arm
    refused = ServedArm("vllm-1", VLLM, "t-0000000000", "t", tmp_path / "t", refusal="no")
    assert as_deployed(refused, preferred, probed_by_name(flags)) is refused
    native = ServedArm("vllm_native-1", {**VLLM, "name": "vllm_native"}, "t-0000000000", "t", tmp_path / "t")
    assert as_deployed(native, preferred, probed_by_name(flags)) is native


def test_with_no_preferred_variant_runnable_here_the_arm_is_served_as_scored_and_says_why(tmp_path):
    arm = ServedArm("vllm-1", VLLM, "t-0000000000", "t", _checkpoint(tmp_path / "t", quantized=True))
    deployed = as_deployed(arm, ["vllm bfloat16 w4a8"], probed_by_name(LAPTOP_AVX2))
    assert deployed.engine == VLLM and deployed.cache is None
    assert deployed.runtime_choice["variant"] is None
    [(name, reason)] = [(p["name"], p["reason"]) for p in deployed.runtime_choice["passed_over"]]
    assert name == "vllm bfloat16 w4a8" and reason.startswith("needs avx512_bf16, which this CPU lacks")


def test_a_dense_baseline_and_a_variant_that_is_how_the_arm_scored_are_served_as_scored(tmp_path):
    baseline = ServedArm("vllm-1", VLLM, "baseline", "baseline", _checkpoint(tmp_path / "b", quantized=False),
                         tmp_path / "cache")
    assert as_deployed(baseline, ["vllm bfloat16 w4a8_group"], probed_by_name(EPYC_AVX512)) is baseline
    # the arm scored as float32 W4A16: preferring that is no variant (no other cache, no caveat)
    arm = ServedArm("vllm-1", VLLM, "t-0000000000", "t", _checkpoint(tmp_path / "t", quantized=True),
                    tmp_path / "cache")
    deployed = as_deployed(arm, ["vllm bfloat16 w4a8", "vllm float32 w4a16"], probed_by_name(LAPTOP_AVX2))
    assert (deployed.engine, deployed.cache) == (VLLM, tmp_path / "cache")
    assert deployed.runtime_choice["variant"] is None
    assert [p["name"] for p in deployed.runtime_choice["passed_over"]] == ["vllm bfloat16 w4a8"]


def test_the_workflows_cache_folder_string_is_a_path_when_a_variant_is_chosen(tmp_path):
    """The workflow hands the job every path as a string; a variant's cache is a folder of it."""
    model = _checkpoint(tmp_path / "t", quantized=True)
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "max_position_embeddings": 40,
        "quantization_config": {"quant_method": "fourbit_int4", "kernel": "w4a16"}}))
    windows = tmp_path / "windows.json"
    windows.write_text(json.dumps({"window": 64, "windows": [list(range(64))]}))
    arm = ServedArm("vllm-1", VLLM, "t-0000000000", "t", str(model), str(tmp_path / "cache"))
    # stops at the context check, after the runtime is chosen and before any server
    with pytest.raises(ValueError, match="48, more than the 40 positions"):
        serve_study([arm], {**SERVE, "runtime": ["vllm float32 w4a8_group"]}, {}, windows=windows,
                    out=tmp_path / "serve.json", server_logs=tmp_path / "logs", threads=1,
                    model_weights_sha256=SHA, control_tolerance=TOLERANCES)
    with pytest.raises(ValueError, match=r"serve.runtime: unknown variant\(s\) \['vllm fp8 w4a8'\]"):
        serve_study([arm], {**SERVE, "runtime": ["vllm fp8 w4a8"]}, {}, windows=windows,
                    out=tmp_path / "serve.json", server_logs=tmp_path / "logs", threads=1,
                    model_weights_sha256=SHA, control_tolerance=TOLERANCES)


def test_a_request_longer_than_the_models_positions_is_refused_before_any_server(tmp_path):
    model = tmp_path / "t"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 40}))
    windows = tmp_path / "windows.json"
    windows.write_text(json.dumps({"window": 64, "windows": [list(range(64))]}))
    with pytest.raises(ValueError, match="48, more than the 40 positions"):
        serve_study([ServedArm("vllm-1", VLLM, "t-0000000000", "t", model)], SERVE, {},
                    windows=windows, out=tmp_path / "serve.json", server_logs=tmp_path / "logs",
                    threads=1, model_weights_sha256=SHA, control_tolerance=TOLERANCES)
    assert not (tmp_path / "serve.json").exists()


def test_an_engine_that_cannot_run_here_is_refused_with_its_reason(tmp_path):
    windows = tmp_path / "windows.json"
    windows.write_text(json.dumps({"window": 64, "windows": [list(range(64))]}))
    refused = ServedArm("vllm_native-1", {**VLLM, "name": "vllm_native"}, "baseline", "baseline",
                        tmp_path / "never-built", refusal="needs AVX-512 (avx512f), absent here")
    record = serve_study([refused], {**SERVE, "arms": "best_faithful", "baseline": True}, {},
                         windows=windows, out=tmp_path / "serve.json", server_logs=tmp_path / "logs",
                         threads=1, model_weights_sha256=SHA, control_tolerance=TOLERANCES)
    [entry] = record["served"]
    assert entry["status"] == "refused" and "AVX-512" in entry["reason"]
    assert json.loads((tmp_path / "serve.json").read_text())["served"] == [entry]


@pytest.fixture(scope="module")
def served_checkpoint(int4_checkpoints, tmp_path_factory):
    """The tiny cpu_int4 arm with a tokenizer (vLLM's server loads one) and windows of
    token ids from its vocabulary."""
    arm, _ = int4_checkpoints
    save_tiny_tokenizer(arm, vocab=512)
    root = tmp_path_factory.mktemp("serve")
    windows = root / "windows.json"
    windows.write_text(json.dumps({"window": 64, "windows": [[(7 * i + j) % 500 + 1 for j in range(64)]
                                                             for i in range(4)]}))
    return arm, windows


def _serve(tmp_path: Path, arm: Path, windows: Path, engine: dict, **serve) -> dict:
    return serve_study([ServedArm("vllm-1", engine, "t-0000000000", "t", arm, tmp_path / "cache")],
                       {**SERVE, **serve}, {"allow_busy": True}, windows=windows, out=tmp_path / "serve.json",
                       server_logs=tmp_path / "servers", threads=2, model_weights_sha256=SHA,
                       control_tolerance=TOLERANCES)


@pytest.mark.slow
def test_vllm_serves_the_4bit_arm_through_the_plugin_and_names_a_level_it_cannot_hold(
        served_checkpoint, tmp_path):
    arm, windows = served_checkpoint
    # 512 KiB of KV cache: vLLM counts 96 tokens in it, two requests of 32 + 16 tokens
    # (its log: "Maximum concurrency for 48 tokens per request: 2.00x"); four do not fit.
    record = _serve(tmp_path, arm, windows, {**VLLM, "kv_cache_gib": 2**19 / 2**30},
                    concurrency=[1, 2, 4])
    [served] = record["served"]
    assert served["status"] == "measured" and "fourbit_int4 plugin" in served["runtime"]
    assert "compiled" in served["runtime"]  # served as deployed (bench.vllm_compiled's default)
    assert "--enforce-eager" not in served["command"]
    log = Path(tmp_path / "servers" / "vllm-1.t-0000000000.log").read_text()
    assert "quantization=fourbit_int4" in log  # the plugin's method, in the server process
    assert "Maximum concurrency for 48 tokens per request: 2.00x" in log
    one, two, four = served["levels"]
    for level in (one, two):
        assert level["status"] == "measured" and len(level["passes"]) == 3
        assert all(p["completed"] == 4 and p["output_tok_s"] > 0 for p in level["passes"])
        assert level["summary"]["tpot_ms_p99"]["min"] <= level["summary"]["tpot_ms_p99"]["max"]
    assert four["status"] == "over_capacity" and "2 requests of 48 tokens" in four["reason"], four
    assert json.loads((tmp_path / "serve.json").read_text()) == json.loads(json.dumps(record))


@pytest.mark.slow
def test_a_real_server_serves_the_arm_as_the_first_preferred_variant_this_host_runs(served_checkpoint, tmp_path):
    """The bfloat16 build where the CPU has avx512_bf16 (or AMX), else the float32 one of the
    same kernel: the server runs the variant's dtype and kernel, not the arm as scored."""
    arm, windows = served_checkpoint
    preferred = ["vllm bfloat16 w4a8_group", "vllm float32 w4a8_group"]
    runnable = {row["name"]: row for row in vllm_runtimes(isa_flags()) if row["available"]}
    expected = runnable[next(name for name in preferred if name in runnable)]
    record = _serve(tmp_path, arm, windows, VLLM, concurrency=[1, 2], runtime=preferred)
    [served] = record["served"]
    assert served["status"] == "measured" and served["runtime_choice"]["variant"] == expected["name"]
    assert f"{expected['dtype']} compiled" in served["runtime"] and "W4A8_GROUP" in served["runtime"]
    assert served["command"][served["command"].index("--dtype") + 1] == expected["dtype"]
    assert (tmp_path / "cache" / expected["name"].replace(" ", "-")).is_dir()  # its own compiled graph
    assert all(level["status"] == "measured" and all(p["completed"] == 4 for p in level["passes"])
               for level in served["levels"])


@pytest.mark.slow
def test_a_server_killed_mid_level_fails_the_job_with_its_log_and_leaves_nothing(
        served_checkpoint, tmp_path):
    arm, windows = served_checkpoint
    log = tmp_path / "servers" / "vllm-1.t-0000000000.log"
    with pytest.raises(ServerError) as error, killed_at_first_request(log, arm):
        _serve(tmp_path, arm, windows, VLLM)
    message = str(error.value)
    assert "exited with status -9 while in use" in message
    assert "command: " in message and "vllm.entrypoints.openai.api_server" in message
    assert "last lines of" in message and "POST /v1/completions" in message  # its log tail
    assert not (tmp_path / "serve.json").exists()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".serve.json")]
    assert no_server_left(arm)  # the engine core and its worker too


@contextlib.contextmanager
def killed_at_first_request(log: Path, model: Path):
    """SIGKILL the API server serving ``model`` once its ``log`` shows the first completion
    request (a level, or a task's generation, has started), from a thread, while the block
    runs; fails the test if that never happened."""
    killed = []

    def kill_when_serving():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not done.is_set():
            if log.exists() and "POST /v1/completions" in log.read_text(errors="replace"):
                pid = _server_pid(model)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    done = threading.Event()
    killer = threading.Thread(target=kill_when_serving, daemon=True)
    killer.start()
    try:
        yield
    finally:  # asserted here, so that it also fails a block that raised for another reason
        done.set()
        killer.join(timeout=10)
        assert killed, "the server never received a request"


def no_server_left(model: Path, timeout_s: float = 30) -> bool:
    """Whether every process serving ``model`` is gone within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _server_pids(model) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _server_pids(model) == []


def _server_pids(model: Path) -> list[int]:
    """The processes serving ``model``: the API server (its command line names the model)
    and the processes of its group (vLLM's engine core and worker)."""
    leaders = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(model) in cmdline.read_bytes().decode(errors="replace"):
                leaders.append(int(cmdline.parent.name))
        except OSError:
            continue
    groups = {os.getpgid(pid) for pid in leaders if Path(f"/proc/{pid}").exists()} if leaders else set()
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and (int(fields[2]) in groups or int(stat.parent.name) in leaders):
            members.append(int(stat.parent.name))
    return sorted(members)


def _server_pid(model: Path) -> int:
    """The API server's pid: the leader of its process group."""
    return next(pid for pid in _server_pids(model) if os.getpgid(pid) == pid)
