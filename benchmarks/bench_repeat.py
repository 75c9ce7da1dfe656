"""Repeat a finished study's bench step unchanged and compare the two runs (issue 5); not a test.

    .venv/bin/python benchmarks/bench_repeat.py --study-dir . --cores 2

Keeps a copy of every bench.json of the study under ``<results>/bench-repeat/first/``,
reruns only the bench jobs (``snakemake --forcerun bench``; nothing else changes),
keeps the new records under ``.../second/``, and prints, per engine, arm and metric,
both runs' median [min-max] and whether the second median lies within the first
run's [min, max] (the spread the report shows). The study's own bench.json files are
the second run's afterwards, and report.md is rebuilt from them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

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


def compare(first: dict[Path, dict], second: dict[Path, dict]) -> int:
    """Print both runs side by side; return how many second medians fall outside the first spread."""
    outside = 0
    print(f"{'engine/arm':64s} {'metric':12s} {'first median [min-max]':>30s} "
          f"{'second median [min-max]':>30s}  within first spread")
    for relative in sorted(first.keys() & second.keys()):
        engine, arm = relative.parts[-3], relative.parts[-2]
        for side in ("arm", "baseline"):
            for metric in METRICS:
                a = first[relative][side]["stats"][metric]
                b = second[relative][side]["stats"][metric]
                inside = a["min"] <= b["median"] <= a["max"]
                outside += not inside
                name = f"{engine}/{arm}" + (" (its baseline)" if side == "baseline" else "")
                print(f"{name:64s} {metric:12s} {a['median']:10.1f} [{a['min']:.1f}-{a['max']:.1f}]"
                      f"{'':>3s} {b['median']:10.1f} [{b['min']:.1f}-{b['max']:.1f}]   "
                      f"{'yes' if inside else 'NO'}")
    return outside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study-dir", type=Path, default=Path("."),
                        help="the folder the study ran in (holds results/)")
    parser.add_argument("--results", default="results", help="the study's results folder name")
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    results = args.study_dir / args.results
    first = bench_records(results)
    if not first:
        raise SystemExit(f"no measured bench.json under {results}: run the study first (make report)")
    out = results / "bench-repeat"
    shutil.rmtree(out, ignore_errors=True)
    keep(first, out / "first")
    snakemake = Path(sys.executable).with_name("snakemake")
    run = subprocess.run([str(snakemake), "--cores", str(args.cores), "--forcerun", "bench",
                          f"{args.results}/report.md"], cwd=args.study_dir)
    if run.returncode:
        raise SystemExit(f"the repeated bench step failed (exit {run.returncode}); see its logs")
    second = bench_records(results)
    keep(second, out / "second")
    outside = compare(first, second)
    print(f"\n{outside} second-run medians fall outside the first run's [min, max]; both runs' "
          f"records are in {out}")


if __name__ == "__main__":
    main()
