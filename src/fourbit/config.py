"""Validate a study config and derive its ids: model, corpus, engines, arms.

Validate first, then derive (STYLE.md 3): defaults from the JSON schema are
filled in before anything is hashed, so omitting a default and spelling it out
give the same id. Every id is ``<readable part>-<hash>``; the hash covers the
canonical JSON of exactly the settings that change that thing's outputs.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fourbit.bench import variants
from fourbit.engines import engine_spec, unavailable_here
from fourbit.hashing import file_sha256, short_hash
from fourbit.inputs import sources, supported
from fourbit.quantizers import shapes
from fourbit.schema import ConfigError, canonical_quant, load_schema, sorted_keys, validate

ID_PATTERN = r"[a-z0-9][a-z0-9_.]*-[0-9a-f]{10}"
GGUF_METHODS = {"llamacpp"}  # methods whose checkpoints only llama.cpp reads


@dataclass(frozen=True)
class Arm:
    name: str
    quant: dict
    id: str
    # What the arm does to this model's matrices (fourbit.quantizers.shapes.ArmPlan.summary, or
    # for a llama.cpp arm the tensors llama-quantize stores in a fallback type); not hashed.
    plan: dict = field(default_factory=dict, compare=False)

    @property
    def kept_dense(self) -> dict:
        """Linears its ``fallback: dense`` keeps unquantized on this model."""
        return self.plan.get("kept_dense", {})

    @property
    def kind(self) -> str:
        """What its checkpoint is: a Hugging Face folder ("hf") or a GGUF file ("gguf")."""
        return "gguf" if self.quant["method"] in GGUF_METHODS else "hf"

    @property
    def needs_calibration(self) -> bool:
        """Methods that read calibration data carry a ``calibration`` block."""
        return "calibration" in self.quant

    @property
    def imatrix(self) -> str | None:
        """The id of the importance matrix a llama.cpp arm quantizes with (``imatrix:
        calibration``), a hash of its calibration block, the corpus id in it: arms of one
        block share one matrix. None for every other arm."""
        if self.quant.get("imatrix") != "calibration":
            return None
        return f"imatrix-{short_hash('imatrix', self.quant['calibration'])}"

    @property
    def sensitivity(self) -> str | None:
        """The id of the 4-bit pass and sensitivity measurement a mixed_precision arm spends
        its budget on, a hash of its quant without the budget (shapes.shared_pass_quant):
        arms that differ only in ``extra_bits`` share one. None for every other arm."""
        if "mixed_precision" not in self.quant:
            return None
        return f"sensitivity-{short_hash('sensitivity', shapes.shared_pass_quant(self.quant))}"

    def manifest(self) -> dict:
        return {"name": self.name, "id": self.id, "quant": self.quant}


@dataclass(frozen=True)
class Engine:
    name: str
    settings: dict
    id: str

    @property
    def reads(self) -> str:
        return engine_spec(self.name).reads

    @property
    def keeps_fidelity_side(self) -> bool:
        return engine_spec(self.name).keeps_fidelity_side

    def runs(self, arm: "Arm") -> bool:
        """Whether this engine scores ``arm``: it reads the arm's kind of checkpoint, and
        engines that run only some formats (vLLM's own kernels) run this one."""
        spec = engine_spec(self.name)
        if arm.kept_dense and spec.needs_every_linear_quantized:
            return False
        return arm.kind == self.reads and spec.runs_arm(arm.quant)


@dataclass
class Study:
    config: dict
    results: str
    model_id: str
    corpus_id: str
    engines: dict[str, Engine]
    # the model's config.json, read once before any job (every check and estimate uses it)
    model_config: dict = field(default_factory=dict)
    arms: dict[str, Arm] = field(default_factory=dict)
    # engine name -> why it cannot run on this host (None: it can)
    unavailable: dict[str, str | None] = field(default_factory=dict)
    # arms of the config that cannot apply to this model: {name, id, method, reason};
    # dropped from the DAG before any job, named in the report
    refused_arms: list[dict] = field(default_factory=list)
    # engine name -> why it cannot time this model (None: it can); its bench records say so
    bench_refusals: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict, schema: dict | None = None, *,
                    check_folder: bool = True) -> "Study":
        """The study ``config`` describes, validated and checked against its model.
        ``check_folder``: check the model's local folders whole (fourbit.inputs.sources.
        check_local_folder); False where they were checked when the DAG was built and are
        compared with that DAG's record of them instead (workflow/rules/common.smk, on a
        cluster node)."""
        schema = schema or load_schema()
        config = copy.deepcopy(config)
        quant_parts = [arm.get("quant") for arm in config.get("arms", []) if isinstance(arm, dict)]
        validate(config, schema, "config")
        _check_unique_names(config["arms"])
        corpus_id = corpus_identity(config["corpus"])
        model_id = model_identity(config["model"], corpus_id)
        engines = {
            name: Engine(name, sorted_keys(settings), f"{name}-{short_hash('engine', settings)}")
            for name, settings in sorted(config["engines"].items())
        }
        model_config = _model_config(config, model_id)
        matrices = _matrices(model_config)
        if check_folder:
            sources.check_local_folder(config["model"], model_config)  # local folders, whole
        has_gguf_arms = any(quant.get("method") in GGUF_METHODS for quant in quant_parts)
        model_dir = Path(config["results"]) / model_id
        _check_engines_read(config["model"], model_config, engines, has_gguf_arms, model_dir)
        arms: dict[str, Arm] = {}
        refused: list[dict] = []
        for index, (arm, quant) in enumerate(zip(config["arms"], quant_parts)):
            canonical = canonical_quant(quant, schema, f"arms[{index}].quant")
            if "calibration" in canonical:
                # Calibration data is part of a calibrated arm's identity.
                canonical["calibration"] = sorted_keys({**canonical["calibration"], "corpus": corpus_id})
            arm["quant"] = canonical
            arm_id = f"{arm['name']}-{short_hash('arm', canonical)}"
            if any(a.quant != canonical and a.id == arm_id for a in arms.values()):
                raise ConfigError(f"hash collision on {arm_id}; change the arm's name")
            plan, refusal = _arm_plan(matrices, canonical, arm["name"])
            if refusal:
                refused.append({"name": arm["name"], "id": arm_id, "method": canonical["method"],
                                "reason": refusal})
                continue
            arms[arm_id] = Arm(arm["name"], canonical, arm_id, plan)
        if not arms:
            raise ConfigError("no arm of the config can run on this model:\n  "
                              + "\n  ".join(r["reason"] for r in refused))
        _check_runtimes(config["bench"]["runtimes"], config["arms"], engines, arms)
        _check_variant_names(config["serve"]["runtime"], "serve.runtime", engines)
        return cls(
            config=sorted_keys(config),
            results=config["results"],
            model_id=model_id,
            corpus_id=corpus_id,
            engines=engines,
            model_config=model_config,
            arms=arms,
            unavailable={name: unavailable_here(name) for name in engines},
            refused_arms=refused,
            bench_refusals={name: engine_spec(name).bench_refusal(
                model_config, config["bench"]["prompt_tokens"]) for name in engines},
        )

    @property
    def imatrices(self) -> dict[str, dict]:
        """The importance matrices the arms quantize with: id -> the calibration block."""
        return {arm.imatrix: arm.quant["calibration"] for arm in self.arms.values() if arm.imatrix}

    @property
    def sensitivities(self) -> dict[str, "Arm"]:
        """The shared 4-bit passes of the mixed_precision arms: id -> the pass as an arm of
        its own (its quant shared_pass_quant's, no budget; named after the first arm of it)."""
        passes: dict[str, Arm] = {}
        for arm in self.arms.values():
            if arm.sensitivity and arm.sensitivity not in passes:
                passes[arm.sensitivity] = Arm(arm.name, shapes.shared_pass_quant(arm.quant),
                                              arm.sensitivity, arm.plan)
        return passes

    def arms_of_kind(self, kind: str) -> list[str]:
        return [arm_id for arm_id, arm in self.arms.items() if arm.kind == kind]

    def arms_for(self, engine: Engine) -> list[str]:
        """The arms ``engine`` scores here: none when it cannot run on this host."""
        if self.unavailable.get(engine.name):
            return []
        return [arm_id for arm_id, arm in self.arms.items() if engine.runs(arm)]

    @property
    def runnable_engines(self) -> list[Engine]:
        return [e for e in self.engines.values() if not self.unavailable.get(e.name)]

    def summary(self) -> dict:
        """What the report needs to know about the study, as plain data."""
        return {
            "model": {"id": self.model_id, **self.config["model"]},
            "corpus": {"id": self.corpus_id, **self.config["corpus"]},
            "evaluation": self.config["evaluation"],
            "engines": {e.id: {"name": e.name, "reads": e.reads, **e.settings,
                               "arms": self.arms_for(e), "unavailable": self.unavailable.get(e.name)}
                        for e in self.engines.values()},
            "arms": [{**arm.manifest(), "kind": arm.kind, "plan": arm.plan} for arm in self.arms.values()],
            "refused_arms": self.refused_arms,
        }


def _check_unique_names(arms: list[dict]) -> None:
    """Arm names must differ: ids, folders and report rows start with them, and two arms
    of one name would be told apart only by a hash."""
    seen: dict[str, int] = {}
    for index, arm in enumerate(arms):
        if arm["name"] in seen:
            raise ConfigError(
                f"arms[{index}].name: {arm['name']!r} is already the name of arms[{seen[arm['name']]}]; "
                "every arm needs its own name (rename one, e.g. "
                f"{arm['name']}_{arm['quant'].get('group_size', index)}, or remove it)"
            )
        seen[arm["name"]] = index


def _check_runtimes(runtimes: dict, config_arms: list[dict], engines: dict, arms: dict) -> None:
    """bench.runtimes names variants the host probe knows, and arms of this config that an
    engine with runtime variants runs."""
    _check_variant_names(runtimes["variants"], "bench.runtimes.variants")
    wanted = runtimes["arms"]
    if wanted == "best_faithful":
        return
    names = [arm["name"] for arm in config_arms]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise ConfigError(f"bench.runtimes.arms: {unknown} are not arms of this config; "
                          f"its arms are {names} (or say best_faithful)")
    runs = {arm.name for arm in arms.values() for engine in engines.values()
            if variants.has_variants(engine.name) and engine.runs(arm)}
    if set(wanted) - runs:
        raise ConfigError(f"bench.runtimes.arms: {sorted(set(wanted) - runs)} run on no engine "
                          "with runtime variants (engines: vllm); the arms that do: "
                          f"{sorted(runs)}")


