# Validate first, then derive: fourbit.config checks the config against
# src/fourbit/schemas/config.schema.yaml (filling defaults) and computes every id
# before any rule is defined.
import glob
import sys
from pathlib import Path

from fourbit.bench.variants import engine_variants, has_variants
from fourbit.config import ID_PATTERN, Study
from fourbit.diskspace import StudyDisk, refuse_short_disk
from fourbit.inputs.folder_state import check_as_planned, local_state
from fourbit.inputs.sources import tokenizer_folder
from fourbit.llamacpp.installed import build_key
from fourbit.serving.registry import SERVERS
from fourbit.tasks.preflight import check_tasks

# Snakemake builds the DAG where the workflow starts, and again for each job it runs
# elsewhere (a cluster node: --mode remote). There, the model's local folders were checked
# whole already: they are compared with the record that first build made instead (rule
# record_model_folder), below, once the model id is known.
PLANNING = workflow.is_main_process
STUDY = Study.from_config(config, check_folder=PLANNING)
# An arm that cannot apply to this model (its shapes were checked against the model's
# config.json just now) has no jobs; the report names it with the same reason.
for refused in STUDY.refused_arms:
    print(f"fourbit: not run: {refused['reason']}", file=sys.stderr)
for engine_name, refusal in STUDY.bench_refusals.items():
    if refusal:
        print(f"fourbit: {engine_name}: {refusal}", file=sys.stderr)
RESULTS = STUDY.results
MODEL = STUDY.model_id
# Where rule record_model_folder writes the model's local folders as the DAG's build
# found them (fourbit.inputs.folder_state.local_state).
PLANNED = f"{RESULTS}/{{model}}/source.planned.json"
CORPUS = STUDY.corpus_id
MODEL_DIR = f"{RESULTS}/{MODEL}"
EVAL_DIR = f"{MODEL_DIR}/eval/{CORPUS}"
GGUF_BASE = f"{MODEL_DIR}/gguf/f16.gguf"
GGUF_BASE_STORAGE = f"{MODEL_DIR}/gguf/f16.storage.json"
LLAMACPP_TOOLS = f"{RESULTS}/tools/llamacpp.json"
LLAMACPP_BUILD = build_key()
# The task sets the study enables (tasks:, off by default), refused here, before any job,
# when one cannot run: its data, the model's tokenizer or chat template, the sandbox.
TASKS = check_tasks(
    STUDY.config["tasks"], tokenizer_folder(STUDY.config["model"], f"{MODEL_DIR}/source")
)
# The model's local folders as the study is planned on them (None: it has none), which
# rule record_model_folder writes for the download job to compare with.
LOCAL_STATE = local_state(STUDY.config["model"])


def planned_records():
    """The record_model_folder files of this results folder, this model id's first, then
    the newest first: where this build makes another id than the one a job was sent for
    (its folder resized since), that job's record is among the others."""
    own = Path(PLANNED.format(model=MODEL))
    others = [Path(p) for p in glob.glob(PLANNED.format(model="*")) if Path(p) != own]
    return [own] + sorted(others, key=lambda p: p.stat().st_mtime_ns, reverse=True)


if not PLANNING:
    check_as_planned(STUDY.config["model"], STUDY.model_config, planned_records())
# What each output takes on disk, estimated from config.json (fourbit.diskspace).
DISK = StudyDisk(STUDY)


# ---- resources: what each rule asks of the machine or the cluster ----------------
# In the rules, so every profile (profiles/local, profiles/slurm, a site's own) gets
# the same requests; profiles hold only site settings. `attempt` is 1, then 2 on a
# retry: a job killed for memory or time gets twice as much the second time.


