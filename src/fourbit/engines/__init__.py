"""Engines score checkpoints; each is one module, registered once in ENGINES.

Every engine module provides

    score_windows(checkpoint: Path, windows: list[list[int]], settings: dict, threads: int)
        -> list[{"nll_sum": float, "tokens": int}]   (see fourbit.steps.evaluate for the definition)
    runtime(checkpoint: Path, settings: dict) -> str  (what actually executes the weights)
    numerics(checkpoint: Path, settings: dict, rows: int) -> "exact" | "bf16_activations"
        | "int8_activations"  (what a forward of that many rows rounds beyond the dense
        expansion: the control's tolerance, evaluation.control_tolerance in the schema)

and what its EngineSpec declares, for the bench step (fourbit.steps.bench):

    Bench.PER_PASS   throughput(checkpoint, settings, threads, *, prompt_tokens,
                     decode_tokens) -> one pass's rates, in an engine started for it
    Bench.SESSION    that, and throughput_session(same arguments): a context manager
                     yielding a function that times one pass in an engine kept open
                     for the whole job
    NotBenchmarked   nothing; the record says why its speed means nothing for a build

and for the fidelity step (fourbit.steps.fidelity, which defines the arguments):

    Fidelity.PER_POSITION   compare_with_baseline(...): per-position results on the
                            study's windows
    Fidelity.KEPT_SIDES     score_keeping_side(...) in the ppl step of each checkpoint the
                            fidelity step compares (the baseline, an arm as quantized),
                            then compare_sides(...): per-position results from the two
                            sides, without an engine
    Fidelity.OWN_KL_MODE    divergence_from_baseline(...): the engine's own aggregate KL
                            statistics on the evaluation text; greedy_continuations(...)
    Fidelity.NOT_COMPARED   nothing; the record says it was not computed

Adding an engine: its module here, one EngineSpec in ENGINES, and its settings block
in the schema (src/fourbit/schemas/config.schema.yaml).
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from fourbit.engines.limits import prompt_exceeds_positions


class Bench(enum.Enum):
    """How fourbit.steps.bench times an engine: the module function it calls."""

    PER_PASS = "throughput"
    SESSION = "throughput_session"


@dataclass(frozen=True)
class NotBenchmarked:
    """An engine that is not timed; ``reason`` goes into its bench record."""

    reason: str


class Fidelity(enum.Enum):
    """How fourbit.steps.fidelity compares an arm with its engine's baseline."""

    PER_POSITION = "compare_with_baseline"
    KEPT_SIDES = "compare_sides"
    OWN_KL_MODE = "divergence_from_baseline"
    NOT_COMPARED = "not compared"


def _every_arm(quant: dict) -> bool:
    return True


def _any_host() -> str | None:
    return None


def _times_any_model(model_config: dict, prompt_tokens: int) -> str | None:
    return None



@dataclass(frozen=True)
class EngineSpec:
    """Everything the rest of fourbit asks of one engine (STYLE.md 19).

    Kept free of heavy imports: the workflow reads it to build the DAG.
    """

    module: str  # imported on first use, so that a study without vLLM never loads it
    reads: str  # the checkpoints it scores: "hf" (Hugging Face folders) or "gguf" (GGUF files)
    bench: Bench | NotBenchmarked  # how the bench step times it
    fidelity: Fidelity  # how the fidelity step compares an arm with its baseline
    # Of the arms of the kind it reads, those it runs (by the arm's quant); most run all.
    runs_arm: Callable[[dict], bool] = _every_arm
    # Why it cannot run on this host, or None; most need nothing of the host.
    host_check: Callable[[], str | None] = _any_host
    # Why it cannot time this model (its config.json, the bench's prompt tokens), or None:
    # checked before any job, so the bench records the reason instead of failing the study.
    bench_refusal: Callable[[dict, int], str | None] = _times_any_model

    @property
    def keeps_fidelity_side(self) -> bool:
        """Whether its ppl job of a compared checkpoint also writes that checkpoint's
        fidelity side (the workflow declares it as an output of that job)."""
        return self.fidelity is Fidelity.KEPT_SIDES


def _symmetric_gptq(quant: dict) -> bool:
    # Written as a standard GPTQ checkpoint (fourbit.quantizers.methods), which vLLM reads itself;
    # a matrix in fourbit's 8-bit layout (quantize_head or quantize_embedding 8, mixed_precision)
    # is not part of it.
    return (quant["method"] == "gptq" and quant.get("sym") is True and quant["quantize_head"] != 8
            and "quantize_embedding" not in quant and "mixed_precision" not in quant)


def _vllm_native_kernel_missing() -> str | None:
    from fourbit.engines.vllm_native import kernel_missing  # when asked, not with the table

    return kernel_missing()


ENGINES: dict[str, EngineSpec] = {
    "reference": EngineSpec(
        "fourbit.engines.reference", reads="hf", fidelity=Fidelity.PER_POSITION,
        bench=NotBenchmarked(
            "not a deployment engine; not benchmarked: transformers is the scoring reference, "
            "and nobody ships a model on it, so its speed says nothing about a 4-bit build"
        ),
    ),
    "vllm": EngineSpec("fourbit.engines.vllm", reads="hf", bench=Bench.SESSION,
                       fidelity=Fidelity.KEPT_SIDES, bench_refusal=prompt_exceeds_positions),
    "vllm_native": EngineSpec("fourbit.engines.vllm_native", reads="hf", bench=Bench.SESSION,
                              fidelity=Fidelity.KEPT_SIDES, runs_arm=_symmetric_gptq,
                              host_check=_vllm_native_kernel_missing,
                              bench_refusal=prompt_exceeds_positions),
    "llamacpp": EngineSpec("fourbit.engines.llamacpp", reads="gguf", bench=Bench.PER_PASS,
                           fidelity=Fidelity.OWN_KL_MODE),
}


def engine_spec(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise ValueError(f"engine {name!r} is not known; allowed: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]


def get_engine(name: str) -> ModuleType:
    return importlib.import_module(engine_spec(name).module)


def unavailable_here(engine: str) -> str | None:
    """Why ``engine`` cannot run on this host (the one building the workflow's DAG), or None."""
    return engine_spec(engine).host_check()
