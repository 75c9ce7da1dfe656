# How closely each arm follows the same engine's unquantized baseline, on the same
# token ids (fourbit.steps.fidelity): next-token KL and top-1 agreement over the first
# windows of windows.json, and how many fixed prompts keep the baseline's greedy
# continuation exactly. The KL is exact, from both models' full logits at the same
# positions on every engine (llama.cpp's through fourbit-score, which runs the arm beside
# its f16 baseline); an engine that gives no whole distributions writes a record saying
# it was not computed. vLLM's ppl jobs of the two checkpoints compared write
# each one's side in the same engine pass, as declared outputs (rules
# ppl_baseline_with_side: its logits and greedy continuations; ppl_with_side: the arm's
# per-position KL against those logits, and its greedy continuations): this job reads
# both sides (get_fidelity_input) and starts no engine.


rule fidelity:
    input:
        unpack(get_fidelity_input),
        # its fourbit-source.json: the weights' hash every record carries
        source=f"{MODEL_DIR}/source",
    output:
        fidelity=f"{EVAL_DIR}/{{engine}}/{{arm}}/fidelity.json",
    log:
        f"{RESULTS}/logs/fidelity/{MODEL}/{CORPUS}/{{engine}}/{{arm}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/fidelity/{MODEL}/{CORPUS}/{{engine}}/{{arm}}.tsv"
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:  # the reference engine holds the arm and its baseline at once
        mem_mb=held("baseline", 4, 4000),
        runtime=per_attempt(120),
        disk_mb=disk_need("records"),
    params:
        engine=get_engine_settings,
        fidelity=STUDY.config["fidelity"],
    script:
        "../../scripts/fidelity.py"
