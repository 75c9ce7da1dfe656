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
    script:
        "../../scripts/dequantize.py"
