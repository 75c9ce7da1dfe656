"""Walk a Llama-style decoder layer by layer, handing each linear's Hessian to a quantizer.

Sequential, as IST-DASLab/gptq's "true-sequential": decoder layer i is measured on
the outputs of layers 0..i-1 with their weights already quantized, and inside a
layer each group of linears is measured after the groups before it are quantized:

    q/k/v (one shared input) -> o -> gate/up (one shared input) -> down

then the untied head on the final norm's outputs. Only one decoder layer's weights,
Hessians and activations are in memory at a time: the model is a skeleton on the
meta device, and a layer's weights are read from the safetensors files when it is
reached and dropped after.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fourbit.checkpoints.hf import CheckpointError, TensorReader, skeleton
from fourbit.progress import Progress
from fourbit.quant.hessian import Hessian
from fourbit.quantizers.shapes import HEAD, LAYER_GROUPS

# Within a layer, in forward order; each group's members share one input. The same
# table decides which linears fall back to dense together (fourbit.quantizers.shapes).
GROUPS = LAYER_GROUPS

# (name, W [N, K] float32, H [K, K]) -> W_hat [N, K]; W and H are read-only.
QuantizeLinear = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


class _Stop(Exception):
    """Ends a forward pass early: a hook has what it came for."""


def quantize_sequential(
    model_dir: Path,
    samples: torch.Tensor,
    quantize_linear: QuantizeLinear,
    *,
    head: bool = True,
    make_hessian: Callable[[int], Hessian] = Hessian,
) -> dict:
    """Call ``quantize_linear`` once per decoder linear (and the head) with its Hessian.

    samples: int64 token ids [S, T], e.g. from calibration.calibration_samples.
    make_hessian(K) builds each accumulator; a caller that splits the samples (held-out
    windows, fourbit.quantizers.methods) passes its own Hessian subclass.
    The returned W_hat replaces W for every later measurement; keeping what was
    stored (the QuantizedWeight) is the caller's business. Runs in float32.
    """
    start = time.monotonic()
    if samples.dim() != 2:
        raise ValueError(f"samples must be token ids [S, T], got shape {tuple(samples.shape)}")
    model = skeleton(model_dir)
    _check_shape(model)
    reader = TensorReader(model_dir)
    if head and f"{HEAD}.weight" not in reader.names():
        raise CheckpointError(f"{model_dir}: no {HEAD}.weight (tied head?); untie it first")
    base, calls = model.model, 0
    progress = Progress("quantize_sequential", len(base.layers) + head, "layers")
    with torch.no_grad():
        inputs, layer_kwargs = _capture_inputs(base, reader, samples)  # [1, T, D] per sample
        for i, layer in enumerate(base.layers):
            prefix = f"model.layers.{i}."
            _load(layer, prefix, reader)
            for group in GROUPS:
                modules = [layer.get_submodule(name) for name in group]
                h = _input_hessian(layer, modules[0], inputs, layer_kwargs[i], make_hessian)
                for name, module in zip(group, modules, strict=True):
                    w = module.weight.detach()
                    w_hat = _checked(quantize_linear(prefix + name, w, h), w.shape, prefix + name)
                    # A linear kept dense (quantize_head off, fallback: dense) comes back as
                    # itself: measured for the layers after it, not counted as quantized.
                    calls += w_hat is not w
                    w.copy_(w_hat)
            inputs = [layer(x, **layer_kwargs[i]) for x in inputs]  # the next layer's inputs
            layer.to("meta")
            progress.update(note=f"layer {i}")
        if head:
            calls += _quantize_head(base, reader, inputs, quantize_linear, make_hessian)
            progress.update(note=HEAD)
    return {
        "layers": len(base.layers),
        "linears_quantized": calls,
        "tokens": samples.numel(),
        # ru_maxrss is in KiB on Linux; the peak of the whole process so far
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": time.monotonic() - start,
    }



def _quantize_head(base, reader: TensorReader, inputs: list[torch.Tensor],
                   quantize_linear: QuantizeLinear, make_hessian: Callable[[int], Hessian]) -> int:
    """The head on the final norm of the last layer's outputs; 1 if it was quantized."""
    _load(base.norm, "model.norm.", reader)
    h = make_hessian(base.config.hidden_size)
    for x in inputs:
        h.add_batch(base.norm(x))
    w = reader.get(f"{HEAD}.weight").float()
    w_hat = _checked(quantize_linear(HEAD, w, h.h), w.shape, HEAD)  # nothing reads it after
    return int(w_hat is not w)

def _check_shape(model: torch.nn.Module) -> None:
    """Raise naming the first module a Llama-style layout needs but the model lacks."""
    needed = ["model.embed_tokens", "model.layers", "model.rotary_emb", "model.norm", HEAD]
    layers = getattr(getattr(model, "model", None), "layers", [])
    needed += [f"model.layers.{i}.{n}" for i in range(len(layers)) for g in GROUPS for n in g]
    for path in needed:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            module = None
        if module is None or (path.endswith("_proj") and not isinstance(module, torch.nn.Linear)):
            raise CheckpointError(
                f"{type(model).__name__} has no {path} (an nn.Linear for projections); "
                "quantize_sequential expects the Llama/Qwen2/Mistral layout "
                "model.model.layers[i].self_attn.q_proj, ..."
            )


def _capture_inputs(base, reader, samples):
    """Run the embedding up to the decoder layers, once per sample.

    Returns layer 0's input per sample [1, T, D] and the keyword arguments each layer
    is called with (rotary position embeddings, its attention mask: layers may differ,
    e.g. sliding-window ones). These depend only on T, so one set serves all samples.
    """
    inputs, layer_kwargs = [], [None] * len(base.layers)

    class Recorder(torch.nn.Module):  # stands in for decoder layer i
        def __init__(self, i):
            super().__init__()
            self.i = i

        def forward(self, hidden_states, **kwargs):
            if self.i == 0:
                inputs.append(hidden_states)
            layer_kwargs[self.i] = kwargs
            if self.i == len(layer_kwargs) - 1:
                raise _Stop
            return hidden_states

    _load(base.embed_tokens, "model.embed_tokens.", reader)
    # Its buffers (inv_freq) are computed at construction, not stored: build it on the CPU.
    base.rotary_emb = type(base.rotary_emb)(config=base.config)
    real = list(base.layers)
    base.layers = torch.nn.ModuleList(Recorder(i) for i in range(len(real)))
    try:
        for ids in samples:
            try:
                base(input_ids=ids.unsqueeze(0), use_cache=False)  # [T] -> [1, T]
            except _Stop:
                pass
    finally:
        base.layers = torch.nn.ModuleList(real)
        base.embed_tokens.to("meta")
    return inputs, layer_kwargs


def _input_hessian(layer, module, inputs, kwargs, make_hessian) -> torch.Tensor:
    """H [K, K] of ``module``'s input over all samples, stopping each forward there."""
    h = make_hessian(module.in_features)

    def hook(_module, args):
        h.add_batch(args[0])
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        for x in inputs:
            try:
                layer(x, **kwargs)
            except _Stop:
                pass
    finally:
        handle.remove()
    return h.h


def _load(module, prefix, reader) -> None:
    """Give a meta-device module its weights from the checkpoint, in float32."""
    state = {name: reader.get(prefix + name).float() for name in module.state_dict()}
    module.load_state_dict(state, assign=True)


def _checked(w_hat, shape, name) -> torch.Tensor:
    if w_hat.shape != shape:
        got, want = tuple(w_hat.shape), tuple(shape)
        raise ValueError(f"{name}: quantizer returned {got} for a {want} weight")
    return w_hat
