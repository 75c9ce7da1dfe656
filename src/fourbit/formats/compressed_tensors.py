"""compressed-tensors "pack-quantized", W4A16 with zero points (asymmetric, group).

The format vLLM accepts for an asymmetric 4-bit grid (quant_method
"compressed-tensors"), written exactly as compressed-tensors 0.17.0's
PackedQuantizationCompressor writes it.

    tensor             dtype        shape        holds
    weight_packed      int32        [N, K/8]     bits 4i..4i+3 of [n, j] = codes[n, 8j + i]
    weight_scale       scale dtype  [N, K/G]     scales[n, g]
    weight_zero_point  int32        [N/8, K/G]   bits 4i..4i+3 of [j, g] = zeros[8j + i, g]
    weight_shape       int64        [2]          (N, K)

    W_hat[n, k] = (codes[n, k] - zeros[n, k // G]) * scales[n, k // G]

Weights are packed along K (nn.Linear order, no transpose) but the zero points along
N, like compressed-tensors does it: pack_to_int32(zero_point, packed_dim=0)
(compressed_tensors/compressors/pack_quantized/base.py:94-97). Bits per weight:
4 + (16 + 4)/G + 128/(N K), 4.156 at G = 128.

The zero-point convention. compressed-tensors thinks in signed int4: quantized values
and zero points live in -8..7 (quantization/utils/helpers.py:211-212) and
W = (q - zp) * scale (quantization/lifecycle/forward_helpers.py:261). Both are
packed as unsigned nibbles value + 8 (pack_quantized/helpers.py:62-63) and unpacked
as nibble - 8 (helpers.py:159-160). Adding 8 to both sides of a difference changes
nothing, so the stored nibbles are exactly our unsigned codes and zeros. Worked
example, one weight with code 2, zero 5, scale s: ours (2 - 5) s = -3 s;
compressed-tensors sees q = 2 - 8 = -6, zp = 5 - 8 = -3, (-6 - -3) s = -3 s; stored
nibbles 2 and 5. vLLM reads the same nibbles unsigned: for symmetric=false it picks
scalar type uint4 (no bias) and subtracts the zero point nibble
(vllm/model_executor/layers/quantization/compressed_tensors/schemes/
compressed_tensors_wNa16.py:45-53, 95-99; zero point parameter [N/8, K/G] packed
along dim 0 at 184-215; weight_shape int64 [2] at 219-221).

A symmetric grid is stored the same way, with explicit zero 8; the config always
says symmetric=false so the zero point tensor is always read. (compressed-tensors'
symmetric mode would drop it and vLLM would read code - 8 instead -- also correct,
but then what is stored would depend on the data.)

lm_head: vLLM quantizes a ParallelLMHead only when a config group's targets match
it (vllm/.../compressed_tensors/compressed_tensors.py:186-192). Targets match by
layer name, or by class name containing the target (compressed_tensors/utils.py:
105-109); "Linear" is not in "ParallelLMHead", so a quantized head is named
explicitly in targets, and otherwise listed in ignore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fourbit.formats.base import (
    Format,
    check_nibbles,
    pack_nibbles_int32,
    refuse_quantized_embedding,
    register_format,
    unpack_nibbles_int32,
)
from fourbit.layouts import LAYOUTS
from fourbit.quant.qweight import BITS, QuantizedWeight

QUANT_METHOD = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
VERSION = "0.17.0"  # the compressed-tensors release whose sources this layout was checked against


@register_format
class CompressedTensors(Format):
    name = "compressed_tensors"
    layout = LAYOUTS[name]  # the module doc's table; in fourbit.layouts, the planner reads it too

    def pack(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        check_nibbles(qw)
        n, k = qw.shape
        self.shapes(n, k, qw.group_size)  # raises unless K % 8, N % 8 and K % G are 0
        return {
            "weight_packed": pack_nibbles_int32(qw.codes, dim=1),  # [N, K] -> [N, K/8]
            "weight_scale": qw.scales.clone(),  # [N, K/G]
            "weight_zero_point": pack_nibbles_int32(qw.zeros, dim=0),  # [N, K/G] -> [N/8, K/G]
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }

    def unpack(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_features: int,
        in_features: int,
        group_size: int,
    ) -> QuantizedWeight:
        t = self.checked(tensors, out_features, in_features, group_size)
        if t["weight_shape"].tolist() != [out_features, in_features]:
            raise ValueError(
                f"weight_shape {t['weight_shape'].tolist()} != [{out_features}, {in_features}]"
            )
        codes = unpack_nibbles_int32(t["weight_packed"], dim=1)  # [N, K/8] -> [N, K]
        zeros = unpack_nibbles_int32(t["weight_zero_point"], dim=0)  # [N/8, K/G] -> [N, K/G]
        return QuantizedWeight(codes, t["weight_scale"].clone(), zeros, group_size)

    def quantization_config(
        self, group_size: int, sym: bool, *, lm_head: bool = False, embedding: bool = False
    ) -> dict[str, Any]:
        refuse_quantized_embedding(self.name, embedding)
        # Keys as ModelCompressor.update_config writes them
        # (compressed_tensors/compressors/model_compressors/model_compressor.py:222-228).
        # ``sym`` does not change the layout: zero points are always stored (module doc).
        weights = {
            "num_bits": BITS,
            "type": "int",
            "symmetric": False,
            "strategy": "group",
            "group_size": group_size,
            "block_structure": None,
            "dynamic": False,
            "actorder": None,
            "zp_dtype": "torch.int8",  # signed zero points, stored as nibble = zp + 8
        }
        return {
            "quant_method": QUANT_METHOD,
            "version": VERSION,
            "format": PACK_QUANTIZED,
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear", "lm_head"] if lm_head else ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "output_activations": None,
                    "format": PACK_QUANTIZED,
                }
            },
            "ignore": [] if lm_head else ["lm_head"],
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
        }

    def reads_config(self, cfg: Mapping[str, Any]) -> bool:
        if cfg.get("quant_method") != QUANT_METHOD or cfg.get("format") != PACK_QUANTIZED:
            return False
        groups = cfg.get("config_groups") or {}
        return bool(groups) and all(
            self._is_ours(group.get("weights") or {}) for group in groups.values()
        )

    @staticmethod
    def _is_ours(weights: Mapping[str, Any]) -> bool:
        return (
            weights.get("num_bits") == BITS
            and weights.get("type") == "int"
            and weights.get("symmetric") is False
            and weights.get("strategy") == "group"
            and weights.get("actorder") is None
        )

    def group_size_from_config(self, cfg: Mapping[str, Any]) -> int:
        sizes = {int(group["weights"]["group_size"]) for group in cfg["config_groups"].values()}
        if len(sizes) != 1:
            raise ValueError(f"config groups disagree on group_size: {sorted(sizes)}")
        return sizes.pop()
