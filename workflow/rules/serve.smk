# What each served build gives 1, 2, 4, 8, 16 concurrent users on its engine's real
# OpenAI-compatible server (fourbit.steps.serve): vLLM's api_server and llama-server,
# started by the job on free loopback ports and stopped when it ends, all driven by one
# load generator (fourbit.serving.load). One job for the whole study, like the bench: every level of every
# served arm timed in interleaved passes on the same cores, which the job claims whole.
# Which arms: serve.arms (the report's best faithful arm of each engine, or names) and
# serve.baseline. No benchmark: directive, as for the bench.
SERVE_ARMS = serve_arms()
# The report reads serve.json and draws its two serving plots only when this is True.
SERVING = STUDY.config["serve"]["enabled"] and bool(SERVE_ARMS)

if SERVING:

    rule serve:
        input:
            # llama-server comes from the study's llama.cpp build
            **serve_tools(SERVE_ARMS),
            checkpoints=sorted({arm["model"] for arm in SERVE_ARMS if not arm["refusal"]}),
            records=sorted({path for arm in SERVE_ARMS for path in arm["records"].values()}),
            windows=f"{EVAL_DIR}/windows.json",
            source=f"{MODEL_DIR}/source",
        output:
            record=f"{EVAL_DIR}/serve.json",
        log:
            f"{RESULTS}/logs/serve/{MODEL}/{CORPUS}/serve.log",
        conda:
            "../../envs/fourbit.yaml"
        threads: workflow.cores
        resources:  # a server per served checkpoint held open at once (its KV cache and runtime)
            mem_mb=held("checkpoints", 3, 4000, per_checkpoint_mb=2048),
            runtime=per_attempt(120),
            disk_mb=disk_need("records"),
        params:
            arms=SERVE_ARMS,
            serve=STUDY.config["serve"],
            bench=BENCH_GATE,
            control_tolerance=STUDY.config["evaluation"]["control_tolerance"],
            # each server's own log, beside the job's
            server_logs=f"{RESULTS}/logs/serve/{MODEL}/{CORPUS}/servers",
        script:
            "../../scripts/serve.py"
