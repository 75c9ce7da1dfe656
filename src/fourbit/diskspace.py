"""The disk a study's outputs take, estimated before any job, and the check that refuses
to start a study whose results folder has less free.

Every figure comes from the model's config.json (the one every arm was checked against:
the parameters of each matrix) and each arm's bits per weight:

| output (rule) | bytes |
|---|---|
| ``source/`` (download) | a builtin or synthetic model: every parameter in float32; an hf or path model is linked, 0 |
| ``untied/`` (untie_head) | a tied model: every parameter, the new head's included, in config.json's dtype; an untied one is linked, 0 |
| ``arms/<arm>/quantized/`` (quantize) | each matrix at its grid's bits: 4 + 32/G on the 4-bit grid, 8 + 32/G on the 8-bit one (a float16 scale and a zero of at most 16 bits per group of G), the matrices the arm keeps dense in the model's dtype, plus mixed_precision's extra bits |
| ``sensitivity/<sensitivity>/four_bit/`` (sensitivity) | a mixed_precision arm's checkpoint before its budget is spent, once per shared pass: as its quantized one without the extra bits, an 8-bit head or table still dense |
| ``arms/<arm>/dense/`` (dequantize) | every parameter in float32 |
| ``gguf/f16.gguf`` (convert_gguf) | every parameter at 16 bits |
| ``imatrix/<imatrix>/imatrix.gguf`` (imatrix) | per decoder linear, a float32 sum of squares per input column and a float32 count, plus 160 bytes (its tensors' names and alignment); 160 more for the header |
| ``arms/<arm>/gguf/model.gguf`` (quantize_gguf) | every matrix at the type's bits (fourbit.layouts.GGUF_TYPES: Q4_0 4.5, Q4_K_M 4.9, Q8_0 8.5 ...), the head and the table at 8.5 unless the arm names their type; a model whose rows the type's blocks do not divide, every matrix at 8.5 (llama-quantize's fallbacks) |
| ``arms/<arm>/gguf/dense.gguf`` (dequantize_gguf) | every parameter in float32 |
| ``eval/<corpus>/<engine>/baseline/dense.logits.npy`` (ppl_baseline_with_side) | for each engine that keeps fidelity sides (vLLM's), the baseline's logits of the compared windows: ``fidelity.windows`` (at most ``evaluation.max_windows``) x (window - 1) positions x the vocabulary, in float32 |
| everything else | records, windows, logs: ``SMALL`` per job |

The margin: the sum plus 10% (norms, biases, file headers and tokenizer files are each
below 1% of a model's bytes), plus ``ALLOWANCE`` for the corpus, records, logs and vLLM's
compile caches. A model fetched from the Hugging Face Hub lands in the Hub's cache
(``HF_HOME``), not under results/, and llama.cpp's build in ~/.cache/fourbit: neither is
counted.

Only outputs that do not exist yet are counted, so a finished study needs nothing and a
study with one arm added needs that arm's outputs. ``refuse_short_disk`` compares the
need with each filesystem the outputs land on (a symlinked results subfolder can be
another), before any job.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from fourbit.filesystems import existing_ancestor, filesystem, human
from fourbit.layouts import GGUF_TYPES
from fourbit.quantizers import shapes
from fourbit.schema import ConfigError

MARGIN = 0.10
ALLOWANCE = 256 * 10**6  # corpus, windows, records, logs, compile caches
SMALL = 10**6  # a job that writes records only
# bits per weight of the head and table a llama.cpp type picks (its matrices': GGUF_TYPES)
GGUF_WIDE = 8.5  # Q6_K, Q8_0: what Q4_K_M keeps its head in, and the fallbacks' widest
GGML_BITS = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q6_k": 6.5625, "q5_k": 5.5,
             "q5_0": 5.5, "q4_k": 4.5, "q4_0": 4.5}
# An importance matrix's bytes beyond its floats, per matrix (two tensors' names, shapes
# and alignment: 163 measured on the tiny model) and once (its header).
IMATRIX_OVERHEAD = 160
DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}
# What each output kind is called in the refusal; the kinds an arm has one of are counted.
WHAT = {"source": "the model as fetched or trained", "untied": "the untied model",
        "quantized": "quantized checkpoints", "four_bit": "shared 4-bit checkpoints",
        "dense": "float32 dense expansions",
        "gguf_base": "the f16 GGUF", "imatrix": "imatrix files", "gguf": "quantized GGUFs",
        "gguf_dense": "float32 GGUFs", "logits": "the baselines' kept logits"}
PER_ARM = {"quantized": "hf", "dense": "hf", "gguf": "gguf", "gguf_dense": "gguf"}
COUNTED = (*PER_ARM, "four_bit", "imatrix")  # kinds the refusal counts ("6 quantized checkpoints")


class DiskSpaceError(ConfigError):
    """A study whose outputs do not fit on the filesystem they would be written to."""


@dataclass(frozen=True)
class Output:
    """One output a job of the study would write, with its estimated bytes."""

    kind: str  # a key of WHAT
    path: Path
    bytes: int


@dataclass(frozen=True)
class Parameters:
    """A model's parameters by matrix, from its config.json (the untied model's matrices)."""

    linears: int  # every decoder linear, the head not included
    head: int
    embedding: int
    dtype_bits: int  # what the untied model stores them in
    tied: bool  # config.json ties the head to the embedding
    linear_inputs: int = 0  # the decoder linears' input widths (K) summed
    decoder_linears: int = 0  # how many there are

    @property
    def total(self) -> int:
        return self.linears + self.head + self.embedding


class StudyDisk:
    """The bytes each output of ``study`` (fourbit.config.Study) takes."""

    def __init__(self, study):
        self.study = study
        model = study.config["model"]
        self.trained_here = model["source"] in ("builtin", "synthetic")  # written in float32
        self.parameters = parameters(study.model_config, 32 if self.trained_here else None)
        self.gguf_fallbacks = any(arm.plan.get("llamacpp_fallback") for arm in study.arms.values())

    def bytes(self, kind: str, arm_id: str | None = None) -> int:
        """Bytes of one output of ``kind`` (a key of WHAT, or "records"); ``arm_id`` for
        the per-arm kinds (a shared pass's id for "four_bit")."""
        p = self.parameters
        if kind == "source":
            return self.trained_here * (p.total - p.head * p.tied) * 4
        if kind == "untied":
            return p.tied * p.total * p.dtype_bits // 8
        if kind in ("dense", "gguf_dense"):
            return p.total * 4
        if kind == "gguf_base":
            return p.total * 2
        if kind == "imatrix":  # per decoder linear a float32 sum of squares [K] and a count
            return 4 * (p.linear_inputs + p.decoder_linears) + IMATRIX_OVERHEAD * (
                p.decoder_linears + 1)
        if kind == "quantized":
            return quantized_bytes(p, self.study.arms[arm_id])
        if kind == "four_bit":  # the shared pass: no budget, and an 8-bit head or table
            arm = self.study.sensitivities[arm_id]  # is added after it, so it holds them dense
            dense = {k: False for k in ("quantize_head", "quantize_embedding") if arm.quant.get(k) == 8}
            return quantized_bytes(p, replace(arm, quant={**arm.quant, **dense}))
        if kind == "gguf":
            return gguf_bytes(p, self.study.arms[arm_id].quant, self.gguf_fallbacks)
        if kind == "logits":
            config = self.study.config
            windows = min(config["fidelity"]["windows"], config["evaluation"]["max_windows"])
            positions = windows * (config["evaluation"]["window"] - 1)
            return positions * self.study.model_config["vocab_size"] * 4
        if kind == "records":
            return SMALL
        raise KeyError(f"no estimate for outputs of kind {kind!r}")

    def megabytes(self, kind: str, arm_id: str | None = None) -> int:
        """A rule's ``disk_mb``: its output's estimate with the margin, in MB (10**6)."""
        return max(1, math.ceil(self.bytes(kind, arm_id) * (1 + MARGIN) / 1e6))

    def outputs(self, patterns: dict[str, str]) -> list[Output]:
        """Every output of a kind in ``patterns`` (kind -> the rule's output, with {model}
        and {arm}, {sensitivity} or {imatrix} unfilled, and {engine} for "logits") that
        this study makes, with its bytes."""
        study = self.study
        reads_gguf = bool(study.arms_of_kind("gguf")) or any(
            e.reads == "gguf" for e in study.runnable_engines)
        found = []
        for kind, pattern in patterns.items():
            if kind == "logits":  # the baseline's, per engine: {engine} open too
                for engine in study.runnable_engines:
                    if engine.keeps_fidelity_side:
                        path = Path(pattern.format(model=study.model_id, engine=engine.id,
                                                   arm="baseline"))
                        found.append(Output(kind, path, self.bytes(kind)))
                continue
            if kind in PER_ARM:
                ids = study.arms_of_kind(PER_ARM[kind])
            elif kind == "imatrix":
                ids = list(study.imatrices)
            elif kind == "four_bit":
                ids = list(study.sensitivities)
            else:
                ids = [None] if kind != "gguf_base" or reads_gguf else []
            for one in ids:
                path = Path(pattern.format(model=study.model_id, arm=one, imatrix=one,
                                           sensitivity=one))
                found.append(Output(kind, path, self.bytes(kind, one)))
        return found


def parameters(config: dict, dtype_bits: int | None = None) -> Parameters:
    """The parameters of the model config.json describes (fourbit.quantizers.shapes reads
    its matrices); ``dtype_bits`` overrides config.json's dtype (32 when absent)."""
    matrices = shapes.matrices_from_config(config)
    decoder = {name: nk for name, nk in matrices.linears.items() if name != matrices.head}
    head = math.prod(matrices.linears[matrices.head])
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    return Parameters(sum(n * k for n, k in decoder.values()), head,
                      math.prod(matrices.embedding_shape), dtype_bits or DTYPE_BITS.get(dtype, 32),
                      bool(config.get("tie_word_embeddings", True)),
                      sum(k for _, k in decoder.values()), len(decoder))


def quantized_bytes(p: Parameters, arm) -> int:
    """A fourbit arm's quantized checkpoint (fourbit.config.Arm: its quant and its plan)."""
    quant, group = arm.quant, arm.quant["group_size"]
    bits = {True: 4 + 32 / group, 8: 8 + 32 / group, False: p.dtype_bits}

    def width(setting) -> float:  # True (the arm's 4-bit grid), 8 or False (dense)
        return bits[8] if setting == 8 else bits[bool(setting)]

    dense = sum(n * k for n, k in arm.kept_dense.values())
    extra = quant.get("mixed_precision", {}).get("extra_bits", 0)
    total = ((p.linears - dense) * bits[True] + dense * p.dtype_bits + p.linears * extra
             + p.head * width(quant.get("quantize_head", True))
             + p.embedding * width(quant.get("quantize_embedding", False)))
    return math.ceil(total / 8)


def gguf_bytes(p: Parameters, quant: dict, fallbacks: bool) -> int:
    """A llama.cpp arm's GGUF; ``fallbacks``: the type's blocks do not divide some rows."""
    body = GGUF_WIDE if fallbacks else GGUF_TYPES[quant["type"]].bits
    head = GGML_BITS.get((quant.get("output_tensor_type") or "").lower(), max(body, GGUF_WIDE))
    table = GGML_BITS.get((quant.get("token_embedding_type") or "").lower(), max(body, GGUF_WIDE))
    return math.ceil((p.linears * body + p.head * head + p.embedding * table) / 8)


def refuse_short_disk(outputs: list[Output], results: str | os.PathLike) -> str:
    """Raise DiskSpaceError when the outputs that do not exist yet need more than the
    filesystem they land on has free (each filesystem on its own); else return a line
    saying what they need, or "" when nothing is left to write."""
    missing = [o for o in outputs if not os.path.lexists(o.path)]
    if not missing:
        return ""
    home = filesystem(results)
    by_mount: dict[Path, list[Output]] = {}
    for output in missing:
        by_mount.setdefault(filesystem(output.path).mount, []).append(output)
    lines = []
    for mount, group in sorted(by_mount.items()):
        where = filesystem(group[0].path)
        home_here = mount == home.mount
        need = sum(o.bytes for o in group) * (1 + MARGIN) + ALLOWANCE * home_here
        folder = _folder_name(results, group)
        breakdown = (f"{_breakdown(group)}; +{MARGIN:.0%}"
                     + (f", +{human(ALLOWANCE)} for the corpus, records and logs" if home_here else ""))
        if need > where.free:
            raise DiskSpaceError(
                f"{folder} is on a filesystem ({where.mount}, {where.kind}) with "
                f"{human(where.free)} free; this study needs about {human(need)} more there "
                f"({breakdown}). Free space, or point results: elsewhere (outputs that exist "
                "are not counted: a study stopped for space needs less when run again)")
        lines.append(f"{human(need)} on {folder} ({human(where.free)} free): {breakdown}")
    return "disk: the outputs still to write need about " + "; and ".join(lines)


def _folder_name(results: str | os.PathLike, group: list[Output]) -> str:
    """``results/``, or the results subfolder (a mount, a symlink) that lies on another
    filesystem: the topmost folder above the outputs still on theirs."""
    top = Path(os.path.abspath(results))
    inside = existing_ancestor(group[0].path)
    device = os.stat(inside).st_dev
    while inside != top and top in inside.parents and os.stat(inside.parent).st_dev == device:
        inside = inside.parent
    if inside == top or top not in inside.parents:
        return f"{results}/"
    return f"{Path(results) / inside.relative_to(top)}/"


def _breakdown(group: list[Output]) -> str:
    """"the untied model 2.5 GB; 6 quantized checkpoints 4.1 GB; ..." in WHAT's order."""
    parts = []
    for kind, what in WHAT.items():
        of_kind = [o for o in group if o.kind == kind]
        if of_kind:
            if kind in COUNTED:  # "1 quantized checkpoint", "6 quantized checkpoints"
                what = f"{len(of_kind)} {what if len(of_kind) > 1 else what.removesuffix('s')}"
            parts.append(f"{what} {human(sum(o.bytes for o in of_kind))}")
    return "; ".join(parts)
