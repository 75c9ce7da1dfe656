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


# Throughput is not measured yet: the rule exists so the report's columns and
# the DAG are in place, and it writes a record that says so plainly.
rule bench:
    input:
        checkpoint=f"{MODEL_DIR}/arms/{{arm}}/quantized",
    output:
        bench=f"{EVAL_DIR}/{{engine}}/{{arm}}/bench.json",
    log:
        f"{RESULTS}/logs/bench/{MODEL}/{CORPUS}/{{engine}}/{{arm}}.log",
    conda:
        "../../envs/fourbit.yaml"
    params:
        engine=get_engine_settings,
    script:
        "../../scripts/bench.py"
