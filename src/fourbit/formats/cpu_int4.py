"""fourbit's own 4-bit format ("fourbit_int4", format_version 1).

The QuantizedWeight stored almost as is: codes two to a byte, scales and integer
zeros one per group, nothing transposed. It is what the tinygemm plugin reads
(kernels/tinygemm.py converts it to the kernel's layout at load time).

    tensor   dtype        shape       holds
    qweight  uint8        [N, K/2]    byte (n, j) = codes[n, 2j] | codes[n, 2j+1] << 4
                                      (even k in the low nibble, odd k in the high one)
    scales   scale dtype  [N, K/G]    scales[n, g]
    zeros    uint8        [N, K/G]    zeros[n, g] in 0..15, one byte each (not packed)

    W_hat[n, k] = (codes[n, k] - zeros[n, k // G]) * scales[n, k // G]

The input embedding table [V, H] may be stored the same way (N = V tokens, K = H;
config "embedding": true), read one row per looked-up token.

Bytes per group of G weights: G/2 + 2 (float16 scale) + 1, i.e. 4 + 24/G bits per
weight (4.1875 at G = 128).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fourbit.formats.base import Format, check_nibbles, register_format
from fourbit.layouts import LAYOUTS
from fourbit.quant.qweight import BITS, QuantizedWeight

QUANT_METHOD = "fourbit_int4"
FORMAT_VERSION = 1


@register_format
class CpuInt4(Format):
    name = "cpu_int4"
    layout = LAYOUTS[name]  # the module doc's table; in fourbit.layouts, the planner reads it too
    marks_embedding = True

    def pack(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        check_nibbles(qw)
        n, k = qw.shape
        self.shapes(n, k, qw.group_size)  # raises on K odd
        pairs = qw.codes.reshape(n, k // 2, 2)  # [N, K] -> [N, K/2, 2]: (even k, odd k)
        qweight = pairs[..., 0] | (pairs[..., 1] << 4)  # [N, K/2, 2] -> [N, K/2]
        return {
            "qweight": qweight.contiguous(),
            "scales": qw.scales.clone(),
            "zeros": qw.zeros.clone(),
        }

    def unpack(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_features: int,
        in_features: int,
        group_size: int,
    ) -> QuantizedWeight:
        t = self.checked(tensors, out_features, in_features, group_size)
        q = t["qweight"]
        pairs = torch.stack([q & 0xF, q >> 4], dim=-1)  # [N, K/2] -> [N, K/2, 2]
        codes = pairs.reshape(out_features, in_features)  # [N, K/2, 2] -> [N, K]
        return QuantizedWeight(
            codes.contiguous(), t["scales"].clone(), t["zeros"].clone(), group_size
        )

    def quantization_config(
        self, group_size: int, sym: bool, *, lm_head: bool = False, embedding: bool = False
    ) -> dict[str, Any]:
        return {
            "quant_method": QUANT_METHOD,
            "format_version": FORMAT_VERSION,
            "bits": BITS,
            "group_size": group_size,
            "sym": sym,
            "lm_head": lm_head,
            "embedding": embedding,
        }

    def reads_config(self, cfg: Mapping[str, Any]) -> bool:
        if cfg.get("quant_method") != QUANT_METHOD:
            return False
        if cfg.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{QUANT_METHOD} format_version {cfg.get('format_version')!r} is not one this "
                f"fourbit reads (it reads {FORMAT_VERSION})"
            )
        return True

    def group_size_from_config(self, cfg: Mapping[str, Any]) -> int:
        return int(cfg["group_size"])
