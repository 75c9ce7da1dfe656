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
        runtime=per_attempt(720),
        disk_mb=disk_need("quantized"),
    params:
        arm=get_arm_manifest,
    script:
        "../../scripts/quantize.py"


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
