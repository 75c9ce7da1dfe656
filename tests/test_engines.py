"""fourbit.engines: the one engine table, and every module offering what its spec declares."""

from __future__ import annotations

import pytest

from fourbit.engines import (
    ENGINES,
    Bench,
    Fidelity,
    NotBenchmarked,
    engine_spec,
    get_engine,
    unavailable_here,
)

# What the bench, fidelity and ppl steps call, per declaration (fourbit.engines' docstring).
CALLED = {
    Bench.PER_PASS: ["throughput"],
    Bench.SESSION: ["throughput", "throughput_session"],
    Fidelity.PER_POSITION: ["compare_with_baseline"],
    Fidelity.KEPT_SIDES: ["score_keeping_side", "compare_sides"],
    Fidelity.OWN_KL_MODE: ["divergence_from_baseline", "greedy_continuations"],
    Fidelity.NOT_COMPARED: [],
}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_module_has_what_its_spec_declares(name):
    spec = engine_spec(name)
    engine = get_engine(name)
    bench = [] if isinstance(spec.bench, NotBenchmarked) else CALLED[spec.bench]
    for function in ["score_windows", "runtime", "numerics", *bench, *CALLED[spec.fidelity]]:
        assert callable(getattr(engine, function, None)), f"{spec.module} lacks {function}()"
    assert spec.reads in ("hf", "gguf")
    reason = unavailable_here(name)
    assert reason is None or isinstance(reason, str)


def test_vllm_native_runs_only_symmetric_gptq_arms():
    native = {"method": "gptq", "sym": True, "quantize_head": True}
    runs = engine_spec("vllm_native").runs_arm
    assert runs(native) and not runs({**native, "sym": False})
    assert not runs({**native, "quantize_head": 8})  # fourbit's 8-bit layout is not GPTQ
    assert engine_spec("vllm").runs_arm({"method": "rtn"})


def test_an_unknown_engine_names_the_known_ones():
    with pytest.raises(ValueError, match="engine 'vlm' is not known; allowed: llamacpp, reference"):
        engine_spec("vlm")
