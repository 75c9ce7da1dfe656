"""vLLM running 4-bit checkpoints on its own W4A8 AMX kernel, without fourbit's plugin.

vLLM's GPTQ and compressed-tensors W4A16 methods switch a bfloat16 layer to
``int4_scaled_mm_cpu`` (activations rounded to int8, AMX int8 tiles) when
VLLM_CPU_INT4_W4A8 is on and the CPU has AMX (fourbit.bench.hostprobe says where in
vLLM). The vllm_native engine turns that off, so its rows mean cpu_gemm_wna16 on every
host; this engine turns it on, and so runs the GPTQ arms, symmetric (standard GPTQ
checkpoints) and asymmetric (compressed-tensors, whose zero points vLLM takes into the
same kernel), as rows of their own, in bfloat16. Rounding the activations to int8 makes
its controls int8_activations (fourbit.engines.vllm.lifecycle.numerics).

Only CPUs with amx_tile, amx_int8 and avx512_bf16 have the kernel; elsewhere the workflow
does not schedule the engine and the report gives the host probe's reason, and a job
sent to such a node stops before vLLM would silently run another kernel. Its kernel
cannot be exercised on a host without AMX; the choice is tested for every kind of host
with recorded flag sets (tests/test_hostprobe.py).
"""

from __future__ import annotations

import platform
from pathlib import Path

from fourbit.engines import vllm
from fourbit.engines.base import Settings
from fourbit.engines.vllm_native import VllmNativeEngine

# The probe's environment for this engine: it sets VLLM_CPU_INT4_W4A8=1 itself (lifecycle).
_ENGINE_ENV = {"VLLM_CPU_INT4_W4A8": "1"}


def kernel_missing() -> str | None:
    """Why vLLM's W4A8 AMX kernel cannot run on this host, or None."""
    from fourbit.bench.hostprobe import choose_runtimes
    from fourbit.cpuinfo import isa_flags

    verdict = choose_runtimes(isa_flags(), _ENGINE_ENV)["vllm_native_w4a8_amx"]
    return None if verdict["available"] else verdict["reason"]


def _w4a8(settings: Settings) -> vllm.VllmSettings:
    return vllm.VllmSettings.from_engine(settings, plugin=False, w4a8_amx=True)


class VllmNativeW4a8Engine(VllmNativeEngine):
    """The vllm_native engine with vLLM's W4A8 AMX kernel allowed: every call gets
    settings with ``w4a8_amx``; one that opens an engine on a 4-bit checkpoint first
    checks this node has the kernel."""

    def settings_to_describe(self, settings: Settings) -> vllm.VllmSettings:
        return _w4a8(settings)

    def settings_to_run(self, settings: Settings, checkpoint: Path) -> vllm.VllmSettings:
        reason = vllm.checkpoint_quant_method(checkpoint) and kernel_missing()
        if reason:
            raise RuntimeError(
                f"vLLM's W4A8 AMX kernel cannot run on this node ({platform.node()}): {reason}; "
                "send vllm_native_w4a8 jobs to AMX nodes (the profile's constraint) or drop the "
                "engine")
        return _w4a8(settings)
