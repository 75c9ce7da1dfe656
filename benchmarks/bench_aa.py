"""An A/A bench: copies of the study's baseline timed against it, in rounds (issue 5); not a test.

    .venv/bin/python benchmarks/bench_aa.py --study-dir . --copies 3 --jobs 2

Runs the bench step's own code (fourbit.steps.bench.bench_study, with the study's vllm
engine and bench settings) on ``--copies`` byte-identical copies of the study's untied
model as arms, each paired with the untied model as the baseline, all interleaved in
one job, ``--jobs`` times in a row. Nothing differs between the checkpoints, so

- each copy's pass-by-pass ratio is the noise floor of a paired comparison on this
  host: its median should be 1 within its [min-max], and an arm whose ×base is
  closer to 1 than that cannot be told from its baseline;
- within a job, the copies' absolute medians should agree with each other: the
  rounds give every arm the same host, which is what lets the report compare rows;
- from job to job, each copy's median should stay inside its previous job's
  [min-max]: that is issue 5's "repeating the bench step gives medians within the
  reported spread", for checkpoints known to be equally fast.

Each job's records are kept under --workdir.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
from pathlib import Path

import yaml

from fourbit.steps.bench import BenchPair, bench_study
from fourbit.config import Study
from fourbit.inputs.sources import source_weights_sha256

METRICS = ("pp512_tok_s", "tg128_tok_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study-dir", type=Path, default=Path("."),
                        help="the folder the study ran in (holds config.yaml and its results)")
    parser.add_argument("--config", default="config.yaml", help="the study's config, in --study-dir")
    parser.add_argument("--copies", type=int, default=3, help="identical arms in each job")
    parser.add_argument("--jobs", type=int, default=2, help="bench jobs to run one after another")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fourbit-bench-aa"))
    args = parser.parse_args()
    if args.copies < 2 or args.jobs < 2:
        raise SystemExit(f"--copies {args.copies} --jobs {args.jobs}: comparing copies within a "
                         "job and jobs with each other needs at least 2 of each")
    study = Study.from_config(yaml.safe_load((args.study_dir / args.config).read_text()))
    untied = args.study_dir / study.results / study.model_id / "untied"
    if not (untied / "config.json").is_file():
        raise SystemExit(f"{untied} does not exist: run the study first (make report)")
    weights = source_weights_sha256(untied.parent / "source")
    engine = study.engines["vllm"]
    copies = []
    for number in range(1, args.copies + 1):
        # A folder of its own per copy: the bench step opens one engine per checkpoint.
        copy = args.workdir / "checkpoints" / f"copy{number}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(untied, copy)
        copies.append(copy)
    jobs = []
    for job in range(1, args.jobs + 1):
        folder = args.workdir / f"job{job}"
        pairs = [BenchPair(f"{engine.id}/{copy.name}", copy, untied, {"name": engine.name, **engine.settings},
                           folder / copy.name / "bench.json",
                           {"arm": folder / copy.name / "bench.cache", "baseline": folder / "baseline.cache"})
                 for copy in copies]
        jobs.append(bench_study(pairs, study.config["bench"], threads=args.cores,
                                model_weights_sha256=weights))
        print(f"job {job}: {args.workdir / f'job{job}'}", flush=True)
    report(jobs)


def report(jobs: list[list[dict]]) -> None:
    print(f"\n{'job':4s} {'copy':5s} {'metric':12s} {'copy median [min-max]':>28s} "
          f"{'baseline median [min-max]':>28s} {'ratio median [min-max]':>24s}")
    for metric in METRICS:
        for job, records in enumerate(jobs, 1):
            for copy, record in enumerate(records, 1):
                print(f"{job:<4d} {copy:<5d} {metric:12s} {_span(record['arm']['stats'][metric], 1):>28s} "
                      f"{_span(record['baseline']['stats'][metric], 1):>28s} "
                      f"{_span(record['ratio'][metric], 3):>24s}")
    print()
    for metric in METRICS:
        ratios = [record["ratio"][metric] for records in jobs for record in records]
        within = [(a, b) for records in jobs for a in records for b in records if a is not b]
        across = [(earlier, later) for previous, following in itertools.pairwise(jobs)
                  for earlier, later in zip(previous, following)]
        print(f"{metric}: ratio medians {min(r['median'] for r in ratios):.3f}-"
              f"{max(r['median'] for r in ratios):.3f}, 1 inside [min-max] for "
              f"{sum(r['min'] <= 1 <= r['max'] for r in ratios)} of {len(ratios)}; "
              f"within a job, {_inside(within, metric)} of {len(within)} copy medians inside another "
              f"copy's [min-max]; job to job, {_inside(across, metric)} of {len(across)} copy medians "
              "inside the same copy's [min-max] in the job before")


def _span(stats: dict, digits: int) -> str:
    return f"{stats['median']:.{digits}f} [{stats['min']:.{digits}f}-{stats['max']:.{digits}f}]"


def _inside(pairs: list[tuple[dict, dict]], metric: str) -> int:
    """How many (reference, other) pairs have the other's arm median in the reference's range."""
    return sum(reference["arm"]["stats"][metric]["min"] <= other["arm"]["stats"][metric]["median"]
               <= reference["arm"]["stats"][metric]["max"] for reference, other in pairs)


if __name__ == "__main__":
    main()
