rule tokenize_evaluation:
    input:
        model=rules.untie_head.output.model,
        evaluation=rules.prepare_corpus.output.evaluation,
    output:
        windows=f"{RESULTS}/{{model}}/eval/{{corpus}}/windows.json",
    log:
        f"{RESULTS}/logs/tokenize_evaluation/{{model}}/{{corpus}}.log",
    conda:
        "../../envs/fourbit.yaml"
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        window=STUDY.config["evaluation"]["window"],
        max_windows=STUDY.config["evaluation"]["max_windows"],
    script:
        "../../scripts/tokenize_evaluation.py"


rule ppl:
    input:
        checkpoint=get_scored_checkpoint,
        windows=f"{EVAL_DIR}/windows.json",
        # its fourbit-source.json: the weights' hash every record carries
        source=f"{MODEL_DIR}/source",
    output:
        ppl=f"{EVAL_DIR}/{{engine}}/{{arm}}/{{form}}.ppl.json",
    log:
        f"{RESULTS}/logs/ppl/{MODEL}/{CORPUS}/{{engine}}/{{arm}}.{{form}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/ppl/{MODEL}/{CORPUS}/{{engine}}/{{arm}}.{{form}}.tsv"
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:  # the checkpoint held in float32 + logits of one window
        mem_mb=held("checkpoint", 3, 4000),
        runtime=per_attempt(240),
    params:
        engine=get_engine_settings,
        cache_root=get_ppl_cache,
        fidelity_side=get_fidelity_side,
    script:
        "../../scripts/ppl.py"
