"""vLLM running 4-bit checkpoints on its own CPU kernel, without fourbit's plugin.

vLLM's GPTQ and compressed-tensors W4A16 methods call ``cpu_gemm_wna16`` on the
CPU, which only the AVX-512 builds of vLLM's ops library contain
(fourbit.bench.hostprobe); elsewhere the first forward fails. Where it exists, this
engine gives each symmetric GPTQ arm (a standard GPTQ checkpoint; fourbit.engines.
ENGINE_RUNS_ARM) a row of its own, next to the same arm through the plugin; on
other hosts the workflow does not schedule it and the report says why
(fourbit.engines.ENGINE_HOST_CHECKS). Everything else is the vllm engine's, with the
same settings except the dtype (vLLM's GPTQ method refuses float32), so its dense
baseline and controls run exactly as there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fourbit.engines import vllm

_NATIVE = {"kernel": "native"}


def _native(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {**settings, **_NATIVE}


def score_windows(checkpoint, windows, settings, threads):
    return vllm.score_windows(checkpoint, windows, _native(settings), threads)


def runtime(checkpoint, settings):
    return vllm.runtime(checkpoint, _native(settings))


def throughput(checkpoint, settings, threads, **kwargs):
    return vllm.throughput(checkpoint, _native(settings), threads, **kwargs)


def compare_with_baseline(arm_checkpoint, baseline_checkpoint, windows, settings, threads, **kwargs):
    return vllm.compare_with_baseline(arm_checkpoint, baseline_checkpoint, windows,
                                      _native(settings), threads, **kwargs)
