"""The reference engine: Hugging Face transformers on the CPU.

Dense checkpoints load as usual. Quantized checkpoints (any fourbit format) load
their dense tensors into the model and replace each quantized nn.Linear by an
``Int4Linear`` that runs PyTorch's CPU int4 kernel (tinygemm) on the stored
codes: the 4-bit weights are executed in 4 bits, not expanded first. That is
what makes comparing an arm with its dense expansion (the control) meaningful.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fourbit.checkpoints.hf import skeleton
from fourbit.checkpoints.quantized import is_quantized, read_quantized
from fourbit.engines.base import ComparesPositions, Numerics, WindowScore
from fourbit.kernels import tinygemm
from fourbit.metrics.kl import FULL, kl_from_logits
from fourbit.progress import Progress
from fourbit.quant.int8 import Int8Weight
from fourbit.quant.qweight import QuantizedWeight
from fourbit.threads import torch_threads

log = logging.getLogger("fourbit")
BATCH_WINDOWS = 4
DEQUANT_ROWS = 32  # rows from which the packed weight is expanded instead (see Int4Linear)
DTYPES = {"float32": torch.float32}


class Int4Linear(torch.nn.Module):
    """y = x W_hatᵀ (+ b) with W_hat held in tinygemm's packed int4 layout.

    Two paths over the one packed copy, as in the vLLM plugin: fewer than
    DEQUANT_ROWS rows (decoding) run the int4 kernel itself; more rows (scoring a
    window) would cost the kernel a dequantization per row, so the weight is
    expanded once from the packed layout and the ordinary GEMM runs. Both read
    the same packed bytes, so the control checks the packing either way.
    """

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.group_size = qweight.group_size
        packed, scales_and_zeros = tinygemm.to_tinygemm(qweight, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias)
        self._expanded: torch.Tensor | None = None

    def expanded(self) -> torch.Tensor:
        """W_hat [N, K] from the kernel's packed layout, computed once."""
        if self._expanded is None:
            weight = None
            if tinygemm.supports_direct_dequant(self.out_features, self.in_features):
                weight = tinygemm.dequantize_packed(self.packed, self.scales_and_zeros, self.group_size,
                                                    self.out_features, self.in_features)
            if weight is None:
                raise ValueError(
                    f"tinygemm's packed layout is not understood for N={self.out_features} "
                    f"K={self.in_features} on this host; cannot expand it for multi-row batches"
                )
            self._expanded = weight.to(self.scales_and_zeros.dtype)
        return self._expanded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < DEQUANT_ROWS:
            y = tinygemm.int4_linear(x, self.packed, self.scales_and_zeros, self.group_size, self.out_features)
        else:
            y = torch.nn.functional.linear(x, self.expanded().to(x.dtype))  # [..., K] -> [..., N]
        return y if self.bias is None else y + self.bias


def runtime(checkpoint: Path, settings: dict) -> str:
    kind = (
        f"int4: tinygemm (aten._weight_int4pack_mm_for_cpu) below {DEQUANT_ROWS} rows, "
        "GEMM on the weight expanded from tinygemm's packed layout above"
        if is_quantized(checkpoint) else "dense"
    )
    return f"transformers {settings['dtype']} {kind}"


def numerics(checkpoint: Path, settings: dict, rows: int) -> Numerics:
    """Beyond the dense expansion, only the engine's own dtype rounds: at or above
    DEQUANT_ROWS the weight is expanded exactly; below, tinygemm runs in that dtype."""
    return "exact" if settings["dtype"] == "float32" else "bf16_activations"


def load_model(checkpoint: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if not is_quantized(checkpoint):
        return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    _, dense, qweights = read_quantized(checkpoint)
    model = skeleton(checkpoint)  # every tensor on the meta device, nothing allocated
    state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in dense.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"{checkpoint}: tensors the model does not have: {sorted(unexpected)[:5]}")
    for name, qweight in qweights.items():
        parent_name, _, child = name.rpartition(".")
        module = model.get_submodule(name)
        if isinstance(qweight, Int8Weight):  # no 8-bit kernel here: its exact W_hat, dense
            module.weight = torch.nn.Parameter(qweight.dequantize(dtype), requires_grad=False)
            continue
        if isinstance(module, torch.nn.Embedding):
            # A lookup reads rows, no kernel: the table's W_hat holds exactly those rows.
            # The module itself stays (an architecture's embedding may scale its output).
            module.weight = torch.nn.Parameter(qweight.dequantize(dtype), requires_grad=False)
            continue
        bias = None if module.bias is None else module.bias.to(dtype)
        setattr(model.get_submodule(parent_name), child, Int4Linear(qweight, bias, dtype))
    still_missing = sorted(n for n in missing if n.rpartition(".")[0] not in qweights)
    if still_missing:
        raise ValueError(f"{checkpoint}: missing tensors {still_missing[:5]}")
    # Rotary inverse frequencies are non-persistent buffers: rebuild them off the meta device.
    rotary = model.get_decoder().rotary_emb
    rotary.__init__(rotary.config)
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if on_meta:
        raise ValueError(f"{checkpoint}: tensors left unloaded: {on_meta[:5]}")
    return model.eval()


