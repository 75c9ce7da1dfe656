rule quantize:
    input:
        unpack(get_quantize_input),
    output:
        checkpoint=directory(f"{MODEL_DIR}/arms/{{arm}}/quantized"),
        arm=f"{MODEL_DIR}/arms/{{arm}}/arm.json",
    log:
        f"{RESULTS}/logs/quantize/{MODEL}/{{arm}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/quantize/{MODEL}/{{arm}}.tsv"
    wildcard_constraints:
        arm="|".join(STUDY.arms_of_kind("hf")) or "(?!)",
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:  # GPTQ: float32 weights + calibration activations + Hessians; runtime for 7-8B
        mem_mb=held("model", 3, 8000),
        runtime=quantize_runtime,
        disk_mb=disk_need("quantized"),
    params:
        arm=get_arm_manifest,
    script:
        "../../scripts/quantize.py"


# One per model and shared pass ({sensitivity}: Arm.sensitivity): the 4-bit weights and
# each set's measured sensitivity, which the mixed_precision arms that differ only in
# their budget start from.
rule sensitivity:
    input:
        model=f"{MODEL_DIR}/untied",
        calibration=f"{RESULTS}/corpus/{CORPUS}/calibration.txt",
    output:
        checkpoint=directory(f"{MODEL_DIR}/sensitivity/{{sensitivity}}/four_bit"),
        record=f"{MODEL_DIR}/sensitivity/{{sensitivity}}/sensitivity.json",
    log:
        f"{RESULTS}/logs/sensitivity/{MODEL}/{{sensitivity}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/sensitivity/{MODEL}/{{sensitivity}}.tsv"
    wildcard_constraints:
        sensitivity="|".join(STUDY.sensitivities) or "(?!)",
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:  # as quantize's, and the model in float32 with its logits for the measurement
        mem_mb=held("model", 3, 8000),
        runtime=per_attempt(720),
        disk_mb=disk_need("four_bit"),
    params:
        sensitivity=get_sensitivity,
    script:
        "../../scripts/sensitivity.py"


rule dequantize:
    input:
        checkpoint=rules.quantize.output.checkpoint,
    output:
        checkpoint=directory(f"{MODEL_DIR}/arms/{{arm}}/dense"),
    log:
        f"{RESULTS}/logs/dequantize/{MODEL}/{{arm}}.log",
    conda:
        "../../envs/fourbit.yaml"
    resources:  # 4-bit in, float32 out: ~8x the input
        mem_mb=held("checkpoint", 10, 2000),
        runtime=per_attempt(60),
        disk_mb=disk_need("dense"),
    script:
        "../../scripts/dequantize.py"
