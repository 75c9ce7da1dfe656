"""The report's serving part (fourbit.report.serving): the serve step's record read and
checked, the Serving section, the recommendation per concurrency level, the two plots.

The records are real JSON files of the serve step's shape, written here by hand with
made-up figures: what is tested is how the report reads and renders them."""

import json

import pytest
from test_report import WEIGHTS, results, run_report, study  # noqa: F401  (a fixture)

from fourbit.report.loading import ReportInputError
from fourbit.report.plots import Point, pareto_front, plot_serving
from fourbit.report.serving import (
    one_user_against_bench,
    read_serving,
    serving_section,
    serving_verdicts,
)

VLLM = "vllm-1111111111"
LLAMACPP = "llamacpp-2222222222"
BOUND = 100
SERVING_PLOTS = {"serving_throughput": "serving-throughput.png", "serving_pareto": "serving-pareto.png"}


def spread(median, width):
    return {"median": median, "min": median - width, "max": median + width}


def level(n, tok_s, tpot_p99, *, width=1.0, passes=3):
    """A timed level: output tok/s and TPOT p99 with their spread over ``passes``; the other
    measures derived from them, so each figure in the table is recognisable."""
    summary = {"output_tok_s": spread(tok_s, width), "requests_per_s": spread(tok_s / 128, 0.01),
               "ttft_ms_p50": spread(20.0 * n, 2), "ttft_ms_p99": spread(40.0 * n, 4),
               "tpot_ms_p50": spread(tpot_p99 / 2, 1), "tpot_ms_p99": spread(tpot_p99, 2)}
    each = {"output_tok_s": tok_s, "requests_per_s": tok_s / 128, "ttft_ms": {"p50": 20.0 * n, "p99": 40.0 * n},
            "tpot_ms": {"p50": tpot_p99 / 2, "p99": tpot_p99}, "itl_ms": {"p50": 1, "p99": 2},
            "e2e_ms": {"p50": 3, "p99": 4}, "completed": 32, "failed": 0}
    return {"concurrency": n, "status": "measured", "passes": [each] * passes, "summary": summary}


def over_capacity(n):
    return {"concurrency": n, "status": "over_capacity",
            "reason": f"KV cache holds 6 sequences of 384 tokens, not {n}"}


def served(arm, engine_id, levels, *, arm_name=None):
    engine = engine_id.partition("-")[0]
    return {"engine_id": engine_id, "engine": engine, "arm": arm, "arm_name": arm_name or arm.partition("-")[0],
            "status": "measured", "command": [f"{engine}-server", "--model", arm], "runtime": f"{engine} runtime",
            "startup_s": 12.5, "levels": levels}


def refused(arm, engine_id, reason):
    return {"engine_id": engine_id, "engine": engine_id.partition("-")[0], "arm": arm,
            "arm_name": arm.partition("-")[0], "status": "refused", "reason": reason}


def serve_record(path, entries, *, concurrency=(1, 8), weights=WEIGHTS):
    """Write a serve.json of the serve step's shape to ``path``; its path."""
    path.write_text(json.dumps({
        "measured": True, "model_weights_sha256": weights, "job": {"started": "2026-12-05T03:00:00Z"},
        "provenance": {"cpu_model": "test cpu"}, "contention": [],
        "workload": {"source": "evaluation split token ids", "prompt_tokens": 256, "output_tokens": 128,
                     "requests_per_level": 32, "warmup_requests": 4, "passes": 3, "seed": 0},
        "concurrency": list(concurrency), "tpot_bound_ms": BOUND,
        "load_generator": "vllm.benchmarks.serve (vllm 0.32.0)", "served": entries}))
    return path


def study_served(tmp_path):
    """A study's serve record: a vLLM arm and its baseline, a llama.cpp arm over capacity at
    8 users, and a llama.cpp arm the server refused."""
    return serve_record(tmp_path / "serve.json", [
        served("baseline", VLLM, [level(1, 20.0, 45.0), level(8, 90.0, 85.0)]),
        served("int4-aaaaaaaaaa", VLLM, [level(1, 30.0, 33.0), level(8, 150.0, 60.0)]),
        served("q4_k_m-bbbbbbbbbb", LLAMACPP, [level(1, 25.0, 40.0), over_capacity(8)]),
        refused("iq4_xs-cccccccccc", LLAMACPP, "llama-server cannot load this GGUF: unknown type"),
    ])


