"""The vLLM side of the plugin: a QuantizationConfig and its methods, at module level.

Loading: both methods build on :class:`fourbit.vllm_plugin.loading.StoredTensors`, which
files the checkpoint's tensors per shard and decodes them after loading.

Which layers are quantized: read from the checkpoint itself (safetensors headers,
``maybe_update_config``, vllm/config/vllm.py:914-918), a module being quantized when
it has the format's first tensor (e.g. "lm_head.qweight"). A merged layer must be all
or nothing. Other layers get vLLM's UnquantizedLinearMethod, an unquantized lm_head
or input embedding gets None, i.e. vLLM's own. A quantized input embedding (cpu_int4
with ``quantize_embedding``) gets FourbitEmbeddingMethod: the table stays packed and
each lookup dequantizes only the rows it reads.

vLLM's default checkpoint mapper drops ".g_idx" (layers/quantization/base_config.py:
249-256); this config keeps it, so the GPTQ reader can refuse act-order checkpoints.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

from fourbit import formats
from fourbit.schema import allowed
from fourbit.kernels import int4_cpu, tinygemm
from fourbit.quant.int8 import Int8Weight
from fourbit.quant.qweight import QuantizedWeight
from fourbit.vllm_plugin.knobs import DEFAULTS, KNOBS, QUANT_METHOD
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

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{QUANT_METHOD}: {name} must be a boolean, got {value!r}")


def _safetensors_keys(model_dir: str) -> list[str] | None:
    """All tensor names in a local checkpoint folder (headers only), or None if there is none."""
    if not os.path.isdir(model_dir):
        return None
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return list(json.load(f)["weight_map"])
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    keys: list[str] = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            keys.extend(f.keys())
    return keys


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


class FourbitInt4Config(QuantizationConfig):
    """4-bit group-wise weights on PyTorch's CPU int4 kernel; reads three checkpoint formats."""

    def __init__(
        self,
        checkpoint_config: dict[str, Any],
        format_name: str,
        group_size: int,
        dequant_threshold: int = DEFAULTS["dequant_threshold"],
        prefill_dequant: bool = DEFAULTS["prefill_dequant"],
        direct_dequant: bool = DEFAULTS["direct_dequant"],
        activation_dtype: str = DEFAULTS["activation_dtype"],
        kernel: str = DEFAULTS["kernel"],
    ) -> None:
        super().__init__()
        if kernel not in allowed("kernel"):  # what an arm may name: the schema's kernel enum
            raise ValueError(
                f"{QUANT_METHOD}: kernel must be one of {allowed('kernel')}, got {kernel!r}"
            )
        if activation_dtype != "auto" and activation_dtype not in _DTYPES:
            raise ValueError(
                f"{QUANT_METHOD}: activation_dtype must be 'auto' or one of {sorted(_DTYPES)}, "
                f"got {activation_dtype!r}"
            )
        if int(dequant_threshold) < 0:
            raise ValueError(
                f"{QUANT_METHOD}: dequant_threshold must be >= 0, got {dequant_threshold}"
            )
        self.checkpoint_config = dict(checkpoint_config)
        self.format_name = format_name
        self.group_size = int(group_size)
        self.dequant_threshold = int(dequant_threshold)
        self.prefill_dequant = bool(prefill_dequant)
        self.direct_dequant = bool(direct_dequant)
        self.activation_dtype = activation_dtype
        self.kernel = kernel
        # Module names (HF naming, then vLLM's after apply_vllm_mapper) that the
        # checkpoint stores quantized; None until maybe_update_config has read it.
        self.quantized_modules: set[str] | None = None
        # Those it stores in the 8-bit layout instead (fourbit.formats.int8: the head of
        # quantize_head: 8 arm, the sets mixed_precision moved), named by its quantization_config.
        self.int8_modules: set[str] = set(formats.int8_modules(self.checkpoint_config))

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={getattr(self, k)!r}" for k in KNOBS)
        return f"FourbitInt4Config(format={self.format_name}, group={self.group_size}, {knobs})"

    @property
    def format(self) -> formats.Format:
        return formats.get_format(self.format_name)

    # --- QuantizationConfig interface -------------------------------------------------
    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # not a GPU method; vLLM only checks this where a device capability exists

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # everything is in config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FourbitInt4Config:
        fmt = formats.format_for_config(config)
        if fmt.name == "gptq" and config.get("desc_act"):
            raise ValueError(f"{QUANT_METHOD}: GPTQ desc_act=True (act-order) is not supported")
        knobs = {k: config.get(k, DEFAULTS[k]) for k in KNOBS}
        return cls(
            checkpoint_config=config,
            format_name=fmt.name,
            group_size=fmt.group_size_from_config(config),
            dequant_threshold=int(knobs["dequant_threshold"]),
            prefill_dequant=_as_bool(knobs["prefill_dequant"], "prefill_dequant"),
            direct_dequant=_as_bool(knobs["direct_dequant"], "direct_dequant"),
            activation_dtype=str(knobs["activation_dtype"]),
            kernel=str(knobs["kernel"]),
        )

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        """Claim a gptq / compressed-tensors checkpoint when the user asked for us.

        vLLM asks every registered method (custom ones first, vllm/config/model.py:
        1407-1438); the first non-None answer becomes the method, otherwise the
        checkpoint's quant_method must equal LLM(quantization=...) (model.py:1440-1449).
        We never claim a checkpoint unasked.
        """
        if user_quant != QUANT_METHOD:
            return None
        try:
            formats.format_for_config(hf_quant_cfg)
        except ValueError:
            return None
        return QUANT_METHOD

    def get_checkpoint_weight_mapper(self):
        from vllm.model_executor.models.utils import WeightsMapper

        return WeightsMapper()  # keep g_idx: the GPTQ reader checks it is k // G

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        keys = _safetensors_keys(model_name)
        if keys is None:
            log.warning(
                "%s: no local safetensors in %r; assuming every linear is quantized",
                QUANT_METHOD,
                model_name,
            )
            return
        marker = "." + self.format.layout[0].suffix
        self.quantized_modules = {k[: -len(marker)] for k in keys if k.endswith(marker)}
        if not self.quantized_modules:
            raise ValueError(
                f"{QUANT_METHOD}: no tensor named *{marker} in {model_name}; "
                f"not a {self.format_name} checkpoint"
            )

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.quantized_modules is not None:
            mapped = hf_to_vllm_mapper.apply_list(sorted(self.quantized_modules))
            self.quantized_modules = set(self.quantized_modules) | set(mapped)
        mapped = hf_to_vllm_mapper.apply_list(sorted(self.int8_modules))
        self.int8_modules = self.int8_modules | set(mapped)

    def _all_stored(self, prefix: str, stored: set[str], how: str) -> bool:
        """Whether the checkpoint module(s) behind ``prefix`` are all in ``stored``; a merged
        layer (qkv_proj: q/k/v) whose members are stored two ways cannot be run."""
        head, _, last = prefix.rpartition(".")
        names = [prefix]
        if last in self.packed_modules_mapping:
            names = [f"{head}.{s}" if head else s for s in self.packed_modules_mapping[last]]
        flags = [n in stored for n in names]
        if any(flags) and not all(flags):
            raise ValueError(f"{QUANT_METHOD}: {prefix} merges {names}, only some {how}: {flags}")
        return all(flags)

    def is_quantized(self, prefix: str, layer: torch.nn.Module) -> bool:
        if self.quantized_modules is None:
            if isinstance(layer, ParallelLMHead):
                return bool(self.checkpoint_config.get("lm_head", False))
            return True
        return self._all_stored(prefix, self.quantized_modules, "quantized")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase | ParallelLMHead) and self._all_stored(
                prefix, self.int8_modules, "stored at 8 bits"):
            return FourbitInt8LinearMethod(self)
        if isinstance(layer, ParallelLMHead):
            return FourbitLinearMethod(self) if self.is_quantized(prefix, layer) else None
        if isinstance(layer, VocabParallelEmbedding):
            # Some models build their embedding without a prefix (vLLM's Llama does), so
            # the checkpoint's own flags decide; where the name is known they must agree.
            eight_bit = bool(self.checkpoint_config.get(formats.INT8_EMBEDDING, False))
            stored = eight_bit or bool(self.checkpoint_config.get("embedding", False))
            known = prefix and self.quantized_modules is not None
            if known and (self.is_quantized(prefix, layer) or prefix in self.int8_modules) != stored:
                raise ValueError(
                    f"{QUANT_METHOD}: quantization_config says embedding={stored}, but the "
                    f"checkpoint stores {prefix} {'dense' if stored else 'quantized'}"
                )
            if not stored:
                return None
            return FourbitEmbeddingMethod(self, formats.INT8 if eight_bit else self.format)
        if isinstance(layer, LinearBase):
            if self.is_quantized(prefix, layer):
                return FourbitLinearMethod(self)
            return UnquantizedLinearMethod()
        return None


