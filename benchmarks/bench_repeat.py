"""Repeat a finished study's bench step unchanged and compare the two runs (issue 5); not a test.

    .venv/bin/python benchmarks/bench_repeat.py --study-dir . --cores 2

Keeps a copy of every bench.json of the study under ``<results>/bench-repeat/first/``,
reruns only the bench jobs (``snakemake --forcerun bench``; nothing else changes),
keeps the new records under ``.../second/``, and prints, per engine, arm and metric
(the arm, its baseline and their pass-by-pass ratio; and each engine's baseline pooled
over its arms' passes, as the report's baseline rows show it), both runs' median [min-max] and
whether the second median is "within the reported spread" in two readings: inside
the first run's [min, max], and no further from the first median than the first
run's spread ((max - min) / median, the figure the report prints). ``--compare-only``
compares the kept records again without rerunning anything. The study's own bench.json files are
the second run's afterwards, and report.md is rebuilt from them.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from fourbit.bench.passes import summarize as summarize_passes

METRICS = ("pp512_tok_s", "tg128_tok_s")


def bench_records(results: Path) -> dict[Path, dict]:
    """Every measured bench.json under ``results``, by path relative to it."""
    records = {}
    for path in sorted(results.glob("*/eval/*/*/*/bench.json")):
        record = json.loads(path.read_text())
        if record.get("measured"):
            records[path.relative_to(results)] = record
    return records


def keep(records: dict[Path, dict], folder: Path) -> None:
    for relative, record in records.items():
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(record, indent=1))


def _stats(record: dict, side: str, metric: str) -> dict:
    return record["ratio"][metric] if side == "ratio" else record[side]["stats"][metric]


def compare(first: dict[Path, dict], second: dict[Path, dict]) -> dict[str, dict[str, int]]:
    """Print both runs side by side, with two readings of "within the reported spread".

    range:  the second median lies in the first run's [min, max];
    spread: the medians differ by at most the first run's spread, (max - min) / median,
            the relative figure the report prints.
    "pooled baseline" compares what the report's baseline rows show: an engine's baseline
    passes pooled over all its arms.
    Returns {"arm"|"baseline"|"ratio"|"pooled baseline": {"total", "outside range",
    "outside spread", "expected outside range"}}, the last the count an ideal bench would
    average (chance_inside).
    """
    counts = {side: {"total": 0, "outside range": 0, "outside spread": 0,
                     "expected outside range": 0.0}
              for side in ("arm", "baseline", "ratio", "pooled baseline")}
    print(f"{'engine/arm':56s} {'metric':12s} {'first median [min-max] spread':>36s} "
          f"{'second median [min-max]':>28s}  in range / in spread")
    for relative in sorted(first.keys() & second.keys()):
        engine, arm = relative.parts[-3], relative.parts[-2]
        for side in ("arm", "baseline", "ratio"):
            for metric in METRICS:
                label = {"arm": "", "baseline": " (its baseline)", "ratio": " (arm/baseline)"}[side]
                _tally(counts[side], f"{engine[:16]}/{arm}{label}", metric,
                       _stats(first[relative], side, metric), _stats(second[relative], side, metric),
                       digits=3 if side == "ratio" else 1)
    shared = first.keys() & second.keys()
    for engine_folder in sorted({relative.parent.parent for relative in shared}):
        for metric in METRICS:
            a, b = (_pooled_baseline({r: run[r] for r in shared}, engine_folder, metric)
                    for run in (first, second))
            _tally(counts["pooled baseline"], f"{engine_folder.name[:16]}/baseline (pooled, as reported)",
                   metric, a, b, digits=1)
    return counts


def _pooled_baseline(records: dict[Path, dict], engine_folder: Path, metric: str) -> dict:
    """One engine's baseline passes with all its arms (<model>/eval/<corpus>/<engine>/)."""
    return summarize_passes([value for relative, record in records.items()
                             if relative.parent.parent == engine_folder
                             for value in record["baseline"]["stats"][metric]["values"]])


def _tally(tally: dict, label: str, metric: str, a: dict, b: dict, digits: int) -> None:
    """Count and print one comparison: the first run's stats ``a`` against the second's ``b``."""
    in_range = a["min"] <= b["median"] <= a["max"]
    in_spread = abs(b["median"] - a["median"]) <= a["max"] - a["min"]
    tally["total"] += 1
    tally["outside range"] += not in_range
    tally["outside spread"] += not in_spread
    tally["expected outside range"] += 1 - chance_inside(len(a["values"]), len(b["values"]))
    print(f"{label:56s} {metric:12s} "
          f"{a['median']:10.{digits}f} [{a['min']:.{digits}f}-{a['max']:.{digits}f}] "
          f"{a['spread']:4.0%} {b['median']:10.{digits}f} [{b['min']:.{digits}f}-"
          f"{b['max']:.{digits}f}]  {'yes' if in_range else 'NO '} / "
          f"{'yes' if in_spread else 'NO'}")


@functools.cache
def chance_inside(first: int, second: int, trials: int = 20000) -> float:
    """How often the median of ``second`` samples lies inside the [min, max] of ``first``
    others from the same distribution: the best a repeat can do with no drift at all
    (9 and 9: 0.97, so of 38 medians about 1 lands outside). Simulated (normal samples;
    the answer depends only on the ranks), with a fixed seed."""
    rng = random.Random(0)
    inside = 0
    for _ in range(trials):
        reference = [rng.gauss(0, 1) for _ in range(first)]
        median = statistics.median(rng.gauss(0, 1) for _ in range(second))
        inside += min(reference) <= median <= max(reference)
    return inside / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study-dir", type=Path, default=Path("."),
                        help="the folder the study ran in (holds results/)")
    parser.add_argument("--results", default="results", help="the study's results folder name")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--compare-only", action="store_true",
                        help="compare the records a previous run kept in bench-repeat/ again")
    args = parser.parse_args()
    results = args.study_dir / args.results
    out = results / "bench-repeat"
    if args.compare_only:
        summarize(compare(bench_records(out / "first"), bench_records(out / "second")), out)
        return
    first = bench_records(results)
    if not first:
        raise SystemExit(f"no measured bench.json under {results}: run the study first (make report)")
    shutil.rmtree(out, ignore_errors=True)
    keep(first, out / "first")
    snakemake = Path(sys.executable).with_name("snakemake")
    run = subprocess.run([str(snakemake), "--cores", str(args.cores), "--forcerun", "bench",
                          f"{args.results}/report.md"], cwd=args.study_dir)
    if run.returncode:
        raise SystemExit(f"the repeated bench step failed (exit {run.returncode}); see its logs")
    second = bench_records(results)
    keep(second, out / "second")
    summarize(compare(first, second), out)


def summarize(counts: dict[str, dict[str, int]], out: Path) -> None:
    print()
    for side, tally in counts.items():
        print(f"{side:9s}: of {tally['total']} second-run medians, {tally['outside range']} outside "
              f"the first run's [min, max] ({tally['expected outside range']:.1f} expected with no "
              f"drift at all), {tally['outside spread']} further from the first median than the "
              "first run's spread")
    print(f"both runs' records are in {out}")


if __name__ == "__main__":
    main()
