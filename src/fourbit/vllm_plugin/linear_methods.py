"""The plugin's methods for the layers FourbitInt4Config quantizes: a linear on fourbit's
4-bit kernel (or tinygemm), a linear stored on a wide grid (8 bits, or 5 and 6 packed), and
a quantized embedding table.

Each holds its layer's stored tensors as the checkpoint's format lays them out
(fourbit.vllm_plugin.loading.StoredTensors) and decodes them once after loading.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from fourbit import formats
from fourbit.kernels import int4_cpu, tinygemm
from fourbit.quant.int8 import Int8Weight
from fourbit.quant.qweight import QuantizedWeight
from fourbit.vllm_plugin.knobs import QUANT_METHOD
from fourbit.vllm_plugin.loading import StoredTensors, layer_name
from fourbit.vllm_plugin.ops import (
    DTYPE_CODE,
    KERNEL_CODE,
    MODE_DIRECT,
    MODE_KEPT,
    MODE_NEVER,
    NO_THRESHOLD,
    calls,
    int4_linear_impl,
    int8_linear_impl,
    kept_copy,
)

log = logging.getLogger(__name__)

# The activation dtypes a quantized linear computes in (the config's activation_dtype).
ACTIVATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PluginSettings(Protocol):
    """What these methods read of the config that builds them
    (fourbit.vllm_plugin.config.FourbitInt4Config; the knobs are described in knobs.py)."""

    group_size: int
    dequant_threshold: int
    prefill_dequant: bool
    direct_dequant: bool
    activation_dtype: str
    kernel: str

    @property
    def format(self) -> formats.Format: ...


def _pad_rows(qw: QuantizedWeight, rows: int) -> QuantizedWeight:
    """Append all-zero rows (code 0, zero 0, scale 0 -> W_hat row 0) up to ``rows``."""
    extra = rows - qw.shape[0]
    if extra <= 0:
        return qw
    k = qw.shape[1]
    ng = qw.scales.shape[1]
    return QuantizedWeight(
        torch.cat([qw.codes, torch.zeros(extra, k, dtype=torch.uint8)]),
        torch.cat([qw.scales, torch.zeros(extra, ng, dtype=qw.scales.dtype)]),
        torch.cat([qw.zeros, torch.zeros(extra, ng, dtype=torch.uint8)]),
        qw.group_size,
    )


class _Method(StoredTensors):
    """What both methods hold: the config, and the loading of its format's tensors."""

    def __init__(self, config: PluginSettings) -> None:
        super().__init__(config.format, config.group_size)
        self.config = config


