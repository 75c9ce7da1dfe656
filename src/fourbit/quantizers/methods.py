"""Quantization methods by name: what `quant.method` in an arm's config runs.

A method turns the untied checkpoint's linear weights into QuantizedWeights and
names the on-disk format they are written in. Adding one: a class here (or in
its own module) decorated with @register_method, and its block under
$defs.methods in src/fourbit/schemas/config.schema.yaml.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from fourbit.checkpoints.hf import TensorReader
from fourbit.progress import Progress
from fourbit.quant.grid import Grid, quantize_rtn
from fourbit.quant.hessian import Hessian
from fourbit.quant.qweight import QuantizedWeight
from fourbit.quantizers.shapes import symmetric_gptq_else_compressed

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


def calibration_tokens(job: QuantizeJob, heldout: int = 0) -> torch.Tensor:
    """Token windows [S + heldout, T] from the corpus's calibration split, as the arm's
    config says (fourbit.quantizers.calibration.draw_windows): S windows to fit, then
    ``heldout`` more to judge by."""
    from fourbit.quantizers.calibration import calibration_ids, draw_windows

    if job.calibration_text is None:
        raise ValueError(
            f"method {job.quant['method']} with search {job.quant.get('search')!r} reads the corpus's "
            "calibration split (its windows fit the arm or check its search), and none was given; "
            "pass calibration_text, or use search minmax without importance, which reads no data")
    ids = calibration_ids(job.model_dir, job.calibration_text)
    return draw_windows(ids, job.quant["calibration"], heldout)


def heldout_tokens(job: QuantizeJob) -> torch.Tensor:
    """The calibration block's held-out windows alone [heldout, T]: text no quantizer fits."""
    held = job.quant["calibration"]["heldout"]
    return calibration_tokens(job, held)[-held:]


def quantize_each(job: QuantizeJob, quantize_one) -> dict[str, QuantizedWeight]:
    """Apply ``quantize_one(name, W [N, K]) -> QuantizedWeight`` to every chosen linear."""
    reader = TensorReader(job.model_dir)
    progress = Progress("quantizing", len(job.linears), "layers")
    qweights = {}
    for name in job.linears:
        qweights[name] = quantize_one(name, reader.get(f"{name}.weight").float())
        progress.update(note=name)
    return qweights


def search_of(quant: dict) -> dict:
    """The arm's grid search as Grid.find_params / quantize_rtn / gptq_quantize take it."""
    return {"search": quant["search"], "shrink_steps": quant["shrink_steps"]}


class _HeldOutHessian(Hessian):
    """A layer input's Hessian split by token: the first ``fit_tokens`` rows it is fed go
    into ``.h`` (what the quantizer fits), the rest into ``.heldout`` (what the guard judges
    by). walk.quantize_sequential feeds a layer's inputs window by window in sample order,
    so with the held-out windows last, ``.h`` is exactly the calibration windows' H.
    """

    def __init__(self, k: int, dtype: torch.dtype = torch.float32, *, fit_tokens: int):
        super().__init__(k, dtype)
        self.fit_tokens = fit_tokens
        self.heldout = Hessian(k, dtype)

    def add_batch(self, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1])  # [..., K] -> [n, K]
        fit = max(0, min(len(rows), self.fit_tokens - self.n))
        if fit:
            super().add_batch(rows[:fit])
        if fit < len(rows):
            self.heldout.add_batch(rows[fit:])


def quantize_walking(
    job: QuantizeJob, quantize_one, *, heldout: bool = False
) -> tuple[dict[str, QuantizedWeight], dict]:
    """Sequential calibration: ``quantize_one(name, W, H, H_heldout) -> QuantizedWeight``
    per linear.

    Layer i is measured on the outputs of layers 0..i-1 as already quantized. With
    ``heldout``, calibration.heldout more windows (disjoint from the calibration ones) go
    through the same walk, and each linear also gets their Hessian H_heldout, the same
    layer's inputs on text the quantizer never fitted; otherwise H_heldout is None.
    The walk builds its Hessians with the factory given to it: _HeldOutHessian here.
    """
    from fourbit.quantizers import walk

    n_held = job.quant["calibration"]["heldout"] if heldout else 0
    samples = calibration_tokens(job, n_held)  # [S + n_held, T], held-out windows last
    fit_tokens = (len(samples) - n_held) * samples.shape[1]
    latest: list[_HeldOutHessian] = []

    def make_hessian(k, dtype=torch.float32):
        latest[:] = [_HeldOutHessian(k, dtype, fit_tokens=fit_tokens)]
        return latest[0]

    qweights: dict[str, QuantizedWeight] = {}

    def quantize_linear(name, weight, hessian):
        if name not in job.linears:  # the head, when quantize_head is off
            return weight
        h_heldout = None
        if heldout:
            if not latest or latest[0].h is not hessian:
                raise RuntimeError(f"{name}: walk.quantize_sequential did not build this "
                                   "Hessian with make_hessian; the held-out split needs it")
            h_heldout = latest[0].heldout.h
        qweights[name] = quantize_one(name, weight, hessian, h_heldout)
        return qweights[name].dequantize()

    info = walk.quantize_sequential(
        job.model_dir, samples, quantize_linear, head=walk.HEAD in job.linears,
        make_hessian=make_hessian if heldout else Hessian,
    )
    return qweights, {**info, "tokens": fit_tokens, "heldout_tokens": n_held * samples.shape[1]}