class _Method(StoredTensors):
    """What both methods hold: the config, and the loading of its format's tensors."""

    def __init__(self, config: FourbitInt4Config) -> None:
        super().__init__(config.format, config.group_size)
        self.config = config


class FourbitEmbeddingMethod(StoredTensors, QuantizeMethodBase):
    """A quantized embedding table: lookups gather stored rows and dequantize only those.

    The table is kept as stored, in the 4-bit format (cpu_int4: codes two to a byte,
    scales, integer zeros, about 4.2 bits per weight) or in the 8-bit layout (int8
    codes and scales, quantize_embedding: 8), and the rows a step looks up are decoded by
    that layout's own unpack and dequantize, i.e. exactly as the dense control was
    expanded. Of the 4-bit formats only cpu_int4 can mark a quantized embedding.
    """

    TABLE_FORMAT = "cpu_int4"

    def __init__(self, config: FourbitInt4Config, layout: formats.Layout) -> None:
        super().__init__(layout, config.group_size)
        self.config = config

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.fmt is not formats.INT8 and self.config.format_name != self.TABLE_FORMAT:
            raise ValueError(f"{QUANT_METHOD}: a 4-bit input embedding must be stored in "
                             f"{self.TABLE_FORMAT}, this checkpoint is {self.config.format_name}")
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
            compute = _DTYPES[cfg.activation_dtype]
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
    """A linear or head stored in the 8-bit layout (fourbit.formats.int8; quantize_head: 8
    or mixed_precision), kept as stored (codes int8, scales widened to float32: exact) and
    run by fourbit::int8_linear (ops.py): the W8A16 kernel for small batches, the exact
    W_hat block by block for large ones. A head's rows are padded to vLLM's vocab with zero
    codes."""

    def __init__(self, config: FourbitInt4Config) -> None:
        super().__init__(formats.INT8, config.group_size)
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

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        op = torch.ops.fourbit.int8_linear if torch.compiler.is_compiling() else int8_linear_impl
        y = op(x.reshape(-1, layer.fourbit_in_features), layer.fourbit_int8_codes,
               layer.fourbit_int8_scales, layer.fourbit_group_size)  # [M, K] -> [M, N]
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias
