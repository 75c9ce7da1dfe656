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


class Method(Protocol):
    format: str

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


@register_method("cpu_int4")
class CpuInt4:
    """Asymmetric round-to-nearest per group, with a search over shrunken ranges."""

    format = "cpu_int4"

    def quantize(self, job: QuantizeJob) -> tuple[dict[str, QuantizedWeight], dict]:
        grid = grid_of(job.quant)
        reader = TensorReader(job.model_dir)
        progress = Progress("quantizing", len(job.linears), "layers")
        qweights = {}
        for name in job.linears:
            weight = reader.get(f"{name}.weight").float()  # [N, K]
            qweights[name] = quantize_rtn(weight, grid, shrink_steps=job.quant["shrink_steps"])
            progress.update(note=name)
        return qweights, {"algorithm": "rtn with shrink search", "head": "rtn"}
