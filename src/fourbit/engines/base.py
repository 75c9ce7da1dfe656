"""The engine interface: what every engine class implements, and the capabilities its
EngineSpec (fourbit.engines.ENGINES) may declare, each an abstract class of its own.

Modelled on vLLM's QuantizationConfig (layers/quantization/base_config.py): the abstract
methods are the contract, so a reader, a type checker and ``isinstance`` all see which
methods an engine has. A capability is an Engine that also does one thing more, so an
engine narrowed to it (``capable``) keeps score_windows, runtime and numerics:

    Engine             every engine: score_windows (the ppl step), runtime, numerics
    TimesPasses        Bench.PER_PASS: throughput, one pass in an engine started for it
    TimesInSession     Bench.SESSION: that, and throughput_session, one engine kept open
                       for the whole bench job
    ComparesPositions  Fidelity.PER_POSITION: compare_with_baseline
    KeepsSides         Fidelity.KEPT_SIDES: score_keeping_side (in the ppl step of each
                       compared checkpoint, the baseline's first), then compare_sides,
                       which starts no engine

The steps that call them define the numbers: fourbit.steps.evaluate (scores),
fourbit.steps.bench (rates), fourbit.steps.fidelity (per-position results). Nothing here imports torch, vllm or transformers: the workflow reads
the engine table at DAG time, and an engine class loads them when it runs.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, TypedDict, TypeVar

# The engine's settings as the workflow passes them: {"name": .., **its engines.<name>
# block, filled from the schema}, plus "cache_root" where the step chose a cache folder.
Settings = dict[str, Any]
TokenIds = list[list[int]]  # one list of token ids per window (or greedy prompt)
# What a forward rounds beyond the dense expansion: the control's tolerance class
# (evaluation.control_tolerance in the schema).
Numerics = Literal["exact", "bf16_activations", "int8_activations"]
Rates = dict[str, float]  # {"pp<prompt>_tok_s": .., "tg<decode>_tok_s": ..}, tokens per second
# Per-position results of an arm against its baseline: "method", "window_kl",
# "window_top1", "greedy_baseline", "greedy_arm", ... (fourbit.steps.fidelity lists them).
PerPosition = dict[str, Any]
Side = Mapping[str, Any]  # one checkpoint's kept side, plain JSON data (KeepsSides)


class WindowScore(TypedDict):
    """One window's score (fourbit.steps.evaluate defines it)."""

    nll_sum: float  # -sum of log p(token_t | tokens_<t) over positions 1..W-1
    tokens: int  # positions scored: W-1


class Engine(abc.ABC):
    """Scores checkpoints of the kind its spec ``reads`` and says what runs them."""

    @abc.abstractmethod
    def score_windows(self, checkpoint: Path, windows: TokenIds, settings: Settings,
                      threads: int) -> list[WindowScore]:
        """Each window's score, in order, every window scored on its own."""

    @abc.abstractmethod
    def runtime(self, checkpoint: Path, settings: Settings) -> str:
        """What actually executes the weights of ``checkpoint``, for the records."""

    @abc.abstractmethod
    def numerics(self, checkpoint: Path, settings: Settings, rows: int) -> Numerics:
        """What a forward of ``rows`` rows rounds beyond the dense expansion."""

    def runtime_variant(self, checkpoint: Path, settings: Settings) -> str | None:
        """For an engine with several ways to run a 4-bit checkpoint on a CPU: the name of
        the one it runs (fourbit.bench.hostprobe.VLLM_RUNTIMES), which the report checks
        off against the host's candidates; None for one way only, or a dense checkpoint."""
        return None


class TimesPasses(Engine):
    """Bench.PER_PASS: the bench step starts the engine for every timed pass."""

    @abc.abstractmethod
    def throughput(self, checkpoint: Path, settings: Settings, threads: int, *,
                   prompt_tokens: int, decode_tokens: int) -> Rates:
        """One timed pass (a prompt of ``prompt_tokens``, then ``decode_tokens`` after a
        one-token prompt) in an engine started for it."""


class TimesInSession(TimesPasses):
    """Bench.SESSION: the bench step holds one engine per checkpoint open for the job."""

    @abc.abstractmethod
    def throughput_session(self, checkpoint: Path, settings: Settings, threads: int, *,
                           prompt_tokens: int, decode_tokens: int,
                           ) -> AbstractContextManager[Callable[[], Rates]]:
        """An engine open while the context lasts, yielding a function that times one pass
        in it (the rates throughput returns)."""


class ComparesPositions(Engine):
    """Fidelity.PER_POSITION: the fidelity step runs both checkpoints on the windows."""

    @abc.abstractmethod
    def compare_with_baseline(self, arm_checkpoint: Path, baseline_checkpoint: Path,
                              windows: TokenIds, settings: Settings, threads: int, *,
                              prompts: TokenIds, new_tokens: int) -> PerPosition:
        """Per-position results on ``windows``, greedy continuations of ``prompts``, and
        "runtime" and "baseline_runtime"."""


class KeepsSides(Engine):
    """Fidelity.KEPT_SIDES: the ppl job of each compared checkpoint keeps its side in the
    same engine pass, the baseline's first, since an arm's side is computed against what
    the baseline's kept; the fidelity step compares two sides without an engine."""

    @abc.abstractmethod
    def score_keeping_side(self, checkpoint: Path, windows: TokenIds, settings: Settings,
                           threads: int, *, compared: int, prompts: TokenIds, new_tokens: int,
                           baseline_logits: Path, baseline: Side | None,
                           ) -> tuple[list[WindowScore], dict[str, Any]]:
        """What score_windows returns, and the checkpoint's side: the greedy continuations
        of ``prompts`` and, over its first ``compared`` windows, with ``baseline`` None
        (the checkpoint is the baseline) its logits written to ``baseline_logits``, else
        (an arm, ``baseline`` the baseline's side) its per-position results against the
        baseline's logits read from there."""

    @abc.abstractmethod
    def compare_sides(self, arm: Side, baseline: Side, windows: TokenIds) -> PerPosition:
        """Per-position results of the arm's side against the baseline's (no runtimes)."""


E = TypeVar("E", bound=Engine)


def capable(engine: Engine, capability: type[E]) -> E:
    """``engine`` as ``capability``, which its EngineSpec declares: for a type checker the
    narrowing, at run time an error naming what its class lacks."""
    if not isinstance(engine, capability):
        raise TypeError(f"{type(engine).__name__} is not a {capability.__name__} "
                        f"(fourbit.engines.base), which its EngineSpec declares")
    return engine
