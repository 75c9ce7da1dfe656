"""fourbit.serving: the servers' command lines, the port check, a server's start and stop
(its whole process group), and the load generator's arithmetic.

The lifecycle tests start a real process tree (a small HTTP server that starts a child of
its own), not a mock: what they check is that no process of the group outlives the
context, which only real processes can show. The real vLLM and llama-server are served end
to end by the workflow tier (tests/test_workflow.py) and the step test below."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fourbit.serving.llamacpp_server import LlamaServer
from fourbit.serving.llamacpp_server import serve_command as llamacpp_command
from fourbit.serving.load import LoadError, Request, _carries_token, level_figures
from fourbit.serving.process import (
    PortInUse,
    ServerError,
    free_port,
    group_alive,
    require_port_free,
    running_server,
)
from fourbit.serving.registry import launch
from fourbit.serving.vllm_server import VllmServer, kv_cache_capacity
from fourbit.serving.vllm_server import serve_command as vllm_command
from fourbit.serving.workload import prompts_from_windows

VLLM_SETTINGS = {"dtype": "float32", "enforce_eager": True, "kv_cache_gib": 0.5,
                 "max_num_seqs": 1, "quant": {}}


def _checkpoint(folder: Path, quant_method: str | None) -> Path:
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 128}
    if quant_method:
        config["quantization_config"] = {"quant_method": quant_method, "bits": 4,
                                         "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_command_serves_a_4bit_arm_through_the_plugin_with_the_engine_settings(tmp_path):
    arm = _checkpoint(tmp_path / "arm", "fourbit_int4")
    command = vllm_command({**VLLM_SETTINGS, "cache_root": tmp_path / "cache"}, arm, 8123,
                           served_name="int4", max_num_seqs=16, max_model_len=96, cores=[0, 1])
    argv = command.argv
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _option(argv, "--model") == str(arm) and _option(argv, "--port") == "8123"
    assert _option(argv, "--host") == "127.0.0.1"
    assert _option(argv, "--max-num-seqs") == "16"  # the largest level, not the scoring's 1
    assert _option(argv, "--max-model-len") == "96"
    assert _option(argv, "--kv-cache-memory-bytes") == str(int(0.5 * 2**30))
    assert _option(argv, "--dtype") == "float32"
    assert _option(argv, "--quantization") == "fourbit_int4"
    assert "--enforce-eager" in argv and "--no-enable-prefix-caching" in argv
    # lifecycle's environment, plus the cores
    env = command.env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1" and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_CACHE_ROOT"] == str((tmp_path / "cache" / "vllm").absolute())
    assert len(env["VLLM_RPC_BASE_PATH"]) + len("/0123abcd-0123-0123-0123-0123456789ab") < 107


def test_vllm_command_of_a_dense_baseline_compiled(tmp_path):
    baseline = _checkpoint(tmp_path / "baseline", None)
    argv = vllm_command({**VLLM_SETTINGS, "enforce_eager": False, "quant": {"dequant_threshold": 8}},
                        baseline, 8124, served_name="baseline", max_num_seqs=4,
                        max_model_len=64, cores=[0]).argv
    assert "--enforce-eager" not in argv  # compiled, as the engine block says
    assert "--quantization" not in argv and "--hf-overrides" not in argv  # dense: no plugin knobs


def test_vllms_own_w4a8_amx_engine_is_served_with_that_kernel_on_and_the_others_with_it_off(
        tmp_path):
    """The server registry's vllm_native_w4a8 entry sets what the in-process engine sets."""
    arm = _checkpoint(tmp_path / "arm", "gptq")
    native = {k: v for k, v in VLLM_SETTINGS.items() if k != "quant"}
    for name, flag in (("vllm_native_w4a8", "1"), ("vllm_native", "0")):
        start = launch(f"{name}/arm", {"name": name, **native, "dtype": "bfloat16"}, arm,
                       served_name="a", slots=2, tokens_per_request=64, cores=[0],
                       cache_root=tmp_path / name, llamacpp_server=None)
        assert start.command.env["VLLM_CPU_INT4_W4A8"] == flag, name
        assert start.kind.engine_name == name
    with pytest.raises(ValueError, match="engine 'reference' has no server"):
        launch("reference/arm", {"name": "reference"}, arm, served_name="a", slots=1,
               tokens_per_request=64, cores=[0], cache_root=None, llamacpp_server=None)