def serving_report(tmp_path, tiny_untied, results, record):  # noqa: F811
    records, manifest = results
    paths = {"quality_vs_bits": tmp_path / "bits.png", "quality_vs_decode": tmp_path / "decode.png",
             "frontier": tmp_path / "frontier.png", **{k: tmp_path / v for k, v in SERVING_PLOTS.items()}}
    return run_report(tmp_path, study(), records, [manifest], tiny_untied, plot_paths=paths,
                      serve_record=record)


def test_the_serving_section_states_the_workload_and_a_table_per_level(tmp_path, tiny_untied, results):  # noqa: F811
    markdown = serving_report(tmp_path, tiny_untied, results, study_served(tmp_path))
    section = markdown.split("## Serving\n", 1)[1].split("\n## ", 1)[0]
    assert ("One load generator, vllm.benchmarks.serve (vllm 0.32.0), drove every server with the same "
            "workload: 32 requests per concurrency level, each a 256-token prompt (evaluation split token "
            "ids) and exactly 128 output tokens (EOS ignored), after 4 warm-up requests; 3 passes") in section
    assert f"- `int4-aaaaaaaaaa` on {VLLM} (vllm): vllm runtime; answering after 12.5 s; " \
           "`vllm-server --model int4-aaaaaaaaaa`" in section
    assert (f"- **Not served: `iq4_xs-cccccccccc` on {LLAMACPP}** (llamacpp): llama-server cannot load "
            "this GGUF: unknown type.") in section
    one, eight = section.split("### 1 concurrent user\n", 1)[1].split("### 8 concurrent users\n")
    assert (f"| {VLLM} | `int4-aaaaaaaaaa` | 30.0 [29.0–31.0] | 0.234 [0.224–0.244] | 20.0 [18.0–22.0] | "
            "40.0 [36.0–44.0] | 16.5 [15.5–17.5] | 33.0 [31.0–35.0] | 3 passes, 0 failed requests |") in one
    assert f"| {LLAMACPP} | `q4_k_m-bbbbbbbbbb` | 25.0 [24.0–26.0] |" in one
    # over capacity and refused: their reason, never a blank or a zero
    assert (f"| {LLAMACPP} | `q4_k_m-bbbbbbbbbb` | over capacity | — | — | — | — | — | KV cache holds "
            "6 sequences of 384 tokens, not 8 |") in eight
    assert (f"| {LLAMACPP} | `iq4_xs-cccccccccc` | refused | — | — | — | — | — | llama-server cannot "
            "load this GGUF: unknown type |") in one
    # the verdicts beside the batch-1 ones, and their rule among the definitions
    recommendation = markdown.split("## Recommendation for this host\n", 1)[1].split("\n## ", 1)[0]
    assert "- For speed: " in recommendation  # the batch-1 verdict first (no bench ran here)
    assert (f"- **For 8 concurrent users within a TPOT p99 of 100 ms: `int4-aaaaaaaaaa` on {VLLM}** "
            "(150.0 [149.0–151.0] output tok/s, TPOT p99 60.0 [58.0–62.0] ms).") in recommendation
    assert "- **For N concurrent users**: among the served 4-bit arms" in markdown


def test_the_serving_plots_are_real_pngs_linked_from_the_report(tmp_path, tiny_untied, results):  # noqa: F811
    markdown = serving_report(tmp_path, tiny_untied, results, study_served(tmp_path))
    for name, title in (("serving_throughput", "Serving: output tokens/s against concurrent users"),
                        ("serving_pareto", "Serving: TPOT p99 against output tokens/s (Pareto view)")):
        assert f"![{title}]({SERVING_PLOTS[name]})" in markdown
        assert (tmp_path / SERVING_PLOTS[name]).read_bytes().startswith(b"\x89PNG")
    assert not list(tmp_path.glob(".*.tmp.png"))


def test_without_a_serve_record_the_report_has_no_serving_part(tmp_path, tiny_untied, results):  # noqa: F811
    markdown = serving_report(tmp_path, tiny_untied, results, None)
    assert "Serving" not in markdown and "concurrent users" not in markdown
    assert not any((tmp_path / name).exists() for name in SERVING_PLOTS.values())


