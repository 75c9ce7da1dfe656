"""llama-server on one GGUF, from the same cached llama.cpp build as the study's other tools.

One slot per concurrent user of the largest level (``-np``), continuous batching on, and a
context of slots × (prompt + output tokens): llama-server splits its context evenly among
the slots, so each slot holds exactly one request of the workload and no level queues on
a lack of KV cache. The threads are the study's llama.cpp threads (engines.llamacpp),
for prompt and batch alike, on the cores the serve job is pinned to (a child inherits its
affinity). The prompt cache is off in both its forms (a slot's previous prompt, and the
RAM cache of idle slots), as vLLM's prefix cache is: every pass sends the same prompts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fourbit.serving.vllm_server import ServeCommand

HEALTH_PATH = "/health"  # 503 while the model loads, 200 once it serves


def serve_command(server: Path, gguf: str | os.PathLike, port: int, *, served_name: str,
                  slots: int, tokens_per_slot: int, threads: int, seed: int = 0) -> ServeCommand:
    """The command that serves ``gguf`` with ``server`` (the cached build's llama-server) on
    ``port``: ``slots`` requests of up to ``tokens_per_slot`` tokens at once."""
    if slots < 1 or tokens_per_slot < 1 or threads < 1:
        raise ValueError(f"slots={slots}, tokens_per_slot={tokens_per_slot}, threads={threads}: "
                         "each must be at least 1")
    argv = [
        str(server),
        "--model", str(gguf),
        "--alias", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(slots),
        "--ctx-size", str(slots * tokens_per_slot),
        "--cont-batching",
        "--threads", str(threads), "--threads-batch", str(threads),
        "--no-cache-prompt", "--cache-ram", "0",
        "--seed", str(seed),
        "--no-webui",
    ]
    return ServeCommand(argv, dict(os.environ))


# llama-server's words when it cannot load a model (tools/server/server.cpp, src/llama.cpp).
_LOAD_FAILURES = ("failed to load model", "error loading model")


@dataclass(frozen=True)
class LlamaServer:
    """How the serve step runs llama-server."""

    label: str = "llama-server"
    health_path: str = HEALTH_PATH
    # Off per request too: llama-server's prompt cache is also a request field.
    extra_body: tuple = (("cache_prompt", False),)

    def command(self, model: Path, engine: Mapping[str, Any], port: int, *, served_name: str,
                slots: int, tokens_per_request: int, llamacpp_server: Path | None,
                **_) -> ServeCommand:
        if llamacpp_server is None:
            raise ValueError(f"{model}: llama-server is needed, but no llama.cpp build was given")
        return serve_command(llamacpp_server, model, port, served_name=served_name, slots=slots,
                             tokens_per_slot=tokens_per_request, threads=int(engine["threads"]))

    def over_capacity(self, log_path: Path, concurrency: int, tokens_per_request: int) -> str | None:
        return None  # one slot of tokens_per_request per user of the largest level, by construction

    def refusal(self, log_path: Path) -> str | None:
        """The line where llama-server says it cannot load the GGUF, or None."""
        lines = Path(log_path).read_text(errors="replace").splitlines()
        found = [line.strip() for line in lines if any(w in line for w in _LOAD_FAILURES)]
        return f"llama-server cannot load this GGUF: {found[0]}" if found else None

    def model_files_read_while_serving(self) -> bool:
        return True  # llama-server maps the GGUF and reads it as it computes