def test_vllm_command_passes_the_plugin_knobs_of_a_quantized_arm(tmp_path):
    arm = _checkpoint(tmp_path / "arm", "fourbit_int4")
    argv = vllm_command({**VLLM_SETTINGS, "quant": {"dequant_threshold": 8}}, arm, 8125,
                        served_name="a", max_num_seqs=2, max_model_len=64, cores=[0]).argv
    overrides = json.loads(_option(argv, "--hf-overrides"))
    assert overrides["quantization_config"]["dequant_threshold"] == 8
    assert overrides["quantization_config"]["quant_method"] == "fourbit_int4"


def test_vllm_over_capacity_is_the_servers_own_count(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("(EngineCore pid=1) INFO [kv_cache_utils.py:2327] CPU KV cache size: 1,024 "
                   "tokens, Maximum concurrency for 96 tokens per request: 8.00x\n")
    assert kv_cache_capacity(log) == (1024, 8.0)
    server = VllmServer(plugin=True)
    assert server.over_capacity(log, 8, 96) is None
    reason = server.over_capacity(log, 16, 96)
    assert "1024 tokens, 8 requests of 96 tokens" in reason and "kv_cache_gib" in reason


def test_llamacpp_command_gives_each_user_a_slot_of_the_whole_request(tmp_path):
    argv = llamacpp_command(Path("/opt/llama-server"), tmp_path / "model.gguf", 8126,
                            served_name="q4_k_m", slots=16, tokens_per_slot=96, threads=2).argv
    assert argv[0] == "/opt/llama-server"
    assert _option(argv, "--parallel") == "16" and _option(argv, "--ctx-size") == str(16 * 96)
    assert _option(argv, "--threads") == "2" and _option(argv, "--threads-batch") == "2"
    assert "--cont-batching" in argv and "--no-cache-prompt" in argv
    assert _option(argv, "--cache-ram") == "0"
    with pytest.raises(ValueError, match="at least 1"):
        llamacpp_command(Path("/opt/llama-server"), tmp_path / "m.gguf", 1, served_name="x",
                         slots=0, tokens_per_slot=96, threads=2)


def test_llamacpp_refusal_is_the_servers_own_line(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("main: loading model\nllama_model_load: error loading model: bad magic\n")
    assert "error loading model: bad magic" in LlamaServer().refusal(log)
    log.write_text("main: server is listening\n")
    assert LlamaServer().refusal(log) is None


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse, match=f"port {port}"):
            require_port_free(port)
        with pytest.raises(PortInUse):
            with running_server("x", [sys.executable, "-c", "raise SystemExit(9)"], {}, port,
                                tmp_path / "x.log"):
                pass
        assert not (tmp_path / "x.log").exists()  # nothing was started
    require_port_free(free_port())


# A server whose /health answers 200 after a short delay and which starts a child of its
# own (as vLLM's API server starts its engine core).
FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    time.sleep(0.5)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


def _fake_server(tmp_path: Path, port: int) -> list[str]:
    script = tmp_path / "server.py"
    script.write_text(FAKE_SERVER)
    return [sys.executable, str(script), str(port)]


def test_a_server_and_its_children_are_stopped_on_success_and_failure(tmp_path):
    for failing in (False, True):
        port = free_port()
        log = tmp_path / f"server-{failing}.log"
        with pytest.raises(RuntimeError) if failing else _nothing():
            with running_server("fake", _fake_server(tmp_path, port), {}, port, log,
                                startup_timeout_s=30) as server:
                assert server.startup_s > 0
                pgid = server.pgid
                child = int(log.read_text().split()[1])
                assert group_alive(pgid) and Path(f"/proc/{child}").exists()
                if failing:
                    raise RuntimeError("the job failed")
        assert not group_alive(pgid)  # the server and its child alike


def test_a_server_that_exits_at_start_fails_with_its_command_and_log(tmp_path):
    command = [sys.executable, "-c", "print('cannot load the model'); raise SystemExit(3)"]
    with pytest.raises(ServerError) as error:
        with running_server("dying", command, {}, free_port(), tmp_path / "d.log"):
            pass
    message = str(error.value)
    assert "exited with status 3" in message and "cannot load the model" in message
    assert "raise SystemExit(3)" in message  # the command line


def test_a_server_killed_while_in_use_is_named(tmp_path):
    port = free_port()
    with running_server("fake", _fake_server(tmp_path, port), {}, port, tmp_path / "k.log",
                        startup_timeout_s=30) as server:
        server.process.kill()
        server.process.wait()
        with pytest.raises(ServerError, match="exited with status -9 while in use"):
            server.check_alive()
        pgid = server.pgid
    deadline = time.monotonic() + 5
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pgid)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _request(tokens: int, error: str | None = None) -> Request:
    # first token after 0.1 s, then one every 0.01 s
    return Request(arrivals=[0.1 + 0.01 * k for k in range(tokens)], output_tokens=tokens,
                   error=error)


