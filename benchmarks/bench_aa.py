"""An A/A bench: the study's baseline timed against itself, job after job (issue 5); not a test.

    .venv/bin/python benchmarks/bench_aa.py --study-dir . --jobs 3

Runs the bench step's own code (fourbit.benchmark.bench_arm, with the study's vllm
engine and bench settings) with the study's untied model on both sides, ``--jobs``
times in a row. Nothing differs between the two sides, so

- the pass-by-pass ratio is the noise floor of a paired comparison on this host: its
  median should be 1 within its [min-max], and an arm whose ×base is closer to 1 than
  that cannot be told from its baseline;
- within a job the two sides' medians track each other, while from job to job both
  move with the host. How far they move is the drift that an arm's absolute tok/s
  (timed in one job) carries and its paired ratio cancels; the report prints a like
  figure from the study's own jobs ("The host's drift between bench jobs").

Each job's bench.json is kept under --workdir.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml

from fourbit.benchmark import bench_arm
from fourbit.config import Study

METRICS = ("pp512_tok_s", "tg128_tok_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study-dir", type=Path, default=Path("."),
                        help="the folder the study ran in (holds config.yaml and its results)")
    parser.add_argument("--config", default="config.yaml", help="the study's config, in --study-dir")
    parser.add_argument("--jobs", type=int, default=3, help="bench jobs to run one after another")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fourbit-bench-aa"))
    args = parser.parse_args()
    if args.jobs < 2:
        raise SystemExit(f"--jobs {args.jobs}: drift between jobs needs at least 2")
    study = Study.from_config(yaml.safe_load((args.study_dir / args.config).read_text()))
    untied = args.study_dir / study.results / study.model_id / "untied"
    if not (untied / "config.json").is_file():
        raise SystemExit(f"{untied} does not exist: run the study first (make report)")
    engine = study.engines["vllm"]
    records = []
    for job in range(1, args.jobs + 1):
        out = args.workdir / f"job{job}" / "bench.json"
        records.append(bench_arm(untied, untied, {"name": engine.name, **engine.settings},
                                 study.config["bench"], out, threads=args.cores))
        print(f"job {job}: {out}", flush=True)
    report(records)


def report(records: list[dict]) -> None:
    print(f"\n{'job':4s} {'metric':12s} {'side A median [min-max]':>28s} "
          f"{'side B median [min-max]':>28s} {'A/B ratio median [min-max]':>28s}")
    for metric in METRICS:
        for job, record in enumerate(records, 1):
            cells = [_span(record[side]["stats"][metric], 1) for side in ("arm", "baseline")]
            print(f"{job:<4d} {metric:12s} {cells[0]:>28s} {cells[1]:>28s} "
                  f"{_span(record['ratio'][metric], 3):>28s}")
    print()
    for metric in METRICS:
        ratios = [r["ratio"][metric] for r in records]
        medians = [r[side]["stats"][metric]["median"] for r in records for side in ("arm", "baseline")]
        pooled = statistics.median(medians)
        print(f"{metric}: A/B ratio medians {min(r['median'] for r in ratios):.3f}-"
              f"{max(r['median'] for r in ratios):.3f}; 1 inside the job's [min-max] in "
              f"{sum(r['min'] <= 1 <= r['max'] for r in ratios)} of {len(ratios)} jobs. "
              f"Absolute job medians {min(medians):.1f}-{max(medians):.1f} tok/s "
              f"({min(medians) / pooled - 1:+.0%} to {max(medians) / pooled - 1:+.0%} of their median); "
              f"{_outside(records, metric)} of {len(records) * (len(records) - 1) * 2} "
              "(job, other job, side) medians fall outside the other job's [min-max]")


def _span(stats: dict, digits: int) -> str:
    return f"{stats['median']:.{digits}f} [{stats['min']:.{digits}f}-{stats['max']:.{digits}f}]"


def _outside(records: list[dict], metric: str) -> int:
    """How often a job's median falls outside another job's [min, max], the same side."""
    count = 0
    for i, first in enumerate(records):
        for j, second in enumerate(records):
            if i == j:
                continue
            for side in ("arm", "baseline"):
                a, b = first[side]["stats"][metric], second[side]["stats"][metric]
                count += not a["min"] <= b["median"] <= a["max"]
    return count


if __name__ == "__main__":
    main()
