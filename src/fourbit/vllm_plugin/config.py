"""The vLLM side of the plugin: its QuantizationConfig, which picks each layer's method
(fourbit.vllm_plugin.linear_methods).

Which layers are quantized: read from the checkpoint itself (safetensors headers,
``maybe_update_config``, vllm/config/vllm.py:914-918), a module being quantized when
it has the format's first tensor (e.g. "lm_head.qweight"). A merged layer must be all
or nothing. Other layers get vLLM's UnquantizedLinearMethod, an unquantized lm_head
or input embedding gets None, i.e. vLLM's own. A quantized input embedding
(``quantize_embedding``: the 4-bit table of fourbit.formats.table, or a wide layout)
gets FourbitEmbeddingMethod: the table stays packed and each lookup dequantizes only the
rows it reads.

vLLM's default checkpoint mapper drops ".g_idx" (layers/quantization/base_config.py:
249-256); this config keeps it, so the GPTQ reader can refuse act-order checkpoints.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Collection
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

from fourbit import formats
from fourbit.schema import allowed
from fourbit.vllm_plugin.knobs import DEFAULTS, KNOBS, QUANT_METHOD
from fourbit.vllm_plugin.linear_methods import (
    ACTIVATION_DTYPES,
    FourbitEmbeddingMethod,
    FourbitInt8LinearMethod,
    FourbitLinearMethod,
)

log = logging.getLogger(__name__)


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
        if activation_dtype != "auto" and activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(
                f"{QUANT_METHOD}: activation_dtype must be 'auto' or one of {sorted(ACTIVATION_DTYPES)}, "
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
        # Those it stores in a wide layout instead (fourbit.formats.int8: the head of a
        # quantize_head: 8 arm, the sets mixed_precision moved), named by its
        # quantization_config, with their bits.
        self.wide_bits: dict[str, int] = formats.wide_bits(self.checkpoint_config)
        # The embedding it stores as a 4-bit table beside them (fourbit.formats.table), if any.
        table = formats.int4_embedding(self.checkpoint_config)
        self.table_modules: set[str] = {table} if table else set()

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
        if not self.quantized_modules and not self.wide_bits:  # mixed precision may move all
            raise ValueError(
                f"{QUANT_METHOD}: no tensor named *{marker} in {model_name}; "
                f"not a {self.format_name} checkpoint"
            )

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.quantized_modules is not None:
            mapped = hf_to_vllm_mapper.apply_list(sorted(self.quantized_modules))
            self.quantized_modules = set(self.quantized_modules) | set(mapped)
        for name, bits in list(self.wide_bits.items()):
            for mapped in hf_to_vllm_mapper.apply_list([name]):
                self.wide_bits[mapped] = bits
        self.table_modules |= set(hf_to_vllm_mapper.apply_list(sorted(self.table_modules)))

    def _members(self, prefix: str) -> list[str]:
        """The checkpoint module(s) behind ``prefix``: a merged layer's (qkv_proj: q/k/v)."""
        head, _, last = prefix.rpartition(".")
        if last in self.packed_modules_mapping:
            return [f"{head}.{s}" if head else s for s in self.packed_modules_mapping[last]]
        return [prefix]

    def _all_stored(self, prefix: str, stored: Collection[str], how: str) -> bool:
        """Whether the checkpoint module(s) behind ``prefix`` are all in ``stored``; a merged
        layer whose members are stored two ways cannot be run."""
        names = self._members(prefix)
        flags = [n in stored for n in names]
        if any(flags) and not all(flags):
            raise ValueError(f"{QUANT_METHOD}: {prefix} merges {names}, only some {how}: {flags}")
        return all(flags)

    def _wide_layout(self, prefix: str) -> formats.Layout:
        """The one wide layout of the module(s) behind ``prefix``."""
        bits = {self.wide_bits[n] for n in self._members(prefix)}
        if len(bits) != 1:
            raise ValueError(f"{QUANT_METHOD}: {prefix} merges modules stored at {sorted(bits)} bits")
        return formats.WIDE_LAYOUTS[bits.pop()]

    def is_quantized(self, prefix: str, layer: torch.nn.Module) -> bool:
        if self.quantized_modules is None:
            if isinstance(layer, ParallelLMHead):
                return bool(self.checkpoint_config.get("lm_head", False))
            return True
        return self._all_stored(prefix, self.quantized_modules, "quantized")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase | ParallelLMHead) and self._all_stored(
                prefix, self.wide_bits, "stored on a wide grid"):
            return FourbitInt8LinearMethod(self, self._wide_layout(prefix))
        if isinstance(layer, ParallelLMHead):
            return FourbitLinearMethod(self) if self.is_quantized(prefix, layer) else None
        if isinstance(layer, VocabParallelEmbedding):
            # Some models build their embedding without a prefix (vLLM's Llama does), so
            # the checkpoint's own flags decide; where the name is known they must agree.
            wide = formats.embedding_bits(self.checkpoint_config)
            stored = (wide is not None or bool(self.table_modules)
                      or bool(self.checkpoint_config.get("embedding", False)))
            known = prefix and self.quantized_modules is not None
            in_checkpoint = prefix in self.wide_bits.keys() | self.table_modules
            if known and (self.is_quantized(prefix, layer) or in_checkpoint) != stored:
                raise ValueError(
                    f"{QUANT_METHOD}: quantization_config says embedding={stored}, but the "
                    f"checkpoint stores {prefix} {'dense' if stored else 'quantized'}"
                )
            if not stored:
                return None
            layout = formats.table_layout(self.format) if wide is None else formats.WIDE_LAYOUTS[wide]
            return FourbitEmbeddingMethod(self, layout)
        if isinstance(layer, LinearBase):
            if self.is_quantized(prefix, layer):
                return FourbitLinearMethod(self)
            return UnquantizedLinearMethod()
        return None
