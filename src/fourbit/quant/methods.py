"""Quantization methods by name: what `quant.method` in an arm's config runs.

A method turns the untied checkpoint's linear weights into QuantizedWeights and
names the on-disk format they are written in. Adding one: a class here (or in
its own module) decorated with @register_method, and its block under
$defs.methods in workflow/schemas/config.schema.yaml.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fourbit.checkpoint import TensorReader
from fourbit.progress import Progress
from fourbit.quant.grid import Grid, quantize_rtn
from fourbit.quant.qweight import QuantizedWeight

log = logging.getLogger("fourbit")


@dataclass
class QuantizeJob:
    """Everything a method may read: the checkpoint, which linears, the arm's config."""

    model_dir: Path
    linears: dict[str, tuple[int, int]]  # module name -> (out_features N, in_features K)
    quant: dict
    calibration_text: Path | None
    threads: int
    embedding: str | None = None  # the input embedding's module name, if the arm quantizes it


class Method(Protocol):
    def format(self, quant: dict) -> str:
        """The on-disk format (fourbit.formats) this method's checkpoints are written in."""

    def quantize(self, job: QuantizeJob) -> tuple[dict[str, QuantizedWeight], dict]:
        """Return the quantized weights by module name, and facts for the arm's manifest."""


METHODS: dict[str, Method] = {}


def register_method(name: str):
    def add(cls):
        METHODS[name] = cls()
        return cls

    return add


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"quantization method {name!r} is not known; allowed: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def grid_of(quant: dict) -> Grid:
    return Grid(bits=quant["bits"], group_size=quant["group_size"], sym=quant["sym"])


def calibration_tokens(job: QuantizeJob):
    """Token windows [S, T] from the corpus's calibration split, as the arm's config says."""
    from transformers import AutoTokenizer

    from fourbit.quant.calibration import calibration_samples

    if job.calibration_text is None:
        raise ValueError(f"method {job.quant['method']} needs the corpus's calibration split")
    spec = job.quant["calibration"]
    tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    ids = tokenizer(job.calibration_text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    return calibration_samples(ids, spec["samples"], spec["seq_len"], spec["seed"])


def quantize_each(job: QuantizeJob, quantize_one) -> dict[str, QuantizedWeight]:
    """Apply ``quantize_one(name, W [N, K]) -> QuantizedWeight`` to every chosen linear."""
    reader = TensorReader(job.model_dir)
    progress = Progress("quantizing", len(job.linears), "layers")
    qweights = {}
    for name in job.linears:
        qweights[name] = quantize_one(name, reader.get(f"{name}.weight").float())
        progress.update(note=name)
    return qweights


def quantize_embedding(job: QuantizeJob, grid: Grid, shrink_steps: int) -> dict[str, QuantizedWeight]:
    """The input embedding [V, H] by RTN when the arm asks for it: a row per token, groups
    along H. Calibration says nothing about it (its input is a token id, not activations)."""
    if job.embedding is None:
        return {}
    table = TensorReader(job.model_dir).get(f"{job.embedding}.weight").float()  # [V, H]
    return {job.embedding: quantize_rtn(table, grid, shrink_steps=shrink_steps)}


def quantize_walking(job: QuantizeJob, quantize_one) -> tuple[dict[str, QuantizedWeight], dict]:
    """Sequential calibration: ``quantize_one(name, W, H) -> QuantizedWeight`` per linear.

    Layer i is measured on the outputs of layers 0..i-1 as already quantized.
    """
    from fourbit.quant.walk import HEAD, quantize_sequential

    qweights: dict[str, QuantizedWeight] = {}

    def quantize_linear(name, weight, hessian):
        if name not in job.linears:  # the head, when quantize_head is off
            return weight
        qweights[name] = quantize_one(name, weight, hessian)
        return qweights[name].dequantize()

    info = quantize_sequential(
        job.model_dir, calibration_tokens(job), quantize_linear, head=HEAD in job.linears
    )
    return qweights, info


def symmetric_gptq_else_compressed(quant: dict) -> str:
    """vLLM's GPTQ loader refuses sym=False; asymmetric grids go to compressed-tensors."""
    return "gptq" if quant["sym"] else "compressed_tensors"


@register_method("cpu_int4")
class CpuInt4:
    """Asymmetric round-to-nearest per group, with a search over shrunken ranges.

    With ``importance: activation`` the search weights each input column's
    squared error by the calibration activations' second moment (diag of H),
    measured sequentially like GPTQ, instead of treating all columns alike.
    """

    def format(self, quant: dict) -> str:
        return "cpu_int4"

    def quantize(self, job: QuantizeJob) -> tuple[dict[str, QuantizedWeight], dict]:
        grid, steps = grid_of(job.quant), job.quant["shrink_steps"]
        embedding = quantize_embedding(job, grid, steps)
        table = {"embedding": "rtn" if embedding else "dense"}
        if job.quant["importance"] == "none":
            qweights = quantize_each(job, lambda name, w: quantize_rtn(w, grid, shrink_steps=steps))
            return {**qweights, **embedding}, {
                "algorithm": "rtn, shrink search on squared weight error", "head": "rtn", **table}

        def weighted(name, weight, hessian):
            return quantize_rtn(weight, grid, shrink_steps=steps, importance=hessian.diagonal().float())

        qweights, info = quantize_walking(job, weighted)
        return {**qweights, **embedding}, {
            **info, "algorithm": "rtn, shrink search weighted by diag(H)", "head": "rtn", **table}


@register_method("rtn")
class RoundToNearest:
    """Plain round-to-nearest: the baseline GPTQ is measured against."""

    format = staticmethod(symmetric_gptq_else_compressed)

    def quantize(self, job: QuantizeJob) -> tuple[dict[str, QuantizedWeight], dict]:
        grid, steps = grid_of(job.quant), job.quant["shrink_steps"]
        qweights = quantize_each(job, lambda name, w: quantize_rtn(w, grid, shrink_steps=steps))
        return qweights, {"algorithm": "rtn", "head": "rtn"}


@register_method("gptq")
class Gptq:
    """Hessian-based GPTQ, sequential over layers; the head by GPTQ or RTN."""

    format = staticmethod(symmetric_gptq_else_compressed)

    def quantize(self, job: QuantizeJob) -> tuple[dict[str, QuantizedWeight], dict]:
        from fourbit.quant.gptq import gptq_quantize
        from fourbit.quant.walk import HEAD

        quant, grid = job.quant, grid_of(job.quant)
        damping: dict[str, float] = {}

        def quantize_one(name, weight, hessian):
            if name == HEAD and quant["head_method"] == "rtn":
                return quantize_rtn(weight, grid, shrink_steps=1)
            qweight, info = gptq_quantize(
                weight, hessian, grid,
                block_size=quant["block_size"], damp_percent=quant["damp_percent"],
                act_order=quant["act_order"], static_groups=quant["static_groups"], layer_name=name,
            )
            damping[name] = info["damp_percent_used"]
            return qweight

        qweights, info = quantize_walking(job, quantize_one)
        raised = {name: d for name, d in damping.items() if d != quant["damp_percent"]}
        return qweights, {
            **info,
            "algorithm": "gptq",
            "act_order": quant["act_order"],
            "static_groups": quant["static_groups"],
            "head": quant["head_method"] if HEAD in job.linears else "not quantized",
            "damping_raised": raised,
        }