def held(inputs, copies, base_mb, per_checkpoint_mb=0):
    """mem_mb of a job that holds `copies` times its input `inputs` in memory (a
    checkpoint folder or file, or a list of them), plus `base_mb`, plus
    `per_checkpoint_mb` for each (the bench holds one engine per checkpoint): measured
    on disk when the job is ready to run, so a 0.5B model asks for little and an 8B one
    for enough (0 bytes while the inputs do not exist yet, as in a dry run)."""

    def mem_mb(wildcards, input, attempt):
        named = getattr(input, inputs)
        paths = [Path(p) for p in ([named] if isinstance(named, str) else named)]
        files = (f for p in paths for f in ([p] if p.is_file() else p.rglob("*")))
        size = sum(f.stat().st_size for f in files if f.is_file())
        return (base_mb + per_checkpoint_mb * len(paths) + copies * size // 2**20) * attempt

    return mem_mb


def disk_need(kind):
    """disk_mb of a rule whose outputs are of `kind` (fourbit.diskspace.StudyDisk.bytes,
    "records" for a job that writes records only): what an executor that sizes a job's disk
    reads, and what the job's log names if the disk fills (fourbit.filesystems)."""

    def disk_mb(wildcards):
        return DISK.megabytes(kind, wildcards.get("arm") or wildcards.get("sensitivity"))

    return disk_mb


def quantize_runtime(wildcards, attempt):
    """GPTQ's hours for a 7-8B model; minutes for a mixed_precision arm, whose job only
    spends its budget on its shared pass (rule sensitivity ran GPTQ)."""
    return (60 if STUDY.arms[wildcards.arm].sensitivity else 720) * attempt


def per_attempt(amount):
    """`amount` on the first attempt, twice it on the retry."""

    def scaled(wildcards, attempt):
        return amount * attempt

    return scaled


wildcard_constraints:
    # A job sent elsewhere keeps the id it was planned with even where this build makes
    # another (a model folder changed since; the builtin model on another CPU vendor):
    # its own check then names why, where a narrower pattern would stop Snakemake itself.
    model=MODEL if PLANNING else ID_PATTERN,
    corpus=CORPUS,
    arm=f"baseline|{ID_PATTERN}",
    engine="|".join(engine.id for engine in STUDY.engines.values()),


def engine_pattern(keeps_side):
    """The ids of the engines whose ppl jobs keep fidelity sides (keeps_side=True) or keep
    none, as a wildcard constraint: each engine's ppl jobs come from one rule of each pair
    (ppl or ppl_with_side, ppl_baseline or ppl_baseline_with_side). "(?!)" matches no id:
    a study without such engines has no jobs of that rule."""
    ids = [e.id for e in STUDY.engines.values() if e.keeps_fidelity_side == keeps_side]
    return "|".join(ids) or "(?!)"


def get_arm_manifest(wildcards):
    return STUDY.arms[wildcards.arm].manifest()


def engine_settings(engine):
    """What fourbit.engines gets of an engine: its name and its settings."""
    return {"name": engine.name, **engine.settings}


def get_engine_settings(wildcards):
    return engine_settings(next(e for e in STUDY.engines.values() if e.id == wildcards.engine))


def get_download_input(wildcards):
    """The builtin model and the synthetic model's tokenizer are trained on the corpus; a
    model with local folders is compared with their record from the DAG's build."""
    inputs = {}
    if STUDY.config["model"]["source"] in ("builtin", "synthetic"):
        inputs["corpus"] = f"{RESULTS}/corpus/{CORPUS}/manifest.json"
    if LOCAL_STATE is not None:
        inputs["planned"] = rules.record_model_folder.output.planned.format(model=wildcards.model)
    return inputs


def get_quantize_input(wildcards):
    """Calibrated methods also read the corpus's calibration split; a mixed_precision arm
    reads its shared pass instead (rule sensitivity), which read it."""
    arm = STUDY.arms[wildcards.arm]
    inputs = {"model": f"{MODEL_DIR}/untied"}
    if arm.sensitivity:
        inputs["four_bit"] = rules.sensitivity.output.checkpoint.format(sensitivity=arm.sensitivity)
        inputs["sensitivity_record"] = rules.sensitivity.output.record.format(
            sensitivity=arm.sensitivity
        )
    elif arm.needs_calibration:
        inputs["calibration"] = f"{RESULTS}/corpus/{CORPUS}/calibration.txt"
    return inputs


def get_sensitivity(wildcards):
    """What fourbit.steps.quantize.measure_sensitivity gets of a shared pass: its id and quant."""
    return {"id": wildcards.sensitivity, "quant": STUDY.sensitivities[wildcards.sensitivity].quant}


def get_imatrix_calibration(wildcards):
    return STUDY.imatrices[wildcards.imatrix]


def get_quantize_gguf_input(wildcards):
    """The f16 GGUF; for an arm of imatrix: calibration, its importance matrix too."""
    inputs = {
        "gguf": rules.convert_gguf.output.gguf,
        "tools": rules.build_llamacpp.output.tools,
    }
    imatrix = STUDY.arms[wildcards.arm].imatrix
    if imatrix:
        inputs["imatrix"] = rules.imatrix.output.imatrix.format(imatrix=imatrix)
        inputs["imatrix_record"] = rules.imatrix.output.record.format(imatrix=imatrix)
    return inputs


def checkpoint_outputs(kind):
    """Where each kind of checkpoint an engine reads comes from: the rule outputs of the
    unquantized baseline, an arm's quantized checkpoint and its dense expansion (the
    control). "hf": Hugging Face folders; "gguf": GGUF files, made by llama.cpp's tools."""
    return {
        "hf": {
            "baseline": rules.untie_head.output.model,
            "quantized": rules.quantize.output.checkpoint,
            "dense": rules.dequantize.output.checkpoint,
        },
        "gguf": {
            "baseline": rules.convert_gguf.output.gguf,
            "quantized": rules.quantize_gguf.output.gguf,
            "dense": rules.dequantize_gguf.output.gguf,
        },
    }[kind]


def scored_checkpoint(engine_id, arm, form):
    """Each engine's own unquantized baseline; an arm's quantized checkpoint or its
    dense expansion (the control)."""
    reads = next(e.reads for e in STUDY.engines.values() if e.id == engine_id)
    output = checkpoint_outputs(reads)["baseline" if arm == "baseline" else form]
    return expand(output, model=MODEL, arm=arm)[0]


def scored_forms(arm):
    """What a ppl job scores: an arm as quantized and as its dense expansion; the baseline."""
    return ("dense",) if arm == "baseline" else ("quantized", "dense")


def get_scored_checkpoints(wildcards):
    return {
        form: scored_checkpoint(wildcards.engine, wildcards.arm, form)
        for form in scored_forms(wildcards.arm)
    }


def get_baseline_kept(wildcards):
    """For an arm's ppl job on an engine that keeps fidelity sides: the side and the logits
    that engine's baseline job kept, against which the job computes the arm's KL."""
    ids = {"engine": wildcards.engine, "arm": "baseline"}
    kept = rules.ppl_baseline_with_side.output
    return {
        "baseline_side": kept.dense_side.format(**ids),
        "baseline_logits": kept.dense_logits.format(**ids),
    }


def arm_and_baseline(engine_id, arm):
    """The arm's checkpoint and the same engine's unquantized baseline."""
    return {
        "checkpoint": scored_checkpoint(engine_id, arm, "quantized"),
        "baseline": scored_checkpoint(engine_id, "baseline", "dense"),
    }


def compile_cache(engine_id, arm, step):
    """Where an engine that compiles (vLLM) keeps one checkpoint's compile caches for one
    step: beside that checkpoint's records, never shared with another checkpoint (a shared
    cache can load another arm's graph); a baseline's is shared by its engine's arms."""
    return f"{EVAL_DIR}/{engine_id}/{arm}/{step}.cache"


def get_ppl_caches(wildcards):
    return {
        form: compile_cache(wildcards.engine, wildcards.arm, f"{form}.ppl")
        for form in scored_forms(wildcards.arm)
    }


def verdict_records(engine_id, arm_id):
    """An arm's ppl and fidelity records, what the report's fidelity verdict reads (and the
    serve and bench jobs when they choose its best faithful arm)."""
    ids = {"engine": engine_id, "arm": arm_id}
    return {
        "ppl_quantized": rules.ppl.output.quantized.format(**ids),
        "ppl_dense": rules.ppl.output.dense.format(**ids),
        "fidelity": rules.fidelity.output.fidelity.format(**ids),
    }


def bench_pairs():
    """Every arm each engine that can run here runs, with that engine's baseline and the
    arm's bench record: the one bench job times them all (rule bench). Per bench.runtimes,
    whether the arm's runtime variants are timed too ("named", "none", or "best_faithful"
    with the records the job chooses by, fourbit.steps.bench.BenchPair)."""
    wanted = STUDY.config["bench"]["runtimes"]["arms"]
    pairs = []
    for engine in STUDY.runnable_engines:
        for arm_id in STUDY.arms_for(engine):
            checkpoints = arm_and_baseline(engine.id, arm_id)
            choice = "none"
            if has_variants(engine.name) and not STUDY.bench_refusals[engine.name]:
                choice = (
                    "best_faithful"
                    if wanted == "best_faithful"
                    else "named" if STUDY.arms[arm_id].name in wanted else "none"
                )
            pairs.append(
                {
                    "name": f"{engine.id}/{arm_id}",
                    "arm": checkpoints["checkpoint"],
                    "baseline": checkpoints["baseline"],
                    "engine": engine_settings(engine),
                    "out": f"{EVAL_DIR}/{engine.id}/{arm_id}/bench.json",
                    "caches": {
                        "arm": compile_cache(engine.id, arm_id, "bench"),
                        "baseline": compile_cache(engine.id, "baseline", "bench"),
                        "variants": compile_cache(engine.id, arm_id, "bench.variants"),
                    },
                    "refusal": STUDY.bench_refusals[engine.name],
                    "variant_choice": choice,
                    "records": (
                        verdict_records(engine.id, arm_id) if choice == "best_faithful" else {}
                    ),
                }
            )
    return pairs


# What the serve and tasks jobs take from the bench block (its gate and cores): not which
# runtime variants the bench times, so that changing those re-runs the bench alone.
BENCH_GATE = {k: v for k, v in STUDY.config["bench"].items() if k != "runtimes"}


def bench_variant_engines(pairs):
    """At most how many runtime-variant engines the bench holds beside its pairs' own: each
    chosen arm's other variants (best_faithful chooses one arm per engine)."""
    chosen = [p for p in pairs if p["variant_choice"] == "named"]
    chosen += list(
        {p["engine"]["name"]: p for p in pairs if p["variant_choice"] == "best_faithful"}.values()
    )
    return sum(len(engine_variants(p["engine"]["name"])) - 1 for p in chosen)


def serve_arms():
    """Every checkpoint the serve job may serve: each engine with a server
    (fourbit.serving.registry), its baseline and its arms; for serve.arms: best_faithful,
    with the records the choice reads; an engine that cannot run here, its refusal. The job
    chooses among them (fourbit.steps.serve)."""
    wanted = STUDY.config["serve"]["arms"]
    best_faithful = wanted == "best_faithful"
    names = {arm.name for arm in STUDY.arms.values()}
    if not best_faithful and set(wanted) - names:
        raise ValueError(
            f"serve.arms names {sorted(set(wanted) - names)}, which are not arms of this "
            f"study; its arms are {sorted(names)}"
        )
    served = []
    for engine in STUDY.engines.values():
        if engine.name not in SERVERS:
            continue
        # An engine that cannot run on this host: its arms are refused, with its reason.
        refusal = STUDY.unavailable.get(engine.name)
        runs = [arm_id for arm_id, arm in STUDY.arms.items() if engine.runs(arm)]
        for arm_id in ["baseline", *runs]:
            served.append(
                {
                    "refusal": refusal,
                    "engine_id": engine.id,
                    "engine": engine_settings(engine),
                    "arm": arm_id,
                    "arm_name": "baseline" if arm_id == "baseline" else STUDY.arms[arm_id].name,
                    "model": scored_checkpoint(engine.id, arm_id, "quantized"),
                    "cache": compile_cache(engine.id, arm_id, "serve"),
                    "records": (
                        verdict_records(engine.id, arm_id)
                        if best_faithful and arm_id != "baseline" and not refusal
                        else {}
                    ),
                }
            )
    return served


def serve_tools(served):
    """The llama.cpp build's record, when the serve job starts llama-server."""
    if any(arm["engine"]["name"] == "llamacpp" and not arm["refusal"] for arm in served):
        return {"tools": rules.build_llamacpp.output.tools}
    return {}


def serving_report_input():
    """serve.json, when the serve step runs (SERVING, serve.smk: called once it is read)."""
    return {"serve": rules.serve.output.record} if SERVING else {}


def serving_report_plots():
    """The Serving section's two plots, when the serve step runs."""
    if not SERVING:
        return {}
    return {
        name: report(
            f"{RESULTS}/report-{name.replace('_', '-')}.png",
            caption=f"../report/{name}.rst",
            category="Plots",
        )
        for name in ("serving_throughput", "serving_pareto")
    }


def tasks_report_input():
    """tasks.json, when the study enables a task (TASKS; tasks.smk is then included)."""
    return {"tasks": rules.tasks.output.record} if TASKS else {}


def tasks_report_plots():
    """The Task accuracy section's plot, when the study enables a task."""
    if not TASKS:
        return {}
    return {
        "tasks_delta": report(
            f"{RESULTS}/report-tasks-delta.png",
            caption="../report/tasks_delta.rst",
            category="Plots",
        )
    }


def get_fidelity_input(wildcards):
    """The arm and its engine's baseline, compared on the study's token windows; for an
    engine whose ppl jobs keep fidelity sides, the two sides they wrote."""
    inputs = {
        **arm_and_baseline(wildcards.engine, wildcards.arm),
        "windows": f"{EVAL_DIR}/windows.json",
    }
    engine = next(e for e in STUDY.engines.values() if e.id == wildcards.engine)
    if engine.keeps_fidelity_side:
        inputs["arm_side"] = rules.ppl_with_side.output.quantized_side.format(
            engine=engine.id, arm=wildcards.arm
        )
        inputs["baseline_side"] = rules.ppl_baseline_with_side.output.dense_side.format(
            engine=engine.id, arm="baseline"
        )
    return inputs


def all_results():
    """Every record the report reads, by engine id -> arm id ("baseline" for the
    engine's own) -> kind (fourbit.report.loading): each engine that can run on this
    host scores the arms it runs, each both as quantized and as its dense expansion
    (the control), benches and compares them. Called once the rules are defined."""
    records = {}
    for engine in STUDY.runnable_engines:
        records[engine.id] = {
            "baseline": {
                "ppl_dense": rules.ppl_baseline.output.dense.format(
                    engine=engine.id, arm="baseline"
                )
            }
        }
        for arm_id in STUDY.arms_for(engine):
            records[engine.id][arm_id] = {
                **verdict_records(engine.id, arm_id),
                # rule bench's outputs are its pairs' "out" paths (bench_pairs), unnamed
                "bench": f"{EVAL_DIR}/{engine.id}/{arm_id}/bench.json",
            }
    return records


def baseline_storage_inputs():
    """Per GGUF engine, the f16 base's storage record (the HF baseline is read directly)."""
    if any(e.reads == "gguf" for e in STUDY.engines.values()):
        return {"gguf_base_storage": rules.convert_gguf.output.storage}
    return {}


def disk_outputs():
    """The outputs fourbit.diskspace counts, by kind: the rules' outputs, {model}, {arm},
    {sensitivity}, {imatrix} and {engine} left open."""
    return {
        "source": rules.download.output.model,
        "untied": rules.untie_head.output.model,
        "quantized": rules.quantize.output.checkpoint,
        "four_bit": rules.sensitivity.output.checkpoint,
        "dense": rules.dequantize.output.checkpoint,
        "gguf_base": rules.convert_gguf.output.gguf,
        "imatrix": rules.imatrix.output.imatrix,
        "gguf": rules.quantize_gguf.output.gguf,
        "gguf_dense": rules.dequantize_gguf.output.gguf,
        "logits": rules.ppl_baseline_with_side.output.dense_logits,
    }


def check_disk_space():
    """Before any job: refuse the study (fourbit.diskspace.DiskSpaceError, naming the free
    and the needed bytes) when the outputs still to write do not fit where they go, else
    say what they need. Once the rules are defined (report.smk); a job that reads the
    workflow again (on a cluster node) does not ask again."""
    if workflow.is_main_process:
        needed = refuse_short_disk(DISK.outputs(disk_outputs()), RESULTS)
        if needed:
            print(f"fourbit: {needed}", file=sys.stderr)
