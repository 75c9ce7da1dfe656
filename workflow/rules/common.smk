# Validate first, then derive: fourbit.config checks the config against
# workflow/schemas/config.schema.yaml (filling defaults) and computes every id
# before any rule is defined.
from fourbit.config import ID_PATTERN, Study

STUDY = Study.from_config(config)
RESULTS = STUDY.results
MODEL = STUDY.model_id
CORPUS = STUDY.corpus_id
MODEL_DIR = f"{RESULTS}/{MODEL}"
EVAL_DIR = f"{MODEL_DIR}/eval/{CORPUS}"


wildcard_constraints:
    model=MODEL,
    corpus=CORPUS,
    arm=f"baseline|{ID_PATTERN}",
    engine="|".join(engine.id for engine in STUDY.engines.values()),
    form="quantized|dense",


def get_arm_manifest(wildcards):
    return STUDY.arms[wildcards.arm].manifest()


def get_engine_settings(wildcards):
    engine = next(e for e in STUDY.engines.values() if e.id == wildcards.engine)
    return {"name": engine.name, **engine.settings}


def get_download_input(wildcards):
    """The builtin model and the synthetic model's tokenizer are trained on the corpus."""
    if STUDY.config["model"]["source"] in ("builtin", "synthetic"):
        return {"corpus": f"{RESULTS}/corpus/{CORPUS}/manifest.json"}
    return {}


def get_quantize_input(wildcards):
    """Calibrated methods also read the corpus's calibration split."""
    inputs = {"model": f"{MODEL_DIR}/untied"}
    if STUDY.arms[wildcards.arm].needs_calibration:
        inputs["calibration"] = f"{RESULTS}/corpus/{CORPUS}/calibration.txt"
    return inputs


def get_scored_checkpoint(wildcards):
    """The unquantized baseline is the untied model; an arm has two forms."""
    if wildcards.arm == "baseline":
        return f"{MODEL_DIR}/untied"
    return f"{MODEL_DIR}/arms/{wildcards.arm}/{wildcards.form}"


def all_results():
    """Every file the report reads, for every engine and arm of the study."""
    files = []
    for engine in STUDY.engines.values():
        files.append(f"{EVAL_DIR}/{engine.id}/baseline/dense.ppl.json")
        for arm_id in STUDY.arms:
            for form in ("quantized", "dense"):
                files.append(f"{EVAL_DIR}/{engine.id}/{arm_id}/{form}.ppl.json")
            files.append(f"{EVAL_DIR}/{engine.id}/{arm_id}/bench.json")
    return files