def _check_variant_names(names: str | list[str], key: str, engines: dict | None = None) -> None:
    """A list of runtime variants (a keyword such as auto or as_scored aside) names ones the
    host probe knows; with ``engines``, an engine of this study must have them."""
    if not isinstance(names, list):
        return
    try:
        variants.check_names(names, key)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if engines is not None and not any(variants.has_variants(e.name) for e in engines.values()):
        raise ConfigError(f"{key} names runtime variants, but no engine of this study has them "
                          "(engines: vllm); add the vllm engine or say as_scored")


def _model_config(config: dict, model_id: str) -> dict:
    """The model's config.json before any job (fourbit.inputs.sources.model_config)."""
    try:
        return sources.model_config(config["model"], Path(config["results"]) / model_id / "source")
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _matrices(model_config: dict) -> shapes.Matrices:
    try:
        return shapes.matrices_from_config(model_config)
    except shapes.ShapeError as error:
        raise ConfigError(f"model: {error}") from None


def _arm_plan(matrices: shapes.Matrices, quant: dict, name: str) -> tuple[dict, str | None]:
    """(what the arm does to this model's matrices, why it cannot run on it or None).
    llama.cpp arms always run: llama-quantize falls back per tensor by itself."""
    if quant["method"] in GGUF_METHODS:
        every = {**matrices.linears, matrices.embedding: matrices.embedding_shape}
        fallbacks = shapes.llamacpp_fallbacks(matrices, quant)
        return {"llamacpp_fallback": shapes.collapse(fallbacks, every)}, None
    plan = shapes.plan_arm(matrices, quant, name)
    return plan.summary(), plan.refusal


