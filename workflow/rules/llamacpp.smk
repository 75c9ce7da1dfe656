# llama.cpp: the tools (built once per machine, cached outside the work tree),
# the f16 GGUF of the untied model, the importance matrices its arms ask for,
# llama-quantize arms made from it, and each arm expanded back to F32 by the same
# tool (the control).


rule build_llamacpp:
    output:
        tools=LLAMACPP_TOOLS,
    log:
        f"{RESULTS}/logs/build_llamacpp.log",
    benchmark:
        f"{RESULTS}/benchmarks/build_llamacpp.tsv"
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:
        mem_mb=4000,
        runtime=per_attempt(60),
        disk_mb=disk_need("records"),
    params:
        # the cached build's name (fourbit.llamacpp.installed.build_key): when the recipe
        # changes (a new program, say), this job runs again, and every llama.cpp job after it
        build=LLAMACPP_BUILD,
    script:
        "../../scripts/build_llamacpp.py"


rule convert_gguf:
    input:
        model=f"{MODEL_DIR}/untied",
        tools=rules.build_llamacpp.output.tools,
    output:
        gguf=GGUF_BASE,
        storage=GGUF_BASE_STORAGE,
    log:
        f"{RESULTS}/logs/convert_gguf/{MODEL}.log",
    conda:
        "../../envs/fourbit.yaml"
    resources:
        mem_mb=held("model", 2, 2000),
        runtime=per_attempt(60),
        disk_mb=disk_need("gguf_base"),
    script:
        "../../scripts/convert_gguf.py"


# One per model and calibration block ({imatrix}: Arm.imatrix), shared by the arms
# of imatrix: calibration that name the same block.
rule imatrix:
    input:
        gguf=rules.convert_gguf.output.gguf,
        model=f"{MODEL_DIR}/untied",
        calibration=f"{RESULTS}/corpus/{CORPUS}/calibration.txt",
        tools=rules.build_llamacpp.output.tools,
    output:
        imatrix=f"{MODEL_DIR}/imatrix/{{imatrix}}/imatrix.gguf",
        record=f"{MODEL_DIR}/imatrix/{{imatrix}}/imatrix.json",
    log:
        f"{RESULTS}/logs/imatrix/{MODEL}/{{imatrix}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/imatrix/{MODEL}/{{imatrix}}.tsv"
    wildcard_constraints:
        imatrix="|".join(STUDY.imatrices) or "(?!)",
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:  # the f16 GGUF memory-mapped, the activations of one batch of chunks
        mem_mb=held("gguf", 1, 2000),
        runtime=per_attempt(120),
        disk_mb=disk_need("imatrix"),
    params:
        calibration=get_imatrix_calibration,
    script:
        "../../scripts/imatrix.py"


rule quantize_gguf:
    input:
        unpack(get_quantize_gguf_input),
    output:
        gguf=f"{MODEL_DIR}/arms/{{arm}}/gguf/model.gguf",
        arm=f"{MODEL_DIR}/arms/{{arm}}/arm.json",
    log:
        f"{RESULTS}/logs/quantize_gguf/{MODEL}/{{arm}}.log",
    wildcard_constraints:
        arm="|".join(STUDY.arms_of_kind("gguf")) or "(?!)",
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:  # llama-quantize streams tensors; the f16 GGUF is memory-mapped
        mem_mb=per_attempt(8000),
        runtime=per_attempt(120),
        disk_mb=disk_need("gguf"),
    params:
        arm=get_arm_manifest,
    script:
        "../../scripts/quantize_gguf.py"


rule dequantize_gguf:
    input:
        gguf=rules.quantize_gguf.output.gguf,
        tools=rules.build_llamacpp.output.tools,
    output:
        gguf=f"{MODEL_DIR}/arms/{{arm}}/gguf/dense.gguf",
    log:
        f"{RESULTS}/logs/dequantize_gguf/{MODEL}/{{arm}}.log",
    wildcard_constraints:
        arm="|".join(STUDY.arms_of_kind("gguf")) or "(?!)",
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:  # llama-quantize to F32, streamed the same way
        mem_mb=per_attempt(8000),
        runtime=per_attempt(120),
        disk_mb=disk_need("gguf_dense"),
    script:
        "../../scripts/dequantize_gguf.py"
