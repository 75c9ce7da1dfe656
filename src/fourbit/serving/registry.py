"""Which server runs each engine's arms: one entry per engine that has one (extension by
registration). An engine without a server (the reference: transformers, not a deployment
engine) is not served, and the serve record says so."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fourbit.serving.llamacpp_server import LlamaServer
from fourbit.serving.process import free_port
from fourbit.serving.vllm_server import ServeCommand, VllmServer

log = logging.getLogger("fourbit")

SERVERS = {
    "vllm": VllmServer(plugin=True),
    "vllm_native": VllmServer(plugin=False),
    "vllm_native_w4a8": VllmServer(plugin=False, w4a8_amx=True),
    "llamacpp": LlamaServer(),
}


@dataclass(frozen=True)
class Launch:
    """What starts one checkpoint's server: its kind, a free port, the command."""

    kind: Any  # a SERVERS entry
    port: int
    command: ServeCommand


def launch(key: str, engine: dict, model: Path, *, served_name: str, slots: int,
           tokens_per_request: int, cores: list[int], cache_root: Path | None,
           llamacpp_server: Path | None) -> Launch:
    """The server of ``engine`` (its settings, with "name") on ``model`` for ``slots``
    requests of ``tokens_per_request`` tokens at once, on a free port; ``key`` names it in
    the log and in errors."""
    if engine["name"] not in SERVERS:
        raise ValueError(f"{key}: engine {engine['name']!r} has no server; the engines with one "
                         f"are {sorted(SERVERS)}")
    kind = SERVERS[engine["name"]]
    port = free_port()
    command = kind.command(model, engine, port, served_name=served_name, slots=slots,
                           tokens_per_request=tokens_per_request, cores=cores,
                           cache_root=cache_root, llamacpp_server=llamacpp_server)
    log.info("%s: starting %s", key, " ".join(command.argv))
    return Launch(kind, port, command)
