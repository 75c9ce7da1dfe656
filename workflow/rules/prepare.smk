rule prepare_corpus:
    output:
        manifest=f"{RESULTS}/corpus/{{corpus}}/manifest.json",
        train=f"{RESULTS}/corpus/{{corpus}}/train.txt",
        calibration=f"{RESULTS}/corpus/{{corpus}}/calibration.txt",
        evaluation=f"{RESULTS}/corpus/{{corpus}}/evaluation.txt",
    log:
        f"{RESULTS}/logs/prepare_corpus/{{corpus}}.log",
    # Before build_llamacpp, as download is: nothing needs llama.cpp before the model.
    priority: 1
    conda:
        "../../envs/fourbit.yaml"
    resources:
        mem_mb=4000,
        runtime=30,
        disk_mb=disk_need("records"),
    params:
        spec=STUDY.config["corpus"],
    script:
        "../../scripts/prepare_corpus.py"


# Written where the workflow started, whichever host runs the download (a cluster node).
localrules:
    record_model_folder,


rule record_model_folder:
    output:
        planned=PLANNED,
    log:
        f"{RESULTS}/logs/record_model_folder/{{model}}.log",
    conda:
        "../../envs/fourbit.yaml"
    resources:
        disk_mb=disk_need("records"),
    params:
        state=LOCAL_STATE,
    script:
        "../../scripts/record_model_folder.py"


rule download:
    input:
        unpack(get_download_input),
    output:
        model=directory(f"{RESULTS}/{{model}}/source"),
    log:
        f"{RESULTS}/logs/download/{{model}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/download/{{model}}.tsv"
    # The builtin model's training is the longest job and every other one waits on it,
    # so it runs before build_llamacpp, which `make report` has started already.
    priority: 1
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    resources:  # fetch + hash the weights, or train the builtin model
        mem_mb=per_attempt(8000),
        runtime=per_attempt(240),
        disk_mb=disk_need("source"),
    params:
        spec=STUDY.config["model"],
        corpus_dir=f"{RESULTS}/corpus/{CORPUS}",
        corpus_id=CORPUS,
    script:
        "../../scripts/download.py"


rule untie_head:
    input:
        model=rules.download.output.model,
    output:
        model=directory(f"{RESULTS}/{{model}}/untied"),
    log:
        f"{RESULTS}/logs/untie_head/{{model}}.log",
    conda:
        "../../envs/fourbit.yaml"
    resources:  # all tensors in memory, written back with their own lm_head
        mem_mb=held("model", 2, 2000),
        runtime=per_attempt(60),
        disk_mb=disk_need("untied"),
    script:
        "../../scripts/untie_head.py"
