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
        disk_mb=disk_need("records"),
    params:
        window=STUDY.config["evaluation"]["window"],
        max_windows=STUDY.config["evaluation"]["max_windows"],
    script:
        "../../scripts/tokenize_evaluation.py"


# One job per arm scores its quantized checkpoint and its dense expansion, one engine
# after the other in one process: a process's first vLLM engine takes longer to start than
# its second (vLLM's lazy imports and warm-up: 14.8 s against 2.6 s for the default study's
# model on a 2-core Intel Xeon), and vLLM's import costs ~4 s more, so one process per
# checkpoint paid both twice per arm. The baseline has a job of its own (ppl_baseline).
# Engines that keep fidelity sides (vLLM) also write, in the same engine pass, the side
# of each checkpoint the fidelity job compares (the baseline, then the arm as quantized,
# whose KL is computed against the baseline's kept logits): the fidelity job reads the two
# and starts no engine. A rule's outputs are fixed, so those engines' jobs come from the
# variants ppl_with_side and ppl_baseline_with_side, each engine id matching exactly one
# rule of a pair (engine_pattern in common.smk).
rule ppl:
    input:
        unpack(get_scored_checkpoints),
        windows=f"{EVAL_DIR}/windows.json",
        # its fourbit-source.json: the weights' hash every record carries
        source=f"{MODEL_DIR}/source",
    output:
        quantized=f"{EVAL_DIR}/{{engine}}/{{arm}}/quantized.ppl.json",
        dense=f"{EVAL_DIR}/{{engine}}/{{arm}}/dense.ppl.json",
    log:
        f"{RESULTS}/logs/ppl/{MODEL}/{CORPUS}/{{engine}}/{{arm}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/ppl/{MODEL}/{CORPUS}/{{engine}}/{{arm}}.tsv"
    wildcard_constraints:
        arm=ID_PATTERN,
        engine=engine_pattern(keeps_side=False),
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:  # one checkpoint at a time, held in float32, + logits of one window
        mem_mb=held("dense", 3, 4000),
        runtime=per_attempt(480),
        disk_mb=disk_need("records"),
    params:
        engine=get_engine_settings,
        cache_roots=get_ppl_caches,
    script:
        "../../scripts/ppl.py"


use rule ppl as ppl_baseline with:
    output:
        dense=f"{EVAL_DIR}/{{engine}}/{{arm}}/dense.ppl.json",
    wildcard_constraints:
        arm="baseline",
        engine=engine_pattern(keeps_side=False),
    # a `use rule` block replaces the parent's resources whole (only params merge), so
    # mem_mb is stated again beside the shorter runtime
    resources:
        mem_mb=held("dense", 3, 4000),
        runtime=per_attempt(240),
        disk_mb=disk_need("records"),


# The baseline's job also writes its logits of the compared windows (fourbit.engines.vllm
# .distributions), which every arm's job below reads to compute the arm's exact KL in its
# own engine pass; the fidelity job then starts no engine.
use rule ppl_baseline as ppl_baseline_with_side with:
    output:
        dense=f"{EVAL_DIR}/{{engine}}/{{arm}}/dense.ppl.json",
        dense_side=f"{EVAL_DIR}/{{engine}}/{{arm}}/dense.side.json",
        dense_logits=f"{EVAL_DIR}/{{engine}}/{{arm}}/dense.logits.npy",
    wildcard_constraints:
        arm="baseline",
        engine=engine_pattern(keeps_side=True),
    resources:
        mem_mb=held("dense", 3, 4000),
        runtime=per_attempt(240),
        disk_mb=disk_need("logits"),
    params:
        fidelity=STUDY.config["fidelity"],


# a `use rule` block replaces the parent's inputs, outputs and wildcard_constraints whole
# (only params merge), so each variant states them all again
use rule ppl as ppl_with_side with:
    input:
        unpack(get_scored_checkpoints),
        unpack(get_baseline_kept),
        windows=f"{EVAL_DIR}/windows.json",
        source=f"{MODEL_DIR}/source",
    output:
        quantized=f"{EVAL_DIR}/{{engine}}/{{arm}}/quantized.ppl.json",
        dense=f"{EVAL_DIR}/{{engine}}/{{arm}}/dense.ppl.json",
        quantized_side=f"{EVAL_DIR}/{{engine}}/{{arm}}/quantized.side.json",
    wildcard_constraints:
        arm=ID_PATTERN,
        engine=engine_pattern(keeps_side=True),
    params:
        fidelity=STUDY.config["fidelity"],
