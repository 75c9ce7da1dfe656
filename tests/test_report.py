"""The report: every number from a result file, and a clear stop when one is missing or corrupt."""

import json

import pytest

from fourbit.report import ReportInputError, write_report

ENGINE = "reference-0000000000"
ARM = "a-0000000000"
SECOND = "b-0000000000"  # a second arm of the same engine


def study(source="builtin"):
    return {
        "model": {"id": "m", "source": source},
        "corpus": {"id": "c", "source": "builtin"},
        "evaluation": {"control_tolerance": 0.001},
        "engines": {ENGINE: {"name": "reference", "reads": "hf", "arms": [ARM], "unavailable": None},
                    "vllm_native-0000000000": {"name": "vllm_native", "reads": "hf", "arms": [],
                                               "unavailable": "no avx512f: reason given"}},
        "arms": [{"id": ARM, "name": "a", "kind": "hf", "quant": {"method": "cpu_int4"}}],
    }


def ppl_result(nll):
    windows = [nll, nll + 1.0, nll - 1.0, nll + 0.5]
    return {"definition": "d", "token_ids_sha256": "t", "runtime": "r", "window_nll_sum": windows,
            "window_tokens": [10] * 4, "tokens": 40, "mean_nll": sum(windows) / 40,
            "ppl": 2.718 ** (sum(windows) / 40)}


@pytest.fixture
def results(tmp_path):
    paths = {
        "baseline": tmp_path / ENGINE / "baseline" / "dense.ppl.json",
        "quantized": tmp_path / ENGINE / ARM / "quantized.ppl.json",
        "dense": tmp_path / ENGINE / ARM / "dense.ppl.json",
        "bench": tmp_path / ENGINE / ARM / "bench.json",
        "fidelity": tmp_path / ENGINE / ARM / "fidelity.json",
    }
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    paths["baseline"].write_text(json.dumps(ppl_result(30.0)))
    paths["quantized"].write_text(json.dumps(ppl_result(31.0)))
    paths["dense"].write_text(json.dumps(ppl_result(31.0)))
    paths["bench"].write_text(json.dumps({"measured": False}))
    paths["fidelity"].write_text(json.dumps({
        "computed": True, "method": "full logits", "bound": "exact", "kl_mean": 0.01, "kl_p99": 0.1,
        "top1_agreement": 0.95, "greedy": {"identical": 3, "prompts": 4},
    }))
    manifest = tmp_path / "arm.json"
    manifest.write_text(json.dumps({"id": ARM, "quant": {"method": "cpu_int4", "group_size": 128, "sym": False},
                                    "storage": {"quantized_bits_per_weight": 4.19, "file_bits_per_param": 5.0,
                                                "size_mib": 1.0},
                                    "method_facts": {"algorithm": "rtn, shrink search", "head": "rtn"},
                                    "quantize_seconds": 1.25, "peak_rss_mib": 700.4}))
    return paths, manifest


def report(tmp_path, tiny_untied, paths, manifest, source="builtin"):
    write_report(study(source), results=[str(p) for p in paths.values()], arm_manifests=[str(manifest)],
                 markdown_path=tmp_path / "report.md", table_path=tmp_path / "report.tsv",
                 baseline_checkpoint=tiny_untied)
    return (tmp_path / "report.md").read_text()


def test_report_rows_come_from_the_result_files(tmp_path, tiny_untied, results):
    markdown = report(tmp_path, tiny_untied, *results)
    assert f"`{ARM}`" in markdown and "faithful" in markdown
    table = (tmp_path / "report.tsv").read_text().splitlines()
    assert table[0].startswith("engine\tarm_id") and len(table) == 3
    assert f"- Engine {ENGINE}: r (its 4-bit runtimes: under Runtimes)" in markdown  # host block
    assert "timed in one bench job" not in markdown  # no job was timed
    # how the arm was made, from its manifest: algorithm, head, calibration, time, peak RSS
    assert f"| `{ARM}` | rtn, shrink search | rtn | dense | — | none | 1.2 s | 700 MiB |" in markdown
    # An engine that could not run here has no rows, and the report says why.
    assert "Not run on this host: vllm_native-0000000000** (vllm_native): no avx512f" in markdown


def test_missing_result_file_is_named(tmp_path, tiny_untied, results):
    paths, manifest = results
    paths["dense"].unlink()
    with pytest.raises(ReportInputError, match=f"{ARM}/dense.ppl.json: result file is missing"):
        report(tmp_path, tiny_untied, paths, manifest)


def test_corrupt_result_file_is_named(tmp_path, tiny_untied, results):
    paths, manifest = results
    paths["quantized"].write_text('{"ppl": 3')
    with pytest.raises(ReportInputError, match=f"{ARM}/quantized.ppl.json: result file is corrupt"):
        report(tmp_path, tiny_untied, paths, manifest)
    assert not (tmp_path / "report.md").exists()


def test_synthetic_model_marks_quality_meaningless(tmp_path, tiny_untied, results):
    assert "meaningless" in report(tmp_path, tiny_untied, *results, source="synthetic")


JOB = {"started": "2026-11-29T19:00:00+00:00", "pairs": 2, "checkpoints": 3}