def score_windows(checkpoint: Path, windows: list[list[int]], settings: dict,
                  threads: int) -> list[WindowScore]:
    with torch_threads(settings["threads"]):
        return _score(load_model(checkpoint, DTYPES[settings["dtype"]]), checkpoint, windows)


def _score(model: torch.nn.Module, checkpoint: Path, windows: list[list[int]]) -> list[WindowScore]:
    progress = Progress(f"scoring {checkpoint.name}", len(windows), "windows")
    results: list[WindowScore] = []
    with torch.inference_mode():
        for start in range(0, len(windows), BATCH_WINDOWS):
            batch = torch.tensor(windows[start : start + BATCH_WINDOWS])  # [B, W]
            logits = model(batch).logits.float()  # [B, W, V]
            logprobs = torch.log_softmax(logits[:, :-1], dim=-1)  # predict positions 1..W-1
            token_logprobs = logprobs.gather(-1, batch[:, 1:, None]).squeeze(-1)  # [B, W-1]
            for row in token_logprobs:
                results.append({"nll_sum": -row.double().sum().item(), "tokens": row.numel()})
            progress.update(len(batch))
    return results


def _greedy(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Exactly ``new_tokens`` argmax tokens after each prompt (EOS does not stop), with a KV
    cache; prompts of one length run as one batch, so decode steps are few-row (int4 kernel)."""
    continuations: list[list[int] | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    for indices in by_length.values():
        out = model(torch.tensor([prompts[i] for i in indices]), use_cache=True)
        token = out.logits[:, -1].argmax(-1)  # [B]
        generated = [token]
        for _ in range(new_tokens - 1):
            out = model(token[:, None], past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1].argmax(-1)
            generated.append(token)
        for i, row in zip(indices, torch.stack(generated, 1).tolist(), strict=True):
            continuations[i] = row
    return continuations


def compare_with_baseline(
    arm_checkpoint: Path,
    baseline_checkpoint: Path,
    windows: list[list[int]],
    settings: dict,
    threads: int,
    *,
    prompts: list[list[int]],
    new_tokens: int,
) -> dict:
    """KL(P_base || P_arm) from full logits and top-1 agreement at positions 1..W-1 of each
    window, and both models' greedy continuations (see fourbit.metrics.fidelity). Both models are
    held at once."""
    dtype = DTYPES[settings["dtype"]]
    with torch_threads(settings["threads"]):
        baseline = load_model(Path(baseline_checkpoint), dtype)
        arm = load_model(Path(arm_checkpoint), dtype)
        progress = Progress(f"comparing {Path(arm_checkpoint).name} with its baseline",
                            len(windows), "windows")
        with torch.inference_mode():
            window_kl, window_top1 = _full_kl(baseline, arm, windows, progress)
            greedy_baseline = _greedy(baseline, prompts, new_tokens)
            greedy_arm = _greedy(arm, prompts, new_tokens)
    return {
        "method": FULL,
        "window_kl": window_kl,
        "window_top1": window_top1,
        "greedy_baseline": greedy_baseline,
        "greedy_arm": greedy_arm,
        "runtime": runtime(Path(arm_checkpoint), settings),
        "baseline_runtime": runtime(Path(baseline_checkpoint), settings),
    }


def _full_kl(baseline: torch.nn.Module, arm: torch.nn.Module, windows: list[list[int]],
             progress: Progress) -> tuple[list[list[float]], list[list[bool]]]:
    """Per window, KL and top-1 agreement at positions 1..W-1 (kl_from_logits)."""
    window_kl, window_top1 = [], []
    for start in range(0, len(windows), BATCH_WINDOWS):
        batch = torch.tensor(windows[start : start + BATCH_WINDOWS])  # [B, W]
        base_logits = baseline(batch).logits[:, :-1]  # [B, W-1, V]: row t-1 predicts token t
        arm_logits = arm(batch).logits[:, :-1]
        for row in range(len(batch)):
            kl, top1 = kl_from_logits(base_logits[row], arm_logits[row])
            window_kl.append(kl)
            window_top1.append(top1)
        progress.update(len(batch))
    return window_kl, window_top1


class ReferenceEngine(ComparesPositions):
    """The engine table's "reference" (fourbit.engines.ENGINES): the functions above."""

    score_windows = staticmethod(score_windows)
    runtime = staticmethod(runtime)
    numerics = staticmethod(numerics)
    compare_with_baseline = staticmethod(compare_with_baseline)
