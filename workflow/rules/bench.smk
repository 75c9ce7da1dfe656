# Prefill and decode speed of every arm against its engine's unquantized baseline
# (fourbit.steps.bench), in one job for the whole study: the arms' passes interleaved
# in rounds, so each arm's passes span the whole step and every arm, of every engine,
# is timed on the same host (a shared host's speed drifts over minutes; numbers from
# separate jobs are not comparable). Asking for one arm's bench.json therefore
# re-times them all. The job claims every core of the run, so Snakemake schedules
# nothing beside it. Engines that are not deployed (the reference) get a record
# saying they were not benchmarked. No benchmark: directive: Snakemake's resource
# sampler would run beside the timed passes.
BENCH_PAIRS = bench_pairs()
# Beside one engine per checkpoint: each runtime variant's engine (bench.runtimes).
BENCH_BASE_MB = 4000 + 2048 * bench_variant_engines(BENCH_PAIRS)

if BENCH_PAIRS:

    rule bench:
        input:
            checkpoints=sorted({pair[side] for pair in BENCH_PAIRS for side in ("arm", "baseline")}),
            # bench.runtimes.arms best_faithful: the records the job chooses the arm by
            records=sorted({path for pair in BENCH_PAIRS for path in pair["records"].values()}),
            source=f"{MODEL_DIR}/source",
        output:
            [pair["out"] for pair in BENCH_PAIRS],
        log:
            f"{RESULTS}/logs/bench/{MODEL}/{CORPUS}/bench.log",
        conda:
            "../../envs/fourbit.yaml"
        threads: workflow.cores
        resources:  # one engine per checkpoint held open at once, and each variant's
            mem_mb=held("checkpoints", 3, BENCH_BASE_MB, per_checkpoint_mb=1024),
            runtime=per_attempt(120),
            disk_mb=disk_need("records"),
        params:
            pairs=BENCH_PAIRS,
            bench=STUDY.config["bench"],
            control_tolerance=STUDY.config["evaluation"]["control_tolerance"],
        script:
            "../../scripts/bench.py"
