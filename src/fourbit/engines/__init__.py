"""Engines score checkpoints; each is one module registered by name.

An engine module provides:

    score_windows(checkpoint: Path, windows: list[list[int]], settings: dict, threads: int)
        -> list[{"nll_sum": float, "tokens": int}]   (see fourbit.steps.evaluate for the definition)
    runtime(checkpoint: Path, settings: dict) -> str  (what actually executes the weights)

and, for the bench step (fourbit.steps.bench), either
    throughput(checkpoint, settings, threads, *, prompt_tokens, decode_tokens) -> one pass's rates
    (optionally also throughput_session(...) with the same arguments: a context manager
    yielding a function that times one pass in an engine kept open for the whole job)
or a module-level NOT_BENCHMARKED = "<why its speed means nothing for a shipped build>";
and, for the fidelity step (fourbit.steps.fidelity), optionally compare_with_baseline(...)
(per-position results on the study's windows) or divergence_from_baseline(...) (the
engine's own aggregate KL statistics on the evaluation text).

Adding an engine: a new module here, one line in ENGINE_MODULES, and its
settings block in workflow/schemas/config.schema.yaml.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# name -> module; imported lazily so that a study without vLLM never loads it.
ENGINE_MODULES = {
    "reference": "fourbit.engines.reference",
    "vllm": "fourbit.engines.vllm",
    "vllm_native": "fourbit.engines.vllm_native",
    "llamacpp": "fourbit.engines.llamacpp",
}

# What kind of checkpoint each engine reads: Hugging Face folders or GGUF files.
# Kept here, free of heavy imports, because the workflow needs it to build the DAG.
ENGINE_READS = {"reference": "hf", "vllm": "hf", "vllm_native": "hf", "llamacpp": "gguf"}


def _symmetric_gptq(quant: dict) -> bool:
    # Written as a standard GPTQ checkpoint (fourbit.quant.methods), which vLLM reads itself.
    return quant["method"] == "gptq" and quant.get("sym") is True


def _vllm_native_kernel_here() -> str | None:
    from fourbit.bench.hostprobe import choose_runtimes, isa_flags

    verdict = choose_runtimes(isa_flags())["vllm_native_w4a16"]
    return None if verdict["available"] else verdict["reason"]


# Engines that run only some arms of the kind they read: name -> does it run this quant?
ENGINE_RUNS_ARM = {"vllm_native": _symmetric_gptq}
# Engines that need something of the host: name -> () -> why it cannot run here, or None.
ENGINE_HOST_CHECKS = {"vllm_native": _vllm_native_kernel_here}


def unavailable_here(engine: str) -> str | None:
    """Why ``engine`` cannot run on this host (the one building the workflow's DAG), or None."""
    check = ENGINE_HOST_CHECKS.get(engine)
    return check() if check else None


def get_engine(name: str) -> ModuleType:
    if name not in ENGINE_MODULES:
        raise ValueError(f"engine {name!r} is not known; allowed: {', '.join(sorted(ENGINE_MODULES))}")
    return importlib.import_module(ENGINE_MODULES[name])
