"""Which server runs each engine's arms: one entry per engine that has one (extension by
registration). An engine without a server (the reference: transformers, not a deployment
engine) is not served, and the serve record says so."""

from __future__ import annotations

from fourbit.serving.llamacpp_server import LlamaServer
from fourbit.serving.vllm_server import VllmServer

SERVERS = {
    "vllm": VllmServer(plugin=True),
    "vllm_native": VllmServer(plugin=False),
    "llamacpp": LlamaServer(),
}
