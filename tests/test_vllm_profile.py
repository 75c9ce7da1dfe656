"""benchmarks/vllm_profile.py's step breakdown: what it wraps exists in the installed vLLM,
and its timers count, time and put every method back (on a plain class; the benchmark
itself runs the real engine)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from vllm_profile import STEP_PARTS, _timed_methods  # noqa: E402


@pytest.mark.parametrize(("module", "owner", "method", "label"), STEP_PARTS,
                         ids=[f"{owner}.{method}" for _, owner, method, _ in STEP_PARTS])
def test_every_timed_part_is_a_method_of_the_installed_vllm(module, owner, method, label):
    pytest.importorskip("vllm")
    cls = getattr(importlib.import_module(module), owner)
    assert callable(getattr(cls, method)), f"{module}.{owner}.{method} ({label.strip()})"


def test_the_cpu_model_runner_inherits_the_runner_methods_it_times():
    pytest.importorskip("vllm")
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for _, owner, method, _ in STEP_PARTS:
        if owner == "GPUModelRunner":
            assert getattr(CPUModelRunner, method) is getattr(GPUModelRunner, method), method


class Base:
    def inherited(self, x):
        return x + 1


class Step(Base):
    def own(self, x):
        return x * 2


def test_timed_methods_count_each_call_and_put_every_method_back():
    parts = [(__name__, "Step", "own", "own"), (__name__, "Step", "inherited", "inherited"),
             (__name__, "Missing", "own", "missing class"),
             ("no_such_module_here", "Step", "own", "missing module")]
    totals = {label: 0.0 for *_, label in parts}
    calls = {label: 0 for *_, label in parts}
    own = Step.__dict__["own"]
    with _timed_methods(parts, totals, calls):
        step = Step()
        assert (step.own(3), step.own(4), step.inherited(1)) == (6, 8, 2)
    assert calls == {"own": 2, "inherited": 1, "missing class": 0, "missing module": 0}
    assert totals["own"] > 0 and totals["inherited"] > 0
    assert totals["missing class"] != totals["missing class"]  # nan: not measured
    assert totals["missing module"] != totals["missing module"]
    assert Step.__dict__["own"] is own
    assert "inherited" not in Step.__dict__  # the wrapper is gone, Base's method shows again


def test_timed_methods_put_the_methods_back_when_the_block_fails():
    totals, calls = {"own": 0.0}, {"own": 0}
    own = Step.__dict__["own"]
    with pytest.raises(RuntimeError), _timed_methods([(__name__, "Step", "own", "own")],
                                                      totals, calls):
        raise RuntimeError("the engine failed")
    assert Step.__dict__["own"] is own