def test_level_figures_from_each_requests_token_arrivals():
    figures = level_figures([_request(32) for _ in range(4)], 2.0, output_tokens=32)
    assert figures["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert figures["tpot_ms"]["p99"] == pytest.approx(10.0)  # (e2e - ttft) / 31
    assert figures["itl_ms"]["p50"] == pytest.approx(10.0)
    assert figures["e2e_ms"]["p50"] == pytest.approx(410.0)
    assert figures["output_tok_s"] == pytest.approx(64.0) and figures["requests_per_s"] == 2.0


def test_a_level_whose_requests_stop_early_or_fail_is_refused():
    with pytest.raises(LoadError, match="not 32"):
        level_figures([_request(32), _request(7)], 1.0, output_tokens=32)
    uncounted = _request(32)
    uncounted.output_tokens = None  # no usage sent
    with pytest.raises(LoadError, match="not 32"):
        level_figures([uncounted], 1.0, output_tokens=32)
    with pytest.raises(LoadError, match="1 of 2 requests failed.*reset"):
        level_figures([_request(32), _request(0, error="connection reset")], 1.0, output_tokens=32)


def test_a_token_chunk_of_either_server():
    vllm_token = {"choices": [{"text": " the", "finish_reason": None}]}
    vllm_usage = {"choices": [], "usage": {"completion_tokens": 32}}
    llama_last = {"choices": [{"text": "", "finish_reason": "length"}],
                  "usage": {"completion_tokens": 32}}
    last_token = {"choices": [{"text": " end", "finish_reason": "length"}]}
    assert _carries_token(vllm_token) and _carries_token(last_token)
    assert not _carries_token(vllm_usage) and not _carries_token(llama_last)


def test_prompts_are_the_first_tokens_of_the_evaluation_windows(tmp_path):
    windows = tmp_path / "windows.json"
    windows.write_text(json.dumps({"window": 8, "windows": [list(range(8)), list(range(10, 18))]}))
    assert prompts_from_windows(windows, prompt_tokens=3, requests=3) == [
        [0, 1, 2], [10, 11, 12], [0, 1, 2]]
    with pytest.raises(ValueError, match="at most 8"):
        prompts_from_windows(windows, prompt_tokens=9, requests=1)


def test_a_job_killed_outright_takes_its_server_and_its_children_with_it(tmp_path):
    """SIGKILL runs no ``finally``: the kernel signals the group's guard, which ends the
    server and what the server started (fourbit.serving.guard)."""
    port = free_port()
    log = tmp_path / "job.log"
    job = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from fourbit.serving.process import running_server
        with running_server("fake", {_fake_server(tmp_path, port)!r}, {{}}, {port},
                            Path({str(log)!r}), startup_timeout_s=30) as server:
            print(server.pgid, flush=True)
            time.sleep(600)
    """)
    import os
    import signal
    import subprocess

    process = subprocess.Popen([sys.executable, "-c", job], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pgid = int(process.stdout.readline())
    child = int(log.read_text().split()[1])  # the fake server's own child
    assert group_alive(pgid) and Path(f"/proc/{child}").exists()
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 20
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pgid)  # the guard, the server and the server's child