def bench_record(baseline_tg, arm_tg, job=JOB, slot=1):
    """A measured bench.json of 3 passes, in rounds of two pairs: tg128 as given per pass,
    pp512 fixed."""
    def stats(values):
        return {"values": values, "median": sorted(values)[1], "min": min(values), "max": max(values)}

    checks = {"contention": {"busy": {"0": 0.02}, "override_used": False},
              "residency": {"arm": {"resident_fraction": 1.0}, "baseline": {"resident_fraction": 1.0}}}
    side = {"weight_bytes_per_token": {"bytes": 1e6}}
    return {
        "measured": True, "passes": 3, "job": job,
        "bandwidth": {"gbs": 30.0, "gbs_per_repeat": [29.0, 30.0, 27.5]},
        "provenance": {"cpu_model": "c", "isa": {"avx2": True}, "versions": {}, "env": {}, "cores": [0],
                       "threads": 1, "load_average": [0.1, 0.1, 0.1]},
        "contention": {"max_busy": 0.02, "override_used": False},
        "runs": [{"checks": checks, "started_s": 30.0 * n + 15.0 * slot} for n in range(3)],
        "arm": {**side, "stats": {"pp512_tok_s": stats([900.0] * 3), "tg128_tok_s": stats(arm_tg)}},
        "baseline": {**side, "stats": {"pp512_tok_s": stats([1000.0] * 3), "tg128_tok_s": stats(baseline_tg)}},
        "ratio": {"pp512_tok_s": stats([0.9] * 3),
                  "tg128_tok_s": stats([a / b for a, b in zip(arm_tg, baseline_tg)])},
    }


def two_arms(tmp_path, tiny_untied, results, first, second_record):
    """The report of two arms of one engine with these bench records; its markdown."""
    paths, manifest = results
    second = SECOND
    paths["bench"].write_text(json.dumps(first))
    for name in ("quantized.ppl.json", "dense.ppl.json", "fidelity.json"):
        (tmp_path / ENGINE / second).mkdir(exist_ok=True)
        (tmp_path / ENGINE / second / name).write_text((tmp_path / ENGINE / ARM / name).read_text())
        paths[f"{second}/{name}"] = tmp_path / ENGINE / second / name
    paths[f"{second}/bench"] = tmp_path / ENGINE / second / "bench.json"
    paths[f"{second}/bench"].write_text(json.dumps(second_record))
    (tmp_path / "b.json").write_text(manifest.read_text().replace(ARM, second))
    setup = study()
    setup["engines"][ENGINE]["arms"] = [ARM, second]
    write_report(setup, results=[str(p) for p in paths.values()],
                 arm_manifests=[str(manifest), str(tmp_path / "b.json")],
                 markdown_path=tmp_path / "report.md", table_path=tmp_path / "report.tsv",
                 baseline_checkpoint=tiny_untied)
    return (tmp_path / "report.md").read_text()


def test_the_baseline_row_pools_its_passes_with_every_arm_of_the_job(tmp_path, tiny_untied, results):
    """One job times two arms in rounds: the baseline row is the median of all six of its
    passes, each arm keeps its own passes and paired ratio, and the report says how the
    rows were timed."""
    markdown = two_arms(tmp_path, tiny_untied, results,
                        bench_record([100.0, 102.0, 98.0], [50.0, 51.0, 49.0], slot=1),
                        bench_record([80.0, 81.0, 79.0], [60.0, 61.0, 59.0], slot=2))
    rows = {line.split("|")[2].strip(): line for line in markdown.splitlines()
            if line.startswith(f"| {ENGINE} |") and "passes" in line}
    # pooled: the median of 79..102 over six passes is (81 + 98) / 2
    assert "89.5 [79.0–102.0] ×1.00" in rows["`baseline`"]
    assert "6 passes, paired with 2 arms" in rows["`baseline`"]
    assert "50.0 [49.0–51.0] ×0.50" in rows[f"`{ARM}`"]
    assert "60.0 [59.0–61.0] ×0.75" in rows[f"`{SECOND}`"]
    # the last pass started 2 * 30 + 2 * 15 = 90 s into the job
    assert ("All 2 arms of 1 engine(s) were timed in one bench job (started "
            "2026-11-29T19:00:00+00:00), in 3 rounds over 1.5 min") in markdown
    assert "30.0 GB/s (best of 3 repeats; slowest 27.5)" in markdown


def test_rows_from_separate_bench_jobs_are_refused(tmp_path, tiny_untied, results):
    other = {**JOB, "started": "2026-11-29T20:00:00+00:00"}
    with pytest.raises(ReportInputError, match=r"b-0000000000/bench.json: timed in another bench job "
                                               r"\(2026-11-29T20:00:00\+00:00\).*--forcerun bench"):
        two_arms(tmp_path, tiny_untied, results, bench_record([100.0] * 3, [50.0] * 3),
                 bench_record([100.0] * 3, [50.0] * 3, job=other))


def test_a_bench_record_of_the_old_layout_is_named_with_the_rerun(tmp_path, tiny_untied, results):
    paths, manifest = results
    record = bench_record([100.0, 102.0, 98.0], [50.0, 51.0, 49.0])
    del record["job"]
    paths["bench"].write_text(json.dumps(record))
    with pytest.raises(ReportInputError, match=f"{ARM}/bench.json: written by an older fourbit "
                                               r"\(one bench job per arm\).*--forcerun bench"):
        report(tmp_path, tiny_untied, paths, manifest)