def _check_engines_read(model: dict, model_config: dict, engines: dict, has_gguf_arms: bool,
                        model_dir: Path) -> None:
    """Stop before any job when vLLM or llama.cpp's converter cannot read this model."""
    try:
        vllm = [name for name in engines if engine_spec(name).needs_vllm_registry]
        if vllm:
            supported.check_vllm(model_config, vllm)
        # GGUF checkpoints start from llama.cpp's converter reading the model.
        if any(engine.reads == "gguf" for engine in engines.values()) or has_gguf_arms:
            from fourbit.llamacpp.build import converter_source
            from fourbit.llamacpp.installed import find_llamacpp
            from fourbit.llamacpp.toolchain import require_build_tools

            tools = find_llamacpp()
            if tools:
                tree = tools.convert_script.parent
            else:
                # Not built yet: the build job will need a compiler, and the same pinned
                # converter's sources, from its sdist, answer the same questions now.
                try:
                    require_build_tools()
                except FileNotFoundError as error:
                    raise ConfigError(str(error)) from None
                tree = converter_source()
            # Builtin and synthetic models get fourbit's SentencePiece tokenizer, which the
            # converter reads from tokenizer.model: only a model's own tokenizer is checked.
            folder = sources.tokenizer_folder(model, model_dir / "source")
            supported.check_llamacpp(model_config, tree, folder)
    except supported.Unsupported as error:
        raise ConfigError(str(error)) from None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9_.]+", "_", text.lower()).strip("_") or "model"


def corpus_identity(corpus: dict) -> str:
    identity = dict(corpus)
    if corpus["source"] == "builtin":
        # The text is this interpreter's standard library: another Python
        # release is another corpus.
        identity["python"] = ".".join(map(str, sys.version_info[:3]))
    elif corpus["source"] == "file":
        path = Path(corpus["path"])
        if not path.is_file():
            raise ConfigError(f"corpus.path: {path} is not a file")
        identity["sha256"] = file_sha256(path)
    return f"{corpus['source']}-{short_hash('corpus', identity)}"


def model_identity(model: dict, corpus_id: str) -> str:
    source = model["source"]
    if source == "builtin":
        # Trained on the corpus's train split: the corpus is part of the model, and so is
        # how it is trained (scheme, pinned kernels, library versions), so other weights
        # never share an id.
        from fourbit.inputs.builtin_model import training_identity

        try:
            training = training_identity(model["preset"], model.get("train", {}))
        except ValueError as error:
            raise ConfigError(f"model.train: {error}") from None
        identity = {**model, "corpus": corpus_id, "training": training}
        return f"builtin_{model['preset']}-{short_hash('model', identity)}"
    if source == "hf":
        org, name = model["repo_id"].split("/")
        return f"hf_{_slug(org)}__{_slug(name)}-{short_hash('model', _with_tokenizer(model))}"
    if source == "path":
        return f"path_{_slug(Path(model['path']).name)}-{short_hash('model', _path_fingerprint(model))}"
    return f"synthetic_{_slug(Path(model['architecture']).stem)}-{short_hash('model', model)}"


def _with_tokenizer(model: dict) -> dict:
    """The model block with the tokenizer folder it names (model.tokenizer) as that
    folder's files' hashes, so another tokenizer is another model; unchanged without one,
    so a study that names none keeps its id."""
    tokenizer = sources.tokenizer_identity(model)
    return {**model, "tokenizer": tokenizer} if tokenizer else model


def _path_fingerprint(model: dict) -> dict:
    """Cheap identity of a local model folder: its config plus weight file sizes, and the
    tokenizer model.tokenizer names (fourbit.inputs.sources.tokenizer_identity).

    Reading gigabytes at DAG-build time would break the 5-second dry run; the
    download rule records the full content hashes in its manifest. A file rewritten in
    place keeps the id; the DAG's record of the folder (fourbit.inputs.folder_state) is
    what sees it.
    """
    folder = Path(model["path"])
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"model.path: {folder} has no config.json; expected a Hugging Face model folder")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ConfigError(
            f"model.path: {folder} has no *.safetensors files; fourbit loads safetensors only "
            "(convert pickle checkpoints with transformers' save_pretrained(safe_serialization=True))"
        )
    fingerprint = {
        "path": str(folder.resolve()),
        "config": json.loads(config.read_text()),
        "weights": {w.name: w.stat().st_size for w in weights},
    }
    tokenizer = sources.tokenizer_identity(model)
    return {**fingerprint, "tokenizer": tokenizer} if tokenizer else fingerprint