@pytest.mark.parametrize("change, says", [
    (lambda path: path.unlink(), "serve.json: result file is missing"),
    (lambda path: path.write_text('{"served": ['), "serve.json: result file is corrupt"),
    (lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), "tpot_bound_ms": None})),
     r"serve.json: not a serve record the report can read \(a field has the wrong type or value: float\(\) .*\); "
     "remake it: snakemake --forcerun serve"),
    (lambda path: path.write_text(json.dumps({
        k: v for k, v in json.loads(path.read_text()).items() if k != "workload"})),
     r"serve.json: not a serve record the report can read \(it lacks the field 'workload'\)"),
    (lambda path: path.write_text(path.read_text().replace('"over_capacity"', '"queued"')),
     r"serve.json: not a serve record the report can read \(a field has the wrong type or value: "
     r"concurrency 8 has status 'queued', not one of measured, over_capacity\)"),
    (lambda path: path.write_text(json.dumps({"measured": False, "reason": "no engine could serve"})),
     r"serve.json: the serve step did not measure \(no engine could serve\); rerun it: snakemake "
     "--forcerun serve"),
])
def test_a_missing_or_unreadable_serve_record_is_named(tmp_path, tiny_untied, results, change, says):  # noqa: F811
    record = study_served(tmp_path)
    change(record)
    with pytest.raises(ReportInputError, match=says):
        serving_report(tmp_path, tiny_untied, results, record)
    assert not (tmp_path / "report.md").exists()


def test_a_served_build_without_every_level_is_named(tmp_path):
    record = serve_record(tmp_path / "serve.json", [served("int4-aaaaaaaaaa", VLLM, [level(1, 30.0, 33.0)])])
    with pytest.raises(ReportInputError, match=f"int4-aaaaaaaaaa on {VLLM} has no entry at concurrency 8"):
        read_serving(record)


def test_a_serve_record_of_other_weights_is_refused(tmp_path, tiny_untied, results):  # noqa: F811
    record = serve_record(tmp_path / "serve.json", [served("int4-aaaaaaaaaa", VLLM, [level(1, 30.0, 33.0),
                                                                                    level(8, 90.0, 80.0)])],
                          weights="ef" * 32)
    with pytest.raises(ReportInputError, match=rf"{record} from {'ef' * 32} \(1 records\).*"
                                               "--forcerun bench fidelity ppl .* serve$"):
        serving_report(tmp_path, tiny_untied, results, record)
    data = json.loads(record.read_text())
    del data["model_weights_sha256"]
    record.write_text(json.dumps(data))
    with pytest.raises(ReportInputError, match=rf"{record}: has no model_weights_sha256.*--forcerun serve$"):
        serving_report(tmp_path, tiny_untied, results, record)


def verdicts(tmp_path, entries, rows=()):
    """The recommendation lines of a record of ``entries`` at concurrency 1 and 8, by level."""
    _, serving = read_serving(serve_record(tmp_path / "serve.json", entries))
    return dict(zip((1, 8), serving_verdicts(serving, list(rows))))


def test_no_arm_within_the_bound_is_said_with_the_lowest(tmp_path):
    lines = verdicts(tmp_path, [served("int4-aaaaaaaaaa", VLLM, [level(1, 30.0, 90.0), level(8, 150.0, 160.0)]),
                                served("q4_k_m-bbbbbbbbbb", LLAMACPP, [level(1, 25.0, 80.0),
                                                                        level(8, 70.0, 130.0)])])
    assert lines[1].startswith(f"- **For 1 concurrent user within a TPOT p99 of 100 ms: `int4-aaaaaaaaaa` "
                               f"on {VLLM}** (30.0 [29.0–31.0] output tok/s")
    assert lines[8] == (
        "- For 8 concurrent users within a TPOT p99 of 100 ms: no served 4-bit arm keeps within the "
        f"bound, so none is recommended; the lowest TPOT p99 is `q4_k_m-bbbbbbbbbb` on {LLAMACPP}'s, "
        "130.0 [128.0–132.0] ms.")


def test_overlapping_spreads_name_no_single_arm(tmp_path):
    lines = verdicts(tmp_path, [served("int4-aaaaaaaaaa", VLLM, [level(1, 30.0, 33.0), level(8, 100.0, 60.0)]),
                                served("q4_k_m-bbbbbbbbbb", LLAMACPP, [level(1, 20.0, 40.0),
                                                                        level(8, 99.0, 70.0, width=3.0)])])
    assert "**" in lines[1]  # 29–31 against 19–21: separable
    assert lines[8] == (
        "- For 8 concurrent users within a TPOT p99 of 100 ms: not separable, their output tok/s "
        f"[min–max] overlap: `int4-aaaaaaaaaa` on {VLLM} (100.0 [99.0–101.0] output tok/s, TPOT p99 "
        f"60.0 [58.0–62.0] ms), `q4_k_m-bbbbbbbbbb` on {LLAMACPP} (99.0 [96.0–102.0] output tok/s, "
        "TPOT p99 70.0 [68.0–72.0] ms).")


def test_refused_over_capacity_unfaithful_and_baselines_are_not_candidates(tmp_path):
    lines = verdicts(tmp_path, [
        served("baseline", VLLM, [level(1, 90.0, 20.0), level(8, 300.0, 50.0)]),  # fastest, not a candidate
        served("int4-aaaaaaaaaa", VLLM, [level(1, 30.0, 33.0), level(8, 150.0, 120.0)]),  # over the bound at 8
        served("q4_k_m-bbbbbbbbbb", LLAMACPP, [level(1, 25.0, 40.0), over_capacity(8)]),
        served("q4_0-dddddddddd", LLAMACPP, [level(1, 60.0, 20.0), level(8, 200.0, 50.0)]),  # control failed
        refused("iq4_xs-cccccccccc", LLAMACPP, "unknown type"),
    ], rows=[{"engine": LLAMACPP, "arm_id": "q4_0-dddddddddd", "control": "NOT faithful"}])
    assert lines[1].startswith(f"- **For 1 concurrent user within a TPOT p99 of 100 ms: `int4-aaaaaaaaaa` on "
                               f"{VLLM}**")
    assert lines[8] == (
        "- For 8 concurrent users within a TPOT p99 of 100 ms: no served 4-bit arm keeps within the "
        f"bound, so none is recommended; the lowest TPOT p99 is `int4-aaaaaaaaaa` on {VLLM}'s, "
        f"120.0 [118.0–122.0] ms. Not in the running: `q4_k_m-bbbbbbbbbb` on {LLAMACPP} (over capacity: "
        f"KV cache holds 6 sequences of 384 tokens, not 8); `q4_0-dddddddddd` on {LLAMACPP} (control NOT "
        f"faithful); `iq4_xs-cccccccccc` on {LLAMACPP} (refused: unknown type).")


def test_a_faster_arm_over_the_bound_is_named_beside_the_choice(tmp_path):
    lines = verdicts(tmp_path, [served("int4-aaaaaaaaaa", VLLM, [level(1, 30.0, 33.0), level(8, 150.0, 120.0)]),
                                served("q4_k_m-bbbbbbbbbb", LLAMACPP, [level(1, 25.0, 40.0),
                                                                        level(8, 70.0, 90.0)])])
    assert lines[8] == (
        f"- **For 8 concurrent users within a TPOT p99 of 100 ms: `q4_k_m-bbbbbbbbbb` on {LLAMACPP}** "
        "(70.0 [69.0–71.0] output tok/s, TPOT p99 90.0 [88.0–92.0] ms). Faster but over the bound: "
        f"`int4-aaaaaaaaaa` on {VLLM} (150.0 [149.0–151.0] output tok/s, TPOT p99 120.0 [118.0–122.0] ms).")


def test_the_pareto_front_keeps_the_points_nothing_beats_on_both_axes():
    def point(tok_s, tpot):
        return Point(None, 1, tok_s, tpot)
    fast_slow, slow_fast, beaten, tie_a, tie_b = (point(100, 80), point(30, 20), point(50, 90),
                                                  point(60, 40), point(60, 40))
    assert pareto_front([fast_slow, beaten, slow_fast, tie_a, tie_b]) == [slow_fast, tie_a, tie_b, fast_slow]


def test_a_record_that_served_nothing_says_so_and_names_no_arm(tmp_path):
    _, serving = read_serving(serve_record(tmp_path / "serve.json", []))
    assert serving_section(serving)[-1] == ("- No build was served: the serve step's selection (the "
                                            "config's serve.arms) chose none.")
    assert serving_verdicts(serving, []) == [
        f"- For {users} within a TPOT p99 of 100 ms: no served 4-bit arm was timed at this level, so "
        "none is recommended." for users in ("1 concurrent user", "8 concurrent users")]
    paths = {name: tmp_path / file for name, file in SERVING_PLOTS.items()}
    plot_serving(serving, paths)  # each figure says it has nothing to show, rather than being absent
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in paths.values())


