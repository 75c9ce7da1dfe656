"""Standard GPTQ checkpoint, v1 ("checkpoint_format": "gptq"), as AutoGPTQ/GPTQModel
write it and vLLM's GPTQ loader (quant_method "gptq" -> auto_gptq) reads it.

    tensor   dtype        shape        holds
    qweight  int32        [K/8, N]     bits 4i..4i+3 of qweight[j, n] = codes[n, 8j + i]
    qzeros   int32        [K/G, N/8]   bits 4i..4i+3 of qzeros[g, j]  = zeros[8j + i, g] - 1   (v1!)
    scales   scale dtype  [K/G, N]     scales[g, n]  (AutoGPTQ writes float16)
    g_idx    int32        [K]          g_idx[k] = k // G  (no act-order)

    W_hat[n, k] = (codes[n, k] - zeros[n, g_idx[k]]) * scales[g_idx[k], n]

Everything is transposed relative to nn.Linear ([K, N] order) and packed along K for
the weights but along N for the zeros. Bits per weight: 4 + (16 + 4)/G + 32/N
(float16 scale and 4-bit stored zero per group, one int32 g_idx per column of K):
4.164 at G = 128, N = 4096.

The zero-point convention, and the v1 trap. GPTQ v1 stores zero - 1. On a symmetric
grid the zero is 8, so every stored nibble is 7 and every qzeros word is 0x77777777;
readers add the 1 back: stored 7 -> zero 8 -> W = (code - 8) * scale. A reader that
forgets the +1 shifts every weight by one step; a v1 writer asked for zero 0 stores
-1, which wraps to nibble 15 and reads back as zero 16 -- the v1 bug. vLLM
documents the +1 where it synthesizes zeros for the exllama kernel:
vllm/model_executor/kernels/linear/mixed_precision/exllama.py:81-93 ("-1 due to a bug
in the original GPTQ checkpoint format leading to exllama kernel adding 1 to the zero
points"; it fills bias - 1 = 7) and hard-codes v1 at exllama.py:137-138
(use_v2_format = False); rdna3_w4a16.py:104-109 says the same ("GPTQv1 quirk").

Symmetric only. vLLM 0.32 maps only (bits=4, sym=True) -> uint4b8, i.e. code - 8
(vllm/model_executor/layers/quantization/auto_gptq.py:99-100, error at 152-155), and
its CPU kernel then drops qzeros altogether (kernels/linear/mixed_precision/cpu.py:
144-145). An asymmetric grid written here would be served with zero 8 everywhere,
silently wrong, so ``pack`` refuses it. ``unpack`` still decodes any v1 qzeros
(zero = nibble + 1).

vLLM discards g_idx on load (layers/quantization/base_config.py:256) and rejects
desc_act=True (layers/quantization/utils/gptq_utils.py:32-37); it is written because
GPTQ readers expect it, and checked on unpack so an act-order checkpoint is refused
rather than decoded with the wrong groups. The nibble order of qweight and qzeros
(element 8j + i in bits 4i) is how vLLM's CPU kernel unpacks qweight
(kernels/linear/mixed_precision/cpu.py:75-77 via unpack_quantized_values_into_int32,
layers/quantization/utils/quant_utils.py:596-614).
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
from fourbit.quant.qweight import BITS, SYMMETRIC_ZERO, QuantizedWeight

V1_ZERO_OFFSET = 1  # stored zero = zero - 1


@register_format
class Gptq(Format):
    name = "gptq"
    layout = LAYOUTS[name]  # the module doc's table; in fourbit.layouts, the planner reads it too

    def supports(self, sym: bool) -> bool:
        return sym

    def pack(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        check_nibbles(qw)
        if not torch.all(qw.zeros == SYMMETRIC_ZERO):
            raise ValueError(
                "gptq stores symmetric grids only (zeros == 8): vLLM reads GPTQ as code - 8 and "
                "ignores qzeros, so any other zero would be served silently wrong"
            )
        n, k = qw.shape
        g = qw.group_size
        self.shapes(n, k, g)  # raises unless K % 8, N % 8 and K % G are 0
        qweight = pack_nibbles_int32(qw.codes.T, dim=0)  # [N, K] -> [K, N] -> [K/8, N]
        stored_zeros = (qw.zeros - V1_ZERO_OFFSET).T  # [N, K/G] -> [K/G, N], 8 -> 7
        qzeros = pack_nibbles_int32(stored_zeros, dim=1)  # [K/G, N] -> [K/G, N/8]
        scales = qw.scales.T.contiguous()  # [N, K/G] -> [K/G, N]
        g_idx = torch.arange(k, dtype=torch.int32) // g  # [K]
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}

    def unpack(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_features: int,
        in_features: int,
        group_size: int,
    ) -> QuantizedWeight:
        t = self.checked(tensors, out_features, in_features, group_size)
        if not torch.equal(t["g_idx"], torch.arange(in_features, dtype=torch.int32) // group_size):
            raise ValueError("gptq g_idx is not k // G (an act-order checkpoint); not supported")
        # Decoded from the transposed words, so the codes come out as [N, K] without a
        # transposed copy of the whole matrix.
        codes = unpack_nibbles_int32(t["qweight"].T, dim=1)  # [K/8, N] -> [N, K/8] -> [N, K]
        stored = unpack_nibbles_int32(t["qzeros"], dim=1).T  # [K/G, N/8] -> [K/G, N] -> [N, K/G]
        zeros = stored + V1_ZERO_OFFSET
        if torch.any(zeros > 15):
            raise ValueError(
                "gptq qzeros hold nibble 15, i.e. zero 16 (the v1 zero-0 wrap); not a 4-bit zero"
            )
        scales = t["scales"].T  # [K/G, N] -> [N, K/G]
        return QuantizedWeight(codes, scales.contiguous(), zeros.contiguous(), group_size)

    def quantization_config(
        self, group_size: int, sym: bool, *, lm_head: bool = False, embedding: bool = False
    ) -> dict[str, Any]:
        refuse_quantized_embedding(self.name, embedding)
        if not self.supports(sym):
            raise ValueError(
                "gptq stores symmetric grids only (vLLM's GPTQ loader accepts sym=True only)"
            )
        return {
            "quant_method": "gptq",
            "checkpoint_format": "gptq",  # v1: stored zero = zero - 1
            "bits": BITS,
            "group_size": group_size,
            "desc_act": False,
            "sym": True,
            "lm_head": lm_head,
        }

    def reads_config(self, cfg: Mapping[str, Any]) -> bool:
        # Configs written before checkpoint_format existed are v1.
        return (
            str(cfg.get("quant_method", "")).lower() == "gptq"
            and cfg.get("checkpoint_format", "gptq") == "gptq"
            and cfg.get("bits") == BITS
        )

    def group_size_from_config(self, cfg: Mapping[str, Any]) -> int:
        return int(cfg["group_size"])
