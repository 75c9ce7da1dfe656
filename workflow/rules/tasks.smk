# Task accuracy (fourbit.steps.tasks): each served build's greedy completions of every
# enabled task set (tasks:, e.g. HumanEval), from its engine's real OpenAI-compatible
# server, executed against the set's tests in the sandbox (fourbit.tasks.sandbox), and
# paired against its engine's baseline. Included only when a task is enabled (Snakefile).
# One job for the study, like the serve job: one server at a time holds every core, then
# the checks use them. The arms are the serve step's choice (serve.arms) plus each
# engine's baseline; no benchmark: directive (the record times generation and checking).


rule tasks:
    input:
        # llama-server comes from the study's llama.cpp build
        **serve_tools(SERVE_ARMS),
        checkpoints=sorted({arm["model"] for arm in SERVE_ARMS if not arm["refusal"]}),
        records=sorted({path for arm in SERVE_ARMS for path in arm["records"].values()}),
        source=f"{MODEL_DIR}/source",
    output:
        record=f"{EVAL_DIR}/tasks.json",
    log:
        f"{RESULTS}/logs/tasks/{MODEL}/{CORPUS}/tasks.log",
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:  # one server at a time (held sums every checkpoint: an upper bound)
        mem_mb=held("checkpoints", 1, 6000),
        runtime=per_attempt(240),
        disk_mb=disk_need("records"),
    params:
        arms=SERVE_ARMS,
        tasks=STUDY.config["tasks"],
        serve=STUDY.config["serve"],
        bench=BENCH_GATE,
        control_tolerance=STUDY.config["evaluation"]["control_tolerance"],
        # bound each request's context (tasks.context_tokens)
        positions=STUDY.model_config.get("max_position_embeddings"),
        # each server's own log, beside the job's
        server_logs=f"{RESULTS}/logs/tasks/{MODEL}/{CORPUS}/servers",
    script:
        "../../scripts/tasks.py"
