"""Engines score checkpoints; each is one module registered by name.

An engine module provides:

    score_windows(checkpoint: Path, windows: list[list[int]], settings: dict, threads: int)
        -> list[{"nll_sum": float, "tokens": int}]   (see fourbit.ppl for the definition)
    runtime(checkpoint: Path, settings: dict) -> str  (what actually executes the weights)

and, for the bench step (fourbit.benchmark), either
    throughput(checkpoint, settings, threads, *, prompt_tokens, decode_tokens) -> one pass's rates
or a module-level NOT_BENCHMARKED = "<why its speed means nothing for a shipped build>";
and, for the fidelity step (fourbit.fidelity), optionally compare_with_baseline(...)
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
    "llamacpp": "fourbit.engines.llamacpp",
}

# What kind of checkpoint each engine reads: Hugging Face folders or GGUF files.
# Kept here, free of heavy imports, because the workflow needs it to build the DAG.
ENGINE_READS = {"reference": "hf", "vllm": "hf", "llamacpp": "gguf"}


def get_engine(name: str) -> ModuleType:
    if name not in ENGINE_MODULES:
        raise ValueError(f"engine {name!r} is not known; allowed: {', '.join(sorted(ENGINE_MODULES))}")
    return importlib.import_module(ENGINE_MODULES[name])
