"""Engines score checkpoints; each is one class, registered once in ENGINES.

Every engine's class implements fourbit.engines.base.Engine (score_windows, runtime,
numerics: the ppl step, fourbit.steps.evaluate, and every record's "runtime"), and
the capability each way its EngineSpec says it takes part asks of it (CAPABILITY):

    bench (fourbit.steps.bench)
        Bench.PER_PASS          TimesPasses: throughput, one pass in an engine started
                                for it
        Bench.SESSION           TimesInSession: that, and throughput_session, one engine
                                kept open for the whole job
        NotBenchmarked(reason)  nothing; the record says why its speed means nothing
                                for a build
    fidelity (fourbit.steps.fidelity, which defines the results)
        Fidelity.PER_POSITION   ComparesPositions: compare_with_baseline, per-position
                                results on the study's windows
        Fidelity.KEPT_SIDES     KeepsSides: score_keeping_side in the ppl step of each
                                checkpoint the fidelity step compares (the baseline's
                                first, then each arm as quantized against what the
                                baseline's kept), then compare_sides, without an engine
        Fidelity.NOT_COMPARED   nothing; the record says it was not computed

get_engine(name) returns an instance of the class, checked to implement them all; a
step narrows it to the capability it calls with fourbit.engines.base.capable. The
engine's name is written here alone: what the rest of fourbit asks of an engine by
name (which checkpoints it reads, whether vLLM's registry must list the model, ...)
is a field of its EngineSpec.

Adding an engine: its class implementing Engine and the capabilities it declares (one
module here, delegating to the functions that do the work), one EngineSpec in ENGINES
naming that class, and its settings block in the schema
(src/fourbit/schemas/config.schema.yaml).
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from fourbit.engines.base import (
    ComparesPositions,
    Engine,
    KeepsSides,
    TimesInSession,
    TimesPasses,
)
from fourbit.engines.limits import prompt_exceeds_positions


class Bench(enum.Enum):
    """How fourbit.steps.bench times an engine (its capability: CAPABILITY)."""

    PER_PASS = "an engine started for each timed pass"
    SESSION = "one engine per checkpoint held open for the whole job"


@dataclass(frozen=True)
class NotBenchmarked:
    """An engine that is not timed; ``reason`` goes into its bench record."""

    reason: str


class Fidelity(enum.Enum):
    """How fourbit.steps.fidelity compares an arm with its engine's baseline (its
    capability: CAPABILITY)."""

    PER_POSITION = "both checkpoints run on the windows in the fidelity job"
    KEPT_SIDES = "sides kept by the ppl jobs, compared without an engine"
    NOT_COMPARED = "not compared"


# What each way of taking part asks of the engine's class (fourbit.engines.base).
CAPABILITY: dict[Bench | Fidelity, type[Engine]] = {
    Bench.PER_PASS: TimesPasses,
    Bench.SESSION: TimesInSession,
    Fidelity.PER_POSITION: ComparesPositions,
    Fidelity.KEPT_SIDES: KeepsSides,
    Fidelity.NOT_COMPARED: Engine,
}


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

    # "module:Class", the class implementing fourbit.engines.base's interface; imported on
    # first use, so that a study without vLLM never loads it
    implementation: str
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
    # vLLM loads the model: the config checks, before any job, that vLLM's registry lists
    # its architecture (fourbit.inputs.supported.check_vllm).
    needs_vllm_registry: bool = False
    # It cannot serve an arm some of whose linears the arm's fallback kept dense: vLLM's
    # own GPTQ loader expects every linear of a GPTQ checkpoint quantized (fourbit writes
    # no modules_in_block_to_quantize), while fourbit's plugin reads what is quantized
    # from the safetensors themselves.
    needs_every_linear_quantized: bool = False
    # It compiles its model at start when its settings' enforce_eager is false (vLLM): the
    # bench and the serve step run it compiled, as it is deployed, unless the study's
    # bench.vllm_compiled is false (deployed_settings).
    compiles: bool = False

    def deployed_settings(self, settings: dict, vllm_compiled: bool) -> dict:
        """The settings this engine is timed and served with: the ones it scores with,
        except that an engine that compiles (vLLM) runs compiled, as vLLM does by default
        and as it is deployed, unless ``vllm_compiled`` (the study's bench.vllm_compiled) is
        false. Scoring stays as configured (enforce_eager, eager by default: an arm and its
        dense expansion then run the same eager ops, and the control's tolerance holds)."""
        if not self.compiles:
            return dict(settings)
        return {**settings, "enforce_eager": settings["enforce_eager"] and not vllm_compiled}

    @property
    def keeps_fidelity_side(self) -> bool:
        """Whether its ppl job of a compared checkpoint also writes that checkpoint's
        fidelity side (the workflow declares it as an output of that job)."""
        return self.fidelity is Fidelity.KEPT_SIDES

    @property
    def capabilities(self) -> tuple[type[Engine], ...]:
        """What its class must be an instance of, for the way it takes part."""
        bench = () if isinstance(self.bench, NotBenchmarked) else (CAPABILITY[self.bench],)
        return (Engine, *bench, CAPABILITY[self.fidelity])

    def load(self) -> type[Engine]:
        """Its class, its module imported now."""
        module, _, name = self.implementation.partition(":")
        return getattr(importlib.import_module(module), name)


def _symmetric_gptq(quant: dict) -> bool:
    # Written as a standard GPTQ checkpoint (fourbit.quantizers.methods), which vLLM reads itself;
    # a matrix in fourbit's 8-bit layout (quantize_head 8, quantize_embedding 8, mixed_precision)
    # or a 4-bit table in cpu_int4's (quantize_embedding true) is not part of it.
    return (quant["method"] == "gptq" and quant.get("sym") is True and quant["quantize_head"] != 8
            and "quantize_embedding" not in quant and "mixed_precision" not in quant)


def _gptq_either_grid(quant: dict) -> bool:
    # Symmetric arms are written as standard GPTQ checkpoints, asymmetric ones as
    # compressed-tensors with zero points (fourbit.quantizers.methods); vLLM reads both.
    return _symmetric_gptq({**quant, "sym": True})


def _vllm_native_w4a8_kernel_missing() -> str | None:
    from fourbit.engines.vllm_native_w4a8 import kernel_missing  # when asked, not with the table

    return kernel_missing()


def _vllm_native_kernel_missing() -> str | None:
    from fourbit.engines.vllm_native import kernel_missing  # when asked, not with the table

    return kernel_missing()


ENGINES: dict[str, EngineSpec] = {
    "reference": EngineSpec(
        "fourbit.engines.reference:ReferenceEngine", reads="hf",
        fidelity=Fidelity.PER_POSITION,
        bench=NotBenchmarked(
            "not a deployment engine; not benchmarked: transformers is the scoring reference, "
            "and nobody ships a model on it, so its speed says nothing about a 4-bit build"
        ),
    ),
    "vllm": EngineSpec("fourbit.engines.vllm:VllmEngine", reads="hf", bench=Bench.SESSION,
                       fidelity=Fidelity.KEPT_SIDES, bench_refusal=prompt_exceeds_positions,
                       needs_vllm_registry=True, compiles=True),
    "vllm_native": EngineSpec("fourbit.engines.vllm_native:VllmNativeEngine", reads="hf",
                              bench=Bench.SESSION, fidelity=Fidelity.KEPT_SIDES,
                              runs_arm=_symmetric_gptq, host_check=_vllm_native_kernel_missing,
                              bench_refusal=prompt_exceeds_positions, needs_vllm_registry=True,
                              needs_every_linear_quantized=True, compiles=True),
    "vllm_native_w4a8": EngineSpec("fourbit.engines.vllm_native_w4a8:VllmNativeW4a8Engine",
                                   reads="hf", bench=Bench.SESSION, fidelity=Fidelity.KEPT_SIDES,
                                   runs_arm=_gptq_either_grid,
                                   host_check=_vllm_native_w4a8_kernel_missing,
                                   bench_refusal=prompt_exceeds_positions,
                                   needs_vllm_registry=True, needs_every_linear_quantized=True,
                                   compiles=True),
    "llamacpp": EngineSpec("fourbit.engines.llamacpp:LlamaCppEngine", reads="gguf",
                           bench=Bench.PER_PASS, fidelity=Fidelity.PER_POSITION),
}


def engine_spec(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise ValueError(f"engine {name!r} is not known; allowed: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]


def get_engine(name: str) -> Engine:
    """An instance of the engine's class, checked to implement what its spec declares."""
    spec = engine_spec(name)
    engine = spec.load()()
    lacking = [c.__name__ for c in spec.capabilities if not isinstance(engine, c)]
    if lacking:
        raise TypeError(f"engine {name!r}: {spec.implementation} is not a {', '.join(lacking)} "
                        "(fourbit.engines.base), which its EngineSpec declares")
    return engine


def unavailable_here(engine: str) -> str | None:
    """Why ``engine`` cannot run on this host (the one building the workflow's DAG), or None."""
    return engine_spec(engine).host_check()