def test_one_user_on_the_server_is_set_beside_the_bench_decode_of_the_same_build(tmp_path):
    """TPOT p50 20 [19–21] ms is 50.0 [47.6–52.6] tok/s, overlapping a tg128 of 49–51; 40
    [39–41] ms is 25.0 tok/s, apart from 39–41. A build the bench did not time is left out."""
    _, serving = read_serving(serve_record(tmp_path / "serve.json", [
        served("int4-aaaaaaaaaa", VLLM, [level(1, 30.0, 40.0), level(8, 90.0, 80.0)]),
        served("q4_k_m-bbbbbbbbbb", LLAMACPP, [level(1, 25.0, 80.0), level(8, 70.0, 90.0)]),
        served("baseline", VLLM, [level(1, 20.0, 100.0), level(8, 60.0, 120.0)])]))
    rows = [{"engine": VLLM, "arm_id": "int4-aaaaaaaaaa", "tg128_median": 50.0, "tg128_min": 49.0, "tg128_max": 51.0},
            {"engine": LLAMACPP, "arm_id": "q4_k_m-bbbbbbbbbb", "tg128_median": 40.0, "tg128_min": 39.0,
             "tg128_max": 41.0},
            {"engine": VLLM, "arm_id": "baseline", "tg128_median": None}]
    lines = one_user_against_bench(serving, rows)
    assert lines[1] == "### One user: the server against the batch-1 bench"
    assert lines[-2:] == [
        f"- `int4-aaaaaaaaaa` on {VLLM}: 50.0 [47.6–52.6] tok/s served, against tg128 50.0 [49.0–51.0] in "
        "the bench; their spreads overlap.",
        f"- `q4_k_m-bbbbbbbbbb` on {LLAMACPP}: 25.0 [24.4–25.6] tok/s served, against tg128 40.0 "
        "[39.0–41.0] in the bench; apart: the server decodes at ×0.62 the bench's rate."]
    _, bursts = read_serving(serve_record(tmp_path / "bursts.json", [
        served("int4-aaaaaaaaaa", VLLM, [level(1, 30.0, 0.0), level(8, 90.0, 80.0)])]))
    [burst] = one_user_against_bench(bursts, rows)[-1:]
    assert burst.startswith(f"- `int4-aaaaaaaaaa` on {VLLM}: no decode rate from the server: in a pass its "
                            "tokens arrived in one chunk")
    _, without_one = read_serving(serve_record(tmp_path / "eight.json", [
        served("int4-aaaaaaaaaa", VLLM, [level(8, 90.0, 80.0)])], concurrency=(8,)))
    assert one_user_against_bench(without_one, rows) == [] and one_user_against_bench(None, rows) == []


def test_a_build_served_as_a_runtime_variant_is_named_so_and_set_beside_that_variants_bench(tmp_path):
    """serve.runtime served the arm as the bfloat16 variant and passed over another: the
    section names both, says no control ran in it, and its one user is compared with the
    bench's tg128 of that variant (49-51), not of the arm as scored (20)."""
    entry = served("int4-aaaaaaaaaa", VLLM, [level(1, 30.0, 40.0), level(8, 90.0, 80.0)])
    entry["runtime_choice"] = {
        "preferred": ["vllm bfloat16 w4a8_group", "vllm float32 w4a8"],
        "variant": "vllm float32 w4a8",
        "passed_over": [{"name": "vllm bfloat16 w4a8_group", "reason": "needs avx512_bf16, which this CPU lacks"}]}
    _, serving = read_serving(serve_record(tmp_path / "serve.json", [entry]))
    section = "\n".join(serving_section(serving))
    assert f"- `int4-aaaaaaaaaa` on {VLLM} as vllm float32 w4a8 (vllm): vllm runtime; answering after 12.5 s; " \
           "`vllm-server --model int4-aaaaaaaaaa`" in section
    assert ("  - served as vllm float32 w4a8 (serve.runtime), not as it scored: no control ran in this "
            "runtime, so the quality columns are the scored runtime's.") in section
    assert ("  - preferred (serve.runtime) but not run here: vllm bfloat16 w4a8_group: needs avx512_bf16, "
            "which this CPU lacks.") in section
    assert f"| {VLLM} | `int4-aaaaaaaaaa` as vllm float32 w4a8 | 30.0 [29.0–31.0] |" in section
    row = {"engine": VLLM, "arm_id": "int4-aaaaaaaaaa", "tg128_median": 20.0, "tg128_min": 19.0, "tg128_max": 21.0}
    variant = {"vllm float32 w4a8": {"median": 50.0, "min": 49.0, "max": 51.0}}
    assert one_user_against_bench(serving, [{**row, "_variant_tg128": variant}])[-1] == (
        f"- `int4-aaaaaaaaaa` on {VLLM} as vllm float32 w4a8: 50.0 [47.6–52.6] tok/s served, against tg128 "
        "50.0 [49.0–51.0] in the bench; their spreads overlap.")
    # the bench did not time that variant: nothing to set it beside
    assert one_user_against_bench(serving, [{**row, "_variant_tg128": {}}]) == []