def heldout_error(weight: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """tr(dW H dW^T) / tr(W H W^T): the relative output error ||X dW^T||^2 / ||X W^T||^2
    on the tokens whose Hessian H is (hessian.py: H = 2/n X^T X, so the 2/n cancels)."""
    dw = weight - w_hat  # [N, K]
    total = (weight @ h * weight).sum().item()
    return (dw @ h * dw).sum().item() / total if total > 0 else 0.0


class HeldOutGuard:
    """Keeps, per layer, the searched grid's result or plain min/max rounding's, whichever
    has the smaller output error on held-out activations, and records which was kept.

    The search fits a proxy (a weighted weight error, or GPTQ's loss on the calibration
    windows); this checks it against the plain grid on what matters, the layer's output,
    on text neither was fitted to. facts() is what the arm's manifest records.
    """

    def __init__(self, search: str):
        self.search = search
        self.errors: dict[str, dict[str, float]] = {}  # layer -> {search: e, "minmax": e}
        self.kept: dict[str, str] = {}

    def choose(self, name, weight, h_heldout, searched: QuantizedWeight, plain: QuantizedWeight):
        return self.keep(name, heldout_error(weight, searched.dequantize(), h_heldout),
                         heldout_error(weight, plain.dequantize(), h_heldout), searched, plain)

    def keep(self, name, e_search: float, e_plain: float, searched: QuantizedWeight,
             plain: QuantizedWeight) -> QuantizedWeight:
        """The one of the two with the smaller held-out error (the search on a tie)."""
        self.errors[name] = {self.search: e_search, "minmax": e_plain}
        self.kept[name] = self.search if e_search <= e_plain else "minmax"
        return searched if e_search <= e_plain else plain

    def facts(self, heldout_windows: int) -> dict:
        return {
            "search": self.search,
            "heldout_windows": heldout_windows,
            "kept_search": [n for n, k in self.kept.items() if k == self.search],
            "kept_minmax": [n for n, k in self.kept.items() if k == "minmax"],
            "heldout_relative_error": self.errors,
        }


ALGORITHM = {  # what the manifest (and the report's table) calls each search
    "minmax": "plain min/max rounding",
    "shrink": "shrink search on squared weight error",
    "weighted": "llama.cpp-style weighted search",
}


def quantize_embedding(job: QuantizeJob, grid: Grid, search: dict,
                       guard: HeldOutGuard | None) -> dict[str, QuantizedWeight]:
    """The input embedding [V, H] by RTN when the arm asks for it: a row per token, groups
    along H. Its input is a token id, not activations, so the search is unweighted; with
    a ``guard``, the table keeps the searched grid or plain min/max rounding, whichever
    looks up the held-out windows' tokens with the smaller error."""
    if job.embedding is None:
        return {}
    table = TensorReader(job.model_dir).get(f"{job.embedding}.weight").float()  # [V, H]
    searched = quantize_rtn(table, grid, **search)
    if guard is None:
        return {job.embedding: searched}
    counts = torch.bincount(heldout_tokens(job).flatten(), minlength=len(table)).float()  # [V]
    plain = quantize_rtn(table, grid, search="minmax")
    return {job.embedding: guard.keep(job.embedding, lookup_error(table, searched.dequantize(), counts),
                                      lookup_error(table, plain.dequantize(), counts), searched, plain)}


def lookup_error(table: torch.Tensor, table_hat: torch.Tensor, counts: torch.Tensor) -> float:
    """heldout_error for an embedding: its output for token v is row v, so the relative
    output error over tokens seen ``counts`` [V] times is sum_v c_v ||dW_v||^2 / sum_v c_v ||W_v||^2."""
    total = (counts @ table.square()).sum().item()  # [V] @ [V, H] -> [H]
    return (counts @ (table - table_hat).square()).sum().item() / total if total > 0 else 0.0


def quantize_rtn_arm(job: QuantizeJob, *, weigh_by_activations: bool
                     ) -> tuple[dict[str, QuantizedWeight], dict]:
    """Round-to-nearest of every chosen linear, each group's grid found by the arm's search.

    Plain min/max rounding reads no data. Any other search walks the calibration split as
    GPTQ does (layer i measured on layers 0..i-1 as quantized), and each layer keeps the
    searched grid only if it beats plain min/max on the held-out windows (HeldOutGuard):
    a search fits a proxy (weight error, weighted or not), the guard judges the output.
    ``weigh_by_activations``: the search weights each input column by diag(H) of the
    fitted calibration windows. The input embedding, if the job has one, is rounded on
    the same grid and goes through the same guard. Returns the weights and the
    manifest's facts.
    """
    grid, search = grid_of(job.quant), search_of(job.quant)
    algorithm = f"rtn, {ALGORITHM[search['search']]}" + (" weighted by diag(H)" * weigh_by_activations)
    guarded = search["search"] != "minmax"
    table = {"embedding": "rtn" if job.embedding else "dense"}
    if not guarded and not weigh_by_activations:
        qweights = quantize_each(job, lambda name, w: quantize_rtn(w, grid, **search))
        return {**qweights, **quantize_embedding(job, grid, search, None)}, {"algorithm": algorithm, **table}
    guard = HeldOutGuard(search["search"])

    def quantize_one(name, weight, hessian, h_heldout):
        importance = hessian.diagonal().float() if weigh_by_activations else None
        searched = quantize_rtn(weight, grid, **search, importance=importance)
        if not guarded:
            return searched
        return guard.choose(name, weight, h_heldout, searched, quantize_rtn(weight, grid, search="minmax"))

    qweights, info = quantize_walking(job, quantize_one, heldout=guarded)
    qweights.update(quantize_embedding(job, grid, search, guard if guarded else None))
    facts = {**info, "algorithm": algorithm, **table}
    if guarded:
        facts["heldout_guard"] = guard.facts(job.quant["calibration"]["heldout"])
    return qweights, facts


@register_method("cpu_int4")
class CpuInt4Method:
    """Asymmetric round-to-nearest per group, each group's grid found by ``search``
    (quantize_rtn_arm); with ``importance: activation`` the search weights each input
    column by the calibration activations' second moment (diag of H, as llama.cpp's
    imatrix). The embedding, if asked for, is rounded on the same grid and guarded too.
    """

    def format(self, quant: dict) -> str:
        return "cpu_int4"

    def quantize(self, job: QuantizeJob) -> tuple[dict[str, QuantizedWeight], dict]:
        qweights, facts = quantize_rtn_arm(job, weigh_by_activations=job.quant["importance"] == "activation")
        return qweights, {**facts, "head": "rtn"}


@register_method("rtn")
class RoundToNearestMethod:
    """Round-to-nearest, plain by default: the baseline GPTQ is measured against."""

    format = staticmethod(symmetric_gptq_else_compressed)

    def quantize(self, job: QuantizeJob) -> tuple[dict[str, QuantizedWeight], dict]:
        qweights, facts = quantize_rtn_arm(job, weigh_by_activations=False)
        return qweights, {**facts, "head": "rtn"}


@register_method("gptq")
class GptqMethod:
    """Hessian-based GPTQ, sequential over layers; the head by GPTQ or RTN.

    Each group's grid is found by ``search`` with diag(H) as the importance; unless
    that is plain min/max, each layer is quantized both ways and keeps whichever has
    the smaller output error on held-out activations (HeldOutGuard). The input embedding,
    if asked for, is looked up, not multiplied, so there is no Hessian to feed back
    through: it is rounded on the same grid (quantize_embedding) and guarded the same way.
    """

    format = staticmethod(symmetric_gptq_else_compressed)

    def quantize(self, job: QuantizeJob) -> tuple[dict[str, QuantizedWeight], dict]:
        from fourbit.quant.gptq import gptq_quantize
        from fourbit.quantizers.walk import HEAD

        quant, grid, search = job.quant, grid_of(job.quant), search_of(job.quant)
        damping: dict[str, float] = {}
        guarded = search["search"] != "minmax"
        guard = HeldOutGuard(search["search"])

        def one_way(name, weight, hessian, search):
            if name == HEAD and quant["head_method"] == "rtn":
                return quantize_rtn(weight, grid, **search, importance=hessian.diagonal().float())
            qweight, info = gptq_quantize(
                weight, hessian, grid,
                block_size=quant["block_size"], damp_percent=quant["damp_percent"],
                act_order=quant["act_order"], static_groups=quant["static_groups"], layer_name=name,
                **search,
            )
            damping[name] = max(damping.get(name, 0.0), info["damp_percent_used"])  # of both ways
            return qweight

        def quantize_one(name, weight, hessian, h_heldout):
            searched = one_way(name, weight, hessian, search)
            if not guarded:
                return searched
            plain = one_way(name, weight, hessian, {**search, "search": "minmax"})
            return guard.choose(name, weight, h_heldout, searched, plain)

        qweights, info = quantize_walking(job, quantize_one, heldout=guarded)
        qweights.update(quantize_embedding(job, grid, search, guard if guarded else None))
        raised = {name: d for name, d in damping.items() if d != quant["damp_percent"]}
        facts = {
            **info,
            "algorithm": f"gptq, {ALGORITHM[search['search']]} weighted by diag(H)",
            "act_order": quant["act_order"],
            "static_groups": quant["static_groups"],
            "head": quant["head_method"] if HEAD in job.linears else "not quantized",
            "embedding": "rtn" if job.embedding else "dense",
            "damping_raised": raised,
        }
        if guarded:
            facts["heldout_guard"] = guard.facts(quant["calibration"]["heldout"])
        return qweights, facts
