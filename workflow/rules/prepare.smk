rule prepare_corpus:
    output:
        manifest=f"{RESULTS}/corpus/{{corpus}}/manifest.json",
        train=f"{RESULTS}/corpus/{{corpus}}/train.txt",
        calibration=f"{RESULTS}/corpus/{{corpus}}/calibration.txt",
        evaluation=f"{RESULTS}/corpus/{{corpus}}/evaluation.txt",
    log:
        f"{RESULTS}/logs/prepare_corpus/{{corpus}}.log",
    conda:
        "../../envs/fourbit.yaml"
    params:
        spec=STUDY.config["corpus"],
    script:
        "../../scripts/prepare_corpus.py"


rule download:
    input:
        unpack(get_download_input),
    output:
        model=directory(f"{RESULTS}/{{model}}/source"),
    log:
        f"{RESULTS}/logs/download/{{model}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/download/{{model}}.tsv"
    conda:
        "../../envs/fourbit.yaml"
    threads: workflow.cores
    params:
        spec=STUDY.config["model"],
        corpus_dir=f"{RESULTS}/corpus/{CORPUS}",
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
    script:
        "../../scripts/untie_head.py"
