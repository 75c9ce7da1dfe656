"""Loading a quantized module's checkpoint tensors into vLLM, for both plugin methods.

Each quantized layer gets one empty placeholder parameter per tensor of its
checkpoint format (``format.layout``: qweight/scales/zeros, or GPTQ's
qweight/qzeros/scales/g_idx, or compressed-tensors' weight_packed/...); their
``weight_loader`` does not copy into the parameter but files the tensor under its
shard. vLLM's model loaders hand every checkpoint tensor of a merged layer to
``param.weight_loader(param, tensor, shard_id)`` with the shard id taken from the
model's stacked mapping ("q"/"k"/"v" for qkv_proj, 0/1 for gate_up_proj;
vllm/model_executor/models/llama.py:348-357, linear.py:972-996 and 1326-1350; a plain
layer and the lm_head get no shard id, models/utils.py:299-341). After loading each
shard is decoded by its own format's ``unpack`` with the shard's own N, exactly as the
checkpoint stored it, and the QuantizedWeights are stacked along N. That needs no
per-format packed_dim/output_dim bookkeeping (the approach of vLLM's own GPTQ/AWQ
methods with PackedvLLMParameter), so GPTQ's zero points packed along N and
compressed-tensors' zero points packed along dim 0 are handled by the same code.

This module knows the format and group size only, not the plugin's config
(:mod:`fourbit.vllm_plugin.config` builds the methods on top of it).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.utils import set_weight_attrs

from fourbit import formats
from fourbit.quant.int8 import Int8Weight
from fourbit.quant.qweight import QuantizedWeight
from fourbit.vllm_plugin.knobs import QUANT_METHOD


def _shard_key(shard_id: Any) -> int | str:
    """Which stacked shard a loaded tensor belongs to; "all" for an unmerged tensor."""
    if shard_id is None:
        return "all"
    if isinstance(shard_id, str):
        return {"q": 0, "k": 1, "v": 2}[shard_id]
    if isinstance(shard_id, int):
        return shard_id
    raise NotImplementedError(f"{QUANT_METHOD}: shard id {shard_id!r} (a span) is not supported")


def _stash(
    layer: torch.nn.Module,
    suffix: str,
    param: Parameter,
    loaded: torch.Tensor,
    shard_id: Any = None,
) -> None:
    """A placeholder's weight_loader: keep the tensor for process_weights_after_loading."""
    layer.fourbit_shards.setdefault(_shard_key(shard_id), {})[suffix] = loaded.detach().clone()


def _stack(parts: list[QuantizedWeight | Int8Weight]) -> QuantizedWeight | Int8Weight:
    """The shards of a merged layer as one weight, rows stacked in shard order."""
    if len(parts) == 1:
        return parts[0]
    g = parts[0].group_size
    codes, scales = torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts])
    if isinstance(parts[0], Int8Weight):
        return Int8Weight(codes, scales, g, parts[0].bits)
    return QuantizedWeight(codes, scales, torch.cat([p.zeros for p in parts]), g)


def layer_name(layer: torch.nn.Module) -> str:
    """The layer's name for messages; vLLM builds some embeddings without a prefix."""
    return getattr(layer, "prefix", "") or f"the {type(layer).__name__}"


class StoredTensors:
    """Placeholders for a module's checkpoint tensors, and the QuantizedWeight they hold.

    The base of the linear and the embedding method: both load the format's tensors the
    same way and differ only in what they build from the decoded weight.
    """

    def __init__(self, fmt: formats.Format, group_size: int) -> None:
        self.fmt = fmt
        self.group_size = group_size

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        # An embedding's partition is its padded vocab, so only linears are checked.
        split = input_size_per_partition != input_size or sum(output_partition_sizes) != output_size
        if split and not isinstance(layer, VocabParallelEmbedding):
            raise NotImplementedError(f"{QUANT_METHOD}: tensor parallelism is not supported")
        layer.fourbit_in_features = input_size_per_partition
        layer.fourbit_out_sizes = list(output_partition_sizes)
        layer.fourbit_params_dtype = params_dtype
        layer.fourbit_shards = {}
        for spec in self.fmt.layout:
            empty = torch.empty(0, dtype=formats.stored_dtype(spec, torch.float16))
            placeholder = Parameter(empty, requires_grad=False)
            loader = functools.partial(_stash, layer, spec.suffix)
            set_weight_attrs(placeholder, {"weight_loader": loader})
            layer.register_parameter(spec.suffix, placeholder)

    def _shard_rows(self, layer: torch.nn.Module) -> list[tuple[int | str, int]]:
        """(shard key, checkpoint rows) for every tensor group the layer must have received."""
        sizes = layer.fourbit_out_sizes
        shards = layer.fourbit_shards
        if isinstance(layer, VocabParallelEmbedding):  # the checkpoint's vocab, unpadded
            return [("all", layer.org_vocab_size)]
        if "all" in shards:
            if len(shards) != 1:
                raise ValueError(f"{QUANT_METHOD}: {layer_name(layer)}: fused and per-shard tensors")
            return [("all", sum(sizes))]
        return list(enumerate(sizes))

    def take_stored(self, layer: torch.nn.Module) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """(checkpoint rows, the format's tensors) per shard as loaded; placeholders removed."""
        fmt = self.fmt
        stored = []
        for key, rows in self._shard_rows(layer):
            if key not in layer.fourbit_shards:
                raise ValueError(
                    f"{QUANT_METHOD}: {layer_name(layer)}: the checkpoint gave no tensors for shard "
                    f"{key} (expected {[spec.suffix for spec in fmt.layout]})"
                )
            stored.append((rows, layer.fourbit_shards[key]))
        for spec in fmt.layout:
            del layer._parameters[spec.suffix]
        del layer.fourbit_shards
        return stored

    def take_loaded(self, layer: torch.nn.Module) -> QuantizedWeight | Int8Weight:
        """The loaded shards decoded and stacked along N; the placeholders removed."""
        k = layer.fourbit_in_features
        return _stack([self.fmt.unpack(tensors, rows, k, self.group_size)
                       for rows, tensors in self.take_stored(layer)])
