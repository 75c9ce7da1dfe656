"""Where a vLLM decode step's time goes, for benchmarks that miss a target; not a test.

profile_step: torch.profiler's table of one step (ops by self CPU time). step_breakdown:
the wall clock of a whole greedy decode split among vLLM's own step parts (scheduler,
input preparation, sampling, output processing), the model's forward (its attention
layers apart) and the head, so vLLM's per-step cost outside the model is a measured
number rather than the remainder of an op table.

Imported by benchmarks/vllm_speed.py (and any benchmark beside it: python puts this
folder on sys.path when it runs a script here).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fourbit.engines.vllm.throughput import synthetic_prompt
from fourbit.engines.vllm.lifecycle import llm_options, open_llm
from fourbit.engines.vllm.settings import VllmSettings, resolve
from fourbit.threads import torch_threads


def _prompt(checkpoint: str | os.PathLike, length: int) -> list[int]:
    """The benchmarks' synthetic token ids, within the checkpoint's vocabulary."""
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    return synthetic_prompt(length, vocab)


def profile_step(checkpoint: str | os.PathLike, settings: Mapping[str, Any] | VllmSettings,
                 what: str, threads: int, rows: int = 15, batch: int = 1) -> str:
    """torch.profiler's table (top ops by self CPU time) of one decode step (``batch``
    sequences of a 1-token prompt, 2 outputs each: two ``batch``-row forwards, the first a
    1-token prefill of each; batch > 1 is a step of a server holding that many users) or
    of one 512-token prefill, after an untimed first call.

    ``settings``: the vllm engine's, as the workflow passes them (fourbit's plugin), or a
    VllmSettings (VllmSettings.from_engine(settings, plugin=False) for vLLM's own kernel).
    """
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if what not in ("decode", "prefill"):
        raise ValueError(f"what={what!r}; profile 'decode' or 'prefill'")
    settings = resolve(settings)
    ids = _prompt(checkpoint, 512)
    if what == "prefill" and batch != 1:
        raise ValueError("a prefill is profiled for one sequence (batch=1)")
    # decode: a different 1-token prompt per sequence, so no two share a cached prefix
    prompts, outputs = ([ids[i:i + 1] for i in range(batch)], 2) if what == "decode" else ([ids], 1)
    params = SamplingParams(max_tokens=outputs, temperature=0.0, ignore_eos=True, detokenize=False)
    options = {**llm_options(settings, checkpoint), "max_num_seqs": batch}
    with (torch_threads(threads),
          open_llm(checkpoint, max_model_len=513, max_num_batched_tokens=512, **options) as llm):
        def run():
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

        run()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# The parts step_breakdown times, as (module, class, method, label). Nested parts are
# inside the ones above them: the engine's step holds the scheduler's calls, execute_model
# and sampling (its own call after execute_model); execute_model holds the input
# preparation, the model's forward and the head; the forward holds the CPU attention
# backend's calls (its Python and C++ kernels; vLLM's custom-op wrappers around them,
# unified_attention_with_output and unified_kv_cache_update, count in the forward's
# remainder). The engine core runs inside LLMEngine.step, and the CPU model runner is
# GPUModelRunner's subclass, because fourbit.engines.vllm.lifecycle opens vLLM in-process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0) on the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0).
STEP_PARTS = (
    ("vllm.v1.engine.llm_engine", "LLMEngine", "step", "engine step (all of it)"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "  scheduler: schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output",
     "  scheduler: update from output"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs",
     "  output processing"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "  execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs",
     "    input preparation"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward",
     "    model forward (compiled graph or eager modules)"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "forward",
     "      attention backend (every layer)"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "do_kv_cache_update",
     "      attention backend's KV cache writes (every layer)"),
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor", "forward",
     "    head (logits)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "  sampling"),
)


def _timer(original, label: str, totals: dict[str, float], calls: dict[str, int]):
    """``original`` adding each call's wall seconds to totals[label]."""
    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start
            calls[label] += 1

    return timed


@contextlib.contextmanager
def _timed_methods(parts, totals: dict[str, float], calls: dict[str, int]):
    """Each (module, class, method, label) of ``parts`` timed into totals[label] inside the
    block and put back as it was on exit (an inherited method by removing the wrapper); a
    part this vLLM lacks is reported as nan."""
    saved = []
    try:
        for module, owner, method, label in parts:
            try:
                cls = getattr(importlib.import_module(module), owner, None)
            except ImportError:
                cls = None
            original = getattr(cls, method, None) if cls is not None else None
            if original is None:
                totals[label] = float("nan")
                continue
            saved.append((cls, method, cls.__dict__.get(method)))
            setattr(cls, method, _timer(original, label, totals, calls))
        yield
    finally:
        for cls, method, own in reversed(saved):
            if own is None:
                delattr(cls, method)
            else:
                setattr(cls, method, own)


def step_breakdown(checkpoint: str | os.PathLike, settings: Mapping[str, Any] | VllmSettings,
                   threads: int, decode_tokens: int = 128, runs: int = 5) -> str:
    """Milliseconds per token of each STEP_PARTS part over ``runs`` greedy decodes of
    ``decode_tokens`` + 1 tokens from a 1-token prompt (batch 1, after two untimed ones),
    with the wall clock of the whole decode beside them. Wrapping costs about a microsecond
    a call, a few per token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    settings = resolve(settings)
    prompt = TokensPrompt(prompt_token_ids=_prompt(checkpoint, 1))
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    totals: dict[str, float] = {label: 0.0 for *_, label in STEP_PARTS}
    calls: dict[str, int] = {label: 0 for *_, label in STEP_PARTS}
    options = llm_options(settings, checkpoint)
    with (torch_threads(threads),
          open_llm(checkpoint, max_model_len=decode_tokens + 2, **options) as llm):
        def run():
            llm.generate([prompt], params, use_tqdm=False)

        run()
        run()
        with _timed_methods(STEP_PARTS, totals, calls):
            start = time.perf_counter()
            for _ in range(runs):
                run()
            wall = time.perf_counter() - start
    tokens = runs * (decode_tokens + 1)
    width = max(len(label) for label in totals)
    lines = [f"{'part':{width}s} {'ms/token':>9s} {'share':>6s} {'calls/token':>11s}",
             f"{'wall clock of the decodes':{width}s} {wall / tokens * 1e3:9.3f} {1:6.0%}"]
    for label, seconds in totals.items():
        lines.append(f"{label:{width}s} {seconds / tokens * 1e3:9.3f} {seconds / wall:6.0%} "
                     f"{calls[label] / tokens:11.2f}")
    return "\n".join(lines)
