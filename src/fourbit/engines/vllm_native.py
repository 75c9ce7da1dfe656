"""vLLM running 4-bit checkpoints on its own CPU kernel, without fourbit's plugin.

vLLM's GPTQ and compressed-tensors W4A16 methods call ``cpu_gemm_wna16`` on the
CPU, which only the AVX-512 builds of vLLM's ops library contain
(fourbit.bench.hostprobe); elsewhere the first forward fails. Where it exists, this
engine gives each symmetric GPTQ arm (a standard GPTQ checkpoint; its EngineSpec's
runs_arm in fourbit.engines.ENGINES) a row of its own, next to the same arm through
the plugin; on other hosts the workflow does not schedule it and the report says why
(kernel_missing, the spec's host check; jobs check again on the node that runs them).
Everything else is the vllm engine's (VllmNativeEngine is a VllmEngine whose functions
get vLLM's kernel in their settings), with the same settings except the dtype (vLLM's
GPTQ method refuses float32), so its dense baseline and controls run exactly as there.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fourbit.engines import vllm
from fourbit.engines.base import Settings


def kernel_missing() -> str | None:
    """Why vLLM's native W4A16 kernel cannot run on this host, or None."""
    from fourbit.bench.hostprobe import choose_runtimes
    from fourbit.cpuinfo import isa_flags

    verdict = choose_runtimes(isa_flags())["vllm_native_w4a16"]
    return None if verdict["available"] else verdict["reason"]


def _native(settings: Mapping[str, Any], checkpoint) -> vllm.VllmSettings:
    """The vllm engine's settings with vLLM's own kernel chosen, for a job that runs
    ``checkpoint``. The workflow decides on the host that builds the DAG whether to
    schedule this engine; a job sent to a node without the kernel (a cluster with mixed
    CPUs) stops here, saying so, instead of failing inside vLLM's first forward."""
    reason = vllm.checkpoint_quant_method(checkpoint) and kernel_missing()
    if reason:
        raise RuntimeError(
            f"vLLM's native 4-bit kernel cannot run on this node ({platform.node()}): {reason}; "
            "send vllm_native jobs to AVX-512 nodes (the profile's constraint) or drop the engine"
        )
    return vllm.VllmSettings.from_engine(settings, plugin=False)


class VllmNativeEngine(vllm.VllmEngine):
    """The vllm engine with vLLM's own kernel chosen: every call gets the settings of
    ``_native`` (one that opens an engine also checks this node has the kernel)."""

    def settings_to_describe(self, settings: Settings) -> vllm.VllmSettings:
        return vllm.VllmSettings.from_engine(settings, plugin=False)

    def settings_to_run(self, settings: Settings, checkpoint: Path) -> vllm.VllmSettings:
        return _native(settings, checkpoint)
