"""fourbit.engines: the one engine table, and every class implementing what its spec declares."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fourbit.engines import (
    ENGINES,
    Bench,
    EngineSpec,
    Fidelity,
    NotBenchmarked,
    engine_spec,
    get_engine,
    unavailable_here,
)
from fourbit.engines import base

# What the bench and fidelity steps call, per declaration (fourbit.engines' docstring).
CAPABILITIES = {
    Bench.PER_PASS: [base.TimesPasses],
    Bench.SESSION: [base.TimesPasses, base.TimesInSession],
    Fidelity.PER_POSITION: [base.ComparesPositions],
    Fidelity.KEPT_SIDES: [base.KeepsSides],
    Fidelity.NOT_COMPARED: [],
}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_class_implements_what_its_spec_declares(name):
    spec = engine_spec(name)
    engine = get_engine(name)
    bench = [] if isinstance(spec.bench, NotBenchmarked) else CAPABILITIES[spec.bench]
    for capability in [base.Engine, *bench, *CAPABILITIES[spec.fidelity]]:
        assert isinstance(engine, capability), (spec.implementation, capability.__name__)
    assert spec.reads in ("hf", "gguf")
    reason = unavailable_here(name)
    assert reason is None or isinstance(reason, str)


def test_the_classes_the_specs_name():
    assert {name: type(get_engine(name)).__name__ for name in ENGINES} == {
        "reference": "ReferenceEngine", "vllm": "VllmEngine", "vllm_native": "VllmNativeEngine",
        "vllm_native_w4a8": "VllmNativeW4a8Engine", "llamacpp": "LlamaCppEngine"}


def test_a_class_lacking_a_declared_capability_is_refused(monkeypatch):
    """get_engine checks the class against its spec; capable narrows, or names what is lacking."""
    monkeypatch.setitem(ENGINES, "half", EngineSpec("fourbit.engines.reference:ReferenceEngine",
                                                    reads="hf", bench=Bench.PER_PASS,
                                                    fidelity=Fidelity.PER_POSITION))
    with pytest.raises(TypeError, match="ReferenceEngine is not a TimesPasses"):
        get_engine("half")
    reference = get_engine("reference")
    assert base.capable(reference, base.ComparesPositions) is reference
    with pytest.raises(TypeError, match="ReferenceEngine is not a KeepsSides"):
        base.capable(reference, base.KeepsSides)


def test_an_abstract_method_left_out_is_an_error_at_instantiation():
    class Unfinished(base.TimesPasses):
        def score_windows(self, checkpoint, windows, settings, threads):
            return []

        def runtime(self, checkpoint, settings):
            return ""

        def numerics(self, checkpoint, settings, rows):
            return "exact"

    with pytest.raises(TypeError, match="throughput"):
        Unfinished()


def test_the_table_and_the_vllm_classes_load_neither_vllm_nor_torch():
    """The workflow reads the table at DAG time; vLLM and torch load when an engine opens."""
    script = ("import sys; from fourbit.engines import get_engine; import fourbit.config; "
              "get_engine('vllm'); get_engine('vllm_native'); get_engine('vllm_native_w4a8'); "
              "print(sorted({'vllm', 'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_what_the_config_asks_of_an_engine_by_name_is_in_its_spec():
    assert [n for n, s in ENGINES.items() if s.needs_vllm_registry] == [
        "vllm", "vllm_native", "vllm_native_w4a8"]
    assert [n for n, s in ENGINES.items() if s.needs_every_linear_quantized] == [
        "vllm_native", "vllm_native_w4a8"]
    assert [n for n, s in ENGINES.items() if s.compiles] == ["vllm", "vllm_native", "vllm_native_w4a8"]
    assert [n for n, s in ENGINES.items() if s.reads == "gguf"] == ["llamacpp"]


def test_vllm_native_runs_only_symmetric_gptq_arms():
    native = {"method": "gptq", "sym": True, "quantize_head": True}
    runs = engine_spec("vllm_native").runs_arm
    assert runs(native) and not runs({**native, "sym": False})
    assert not runs({**native, "quantize_head": 8})  # fourbit's 8-bit layout is not GPTQ
    assert engine_spec("vllm").runs_arm({"method": "rtn"})


def test_an_unknown_engine_names_the_known_ones():
    with pytest.raises(ValueError, match="engine 'vlm' is not known; allowed: llamacpp, reference"):
        engine_spec("vlm")


def test_vllm_native_w4a8_runs_both_gptq_grids_with_vllms_w4a8_amx_kernel_and_int8_numerics(
        tmp_path):
    """Its settings allow vLLM's W4A8 AMX kernel, its controls are int8_activations, and it
    runs asymmetric GPTQ arms (compressed-tensors) as well as symmetric ones. The kernel
    itself needs AMX (amx_tile, amx_int8), which a host without it cannot exercise: there
    the engine is refused with the host probe's reason."""
    import json

    from fourbit.bench.hostprobe import choose_runtimes
    from fourbit.cpuinfo import isa_flags
    from fourbit.engines.vllm import VllmSettings, numerics, runtime_variant

    runs = ENGINES["vllm_native_w4a8"].runs_arm
    gptq = {"method": "gptq", "quantize_head": True}
    assert runs({**gptq, "sym": True}) and runs({**gptq, "sym": False})
    assert not runs({**gptq, "sym": False, "quantize_embedding": 8})
    assert not ENGINES["vllm_native"].runs_arm({**gptq, "sym": False})

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "compressed-tensors"}}))
    engine = get_engine("vllm_native_w4a8")
    given = {
        "dtype": "bfloat16", "enforce_eager": True, "kv_cache_gib": 1, "max_num_seqs": 1}
    settings = engine.settings_to_describe(given)
    assert isinstance(settings, VllmSettings) and settings.w4a8_amx and not settings.plugin
    assert numerics(checkpoint, settings, 1) == numerics(checkpoint, settings, 512) == "int8_activations"
    assert runtime_variant(checkpoint, settings) == "vllm_native_w4a8 bfloat16 int4_scaled_mm_cpu"
    assert "int4_scaled_mm_cpu, W4A8 on AMX int8 tiles" in engine.runtime(checkpoint, given)
    native = get_engine("vllm_native").settings_to_describe(given)
    assert not native.w4a8_amx and numerics(checkpoint, native, 1) == "bf16_activations"

    verdict = choose_runtimes(isa_flags(), {"VLLM_CPU_INT4_W4A8": "1"})["vllm_native_w4a8_amx"]
    assert unavailable_here("vllm_native_w4a8") == (None if verdict["available"] else verdict["reason"])
    if not verdict["available"]:
        with pytest.raises(RuntimeError, match="W4A8 AMX kernel cannot run on this node"):
            engine.settings_to_run(given, checkpoint)
