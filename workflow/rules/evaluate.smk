rule ppl:
    input:
        checkpoint=get_scored_checkpoint,
        windows=f"{EVAL_DIR}/windows.json",
    output:
        ppl=f"{EVAL_DIR}/{{engine}}/{{arm}}/{{form}}.ppl.json",
    log:
        f"{RESULTS}/logs/ppl/{MODEL}/{CORPUS}/{{engine}}/{{arm}}.{{form}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/ppl/{MODEL}/{CORPUS}/{{engine}}/{{arm}}.{{form}}.tsv"
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    params:
        engine=get_engine_settings,
    script:
        "../../scripts/ppl.py"


# Prefill and decode speed of the arm against the same engine's unquantized
# baseline, paired pass by pass (fourbit.benchmark). The job claims every core of
# the run, so Snakemake schedules nothing beside it. Engines that are not deployed
# (the reference) write a record saying they were not benchmarked. No benchmark:
# directive: Snakemake's resource sampler would run beside the timed passes.
rule bench:
    input:
        unpack(get_bench_input),
    output:
        bench=f"{EVAL_DIR}/{{engine}}/{{arm}}/bench.json",
    log:
        f"{RESULTS}/logs/bench/{MODEL}/{CORPUS}/{{engine}}/{{arm}}.log",
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    params:
        engine=get_engine_settings,
        bench=STUDY.config["bench"],
    script:
        "../../scripts/bench.py"