class FourbitEmbeddingMethod(StoredTensors, QuantizeMethodBase):
    """A quantized embedding table: lookups gather stored rows and dequantize only those.

    The table is kept as stored, in the 4-bit table layout (fourbit.formats.table, in
    every format: codes two to a byte, scales, integer zeros, 4 + 24/G bits per weight) or
    in a wide layout (int8 codes and scales, quantize_embedding: 8, or mixed precision's
    5 or 6 bits packed), and the rows a step
    looks up are decoded by that layout's own unpack and dequantize, i.e. exactly as the
    dense control was expanded.
    """

    def __init__(self, config: PluginSettings, layout: formats.Layout) -> None:
        super().__init__(layout, config.group_size)
        self.config = config

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Kept as loaded, checked against the layout's table: decoding the whole table
        # only to pack it again would briefly need V x H more bytes.
        [(rows, tensors)] = self.take_stored(layer)
        table = self.fmt.checked(tensors, rows, layer.fourbit_in_features, self.config.group_size)
        for suffix, tensor in table.items():  # each [V, ...]
            layer.register_buffer(f"fourbit_table_{suffix}", tensor, persistent=False)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        """W_hat rows for token ids [...] -> [..., H]."""
        calls["embedding"] += 1
        ids = input_.reshape(-1)  # [...] -> [T]
        rows = {spec.suffix: getattr(layer, f"fourbit_table_{spec.suffix}")[ids]
                for spec in self.fmt.layout}  # each [T, ...]
        h = layer.fourbit_in_features
        weight = self.fmt.unpack(rows, ids.numel(), h, self.config.group_size)  # [T, H]
        return weight.dequantize(layer.fourbit_params_dtype).reshape(*input_.shape, h)

    def apply(self, layer: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError(
            f"{QUANT_METHOD}: {layer_name(layer)} is an input embedding; it is looked up, never "
            "multiplied (a tied head would need the head quantized as its own matrix)"
        )


class FourbitLinearMethod(_Method, LinearMethodBase):
    """fourbit's kernel (or tinygemm) for small batches, dense matmul on W_hat for large ones
    (see ops.py). The arm's ``kernel`` knob picks; a layer the kernel cannot take on this
    host falls back to tinygemm, logged with the layer's name and the reason."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        out_features = sum(layer.fourbit_out_sizes)
        qw = _pad_rows(self.take_loaded(layer), out_features)
        self._install(layer, qw, out_features)

    def _install(self, layer: torch.nn.Module, qw: QuantizedWeight, out_features: int) -> None:
        cfg = self.config
        if cfg.activation_dtype == "auto":
            compute = layer.fourbit_params_dtype
        else:
            compute = ACTIVATION_DTYPES[cfg.activation_dtype]
        k = qw.shape[1]
        g = qw.group_size
        kernel = cfg.kernel
        if kernel in int4_cpu.NUMERICS:
            reason = int4_cpu.unsupported(out_features, k, g)
            if reason is not None:
                log.warning("%s: %s: fourbit %s kernel not used (%s); tinygemm instead",
                            QUANT_METHOD, layer_name(layer), kernel, reason)
                kernel = "tinygemm"
        empty_u8 = torch.empty(0, dtype=torch.uint8)
        empty_f = torch.empty(0, dtype=torch.float32)
        packed, sz, scales, zeros = empty_u8, torch.empty(0, dtype=compute), empty_f, empty_u8
        codes, offsets = empty_u8, empty_f
        if kernel != "tinygemm":
            w = int4_cpu.repack(qw)  # [N, K/2] nibbles, [N/4, K/G, 4] scales and zeros; qw dropped
            packed, scales, zeros = w.packed, w.scales, w.zeros
            mode = MODE_DIRECT if cfg.prefill_dequant else MODE_NEVER
            threshold = cfg.dequant_threshold if cfg.prefill_dequant else NO_THRESHOLD
        else:
            mode, threshold, packed, sz = self._tinygemm(layer, qw, out_features, compute)
            if mode == MODE_KEPT:
                codes, scales, offsets = kept_copy(qw.codes, qw.scales, qw.zeros, g)
        layer.register_buffer("fourbit_packed", packed, persistent=False)
        layer.register_buffer("fourbit_sz", sz, persistent=False)
        layer.register_buffer("fourbit_codes", codes, persistent=False)
        layer.register_buffer("fourbit_scales", scales, persistent=False)
        layer.register_buffer("fourbit_offsets", offsets, persistent=False)
        layer.register_buffer("fourbit_zeros", zeros, persistent=False)
        knobs = [threshold, mode, DTYPE_CODE[compute], KERNEL_CODE[kernel]]
        layer.register_buffer("fourbit_knobs", torch.tensor(knobs, dtype=torch.int64),
                              persistent=False)
        layer.fourbit_group_size = g
        layer.fourbit_out_features = out_features
        layer.fourbit_mode = mode
        layer.fourbit_kernel = kernel

    def _tinygemm(self, layer, qw: QuantizedWeight, out_features: int, compute: torch.dtype):
        """(mode, threshold, packed, scales_and_zeros) for tinygemm. It runs in bfloat16 under
        a float32 model where only bfloat16 is vectorized (tinygemm.kernel_dtype); its dense
        path then reads W_hat from a kept copy, since bfloat16 scales are not exact."""
        cfg = self.config
        n16 = -(-out_features // tinygemm.N_MULTIPLE) * tinygemm.N_MULTIPLE
        k, g = qw.shape[1], qw.group_size
        try:
            tinygemm.check_shape(n16, k, g)
        except ValueError as e:
            log.warning("%s: %s runs dense only: %s", QUANT_METHOD, layer_name(layer), e)
            return MODE_KEPT, 0, torch.empty(0, dtype=torch.uint8), torch.empty(0)
        dtype = tinygemm.kernel_dtype(compute, cfg.activation_dtype)
        packed, sz = tinygemm.to_tinygemm(_pad_rows(qw, n16), dtype)
        exact = dtype == compute or dtype == torch.float32
        if not cfg.prefill_dequant:
            return MODE_NEVER, NO_THRESHOLD, packed, sz
        if cfg.direct_dequant and exact and tinygemm.supports_direct_dequant(n16, k):
            return MODE_DIRECT, cfg.dequant_threshold, packed, sz
        return MODE_KEPT, cfg.dequant_threshold, packed, sz

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        k = layer.fourbit_in_features
        n = layer.fourbit_out_features
        # Traced (compiled mode): the opaque op; eager: its implementation, without the
        # dispatcher's round trip (ops.py, int4_linear).
        compiling = torch.compiler.is_compiling()
        op = torch.ops.fourbit.int4_linear if compiling else int4_linear_impl
        y = op(
            x.reshape(-1, k),
            layer.fourbit_packed,
            layer.fourbit_sz,
            layer.fourbit_codes,
            layer.fourbit_scales,
            layer.fourbit_offsets,
            layer.fourbit_zeros,
            layer.fourbit_knobs,
            layer.fourbit_group_size,
            n,
        )
        y = y.reshape(*x.shape[:-1], n)
        if bias is not None:
            y = y + bias
        return y


class FourbitInt8LinearMethod(StoredTensors, LinearMethodBase):
    """A linear or head stored in a wide layout (fourbit.formats.int8; quantize_head: 8
    or mixed_precision, at 8 bits or packed at 5 or 6), held as int8 codes (a narrower
    grid's unpacked: its codes are a subset) and scales widened to float32 (exact), and
    run by fourbit::int8_linear (ops.py): the W8A16 kernel for small batches (W8A8 when the
    arm's kernel rounds activations to int8), the exact W_hat block by block for large ones. A head's rows are padded to vLLM's vocab with zero
    codes."""

    def __init__(self, config: PluginSettings, layout: formats.Layout) -> None:
        super().__init__(layout, config.group_size)
        self.config = config

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        qw: Int8Weight = self.take_loaded(layer)  # [N, K]; a head's N is the checkpoint's vocab
        rows = sum(layer.fourbit_out_sizes)  # vLLM pads the head's vocab
        codes = torch.zeros(rows, qw.shape[1], dtype=torch.int8)
        scales = torch.zeros(rows, qw.shape[1] // qw.group_size, dtype=torch.float32)
        codes[: qw.shape[0]], scales[: qw.shape[0]] = qw.codes, qw.scales.float()
        layer.register_buffer("fourbit_int8_codes", codes, persistent=False)
        layer.register_buffer("fourbit_int8_scales", scales, persistent=False)
        layer.fourbit_group_size = qw.group_size
        # an arm whose kernel rounds activations to int8 rounds them for these too (W8A8)
        layer.fourbit_int8_activations = (self.config.kernel in int4_cpu.INT8_ACTIVATIONS
                                          and int4_cpu.w8a8_runs(qw.group_size))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        op = torch.ops.fourbit.int8_linear if torch.compiler.is_compiling() else int8_linear_impl
        y = op(x.reshape(-1, layer.fourbit_in_features), layer.fourbit_int8_codes,
               layer.fourbit_int8_scales, layer.fourbit_group_size,
               layer.fourbit_int8_activations)  # [M, K] -> [M, N]
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias
