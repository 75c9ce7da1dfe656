"""The one opaque op every fourbit-quantized linear calls: ``torch.ops.fourbit.int4_linear``
(and ``fourbit::int8_linear`` for a matrix on the 8-bit grid, for the same reasons).

Why a custom op. On CPU vLLM compiles the model in CompilationMode.DYNAMO_TRACE_ONCE
(vllm/platforms/cpu.py:356-377): one Dynamo trace, then *all guards dropped*
(vllm/compilation/wrapper.py:115-141; the mode's own doc at config/compilation.py:441-443
says "Requires no dynamic-shape-dependent control-flow"). A Python ``if rows < threshold``
in ``apply`` would be traced once and the branch taken for the warm-up batch baked in
for every batch size. Inside a ``torch.library.custom_op`` the branch runs at call time.

Why the knobs are a tensor. vLLM 0.32 saves the compiled model (AOT compile, on by
default with torch >= 2.10, vllm/envs.py:377-386) under
VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>, the hash being
vllm_config.compute_hash() (vllm/compilation/decorators.py:548-570, caching.py:572-588),
and that hash does *not* cover the quantization config's contents, only its name
(config/vllm.py:530-531: "if self.quant_config: pass  # should be captured by
model_config.quantization"). A threshold passed as a Python int would become a graph
constant and a later run with another threshold could load the stale graph. So
threshold and mode travel as an int64 buffer (a graph *input*), the compute dtype is
read off the buffers inside the op, and the traced graph is identical whatever the knobs.
(group_size and out_features are constants, but they are fixed by the checkpoint,
whose path is part of the hash.)

Kernels (knobs[3]), one set of weights each:
    w4a16 / w4a8 / w4a8_group   fourbit's kernel (kernels/int4_cpu.py) on its own layout:
                                packed uint8 [N, K/2], scales float32 [N, K/G], zeros
                                uint8 [N, K/G]; computes in float32
    tinygemm                    aten._weight_int4pack_mm_for_cpu: packed in torch's layout,
                                scales_and_zeros [K/G, N', 2] in the dtype it runs in
Paths:
    rows <  threshold (or mode NEVER)  the kernel
    rows >= threshold, mode DIRECT     W_hat read out of the kernel's own packed tensors
                                       (int4_cpu.dequantize, a block of rows at a time /
                                       tinygemm.dequantize_packed), dense matmul
    rows >= threshold, mode KEPT       W_hat from a kept copy of the codes, dense matmul
                                       (tinygemm layouts the reader does not know)
    mode KEPT with threshold 0         dense only (shapes no kernel can take)
The dense paths compute W_hat in float32 (exact, see quant/qweight.py; from tinygemm's
tensors only when they are float32), cast it to the compute dtype knobs[2] and multiply
there (fourbit's layout is expanded straight to bfloat16, each row rounded once). Inputs
are cast to the kernel's dtype and outputs back to x's.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from fourbit.kernels import int4_cpu, tinygemm
from fourbit.quant.int8 import Int8Weight

MODE_NEVER = 0  # always tinygemm
MODE_DIRECT = 1  # dequantize from the packed tinygemm tensors
MODE_KEPT = 2  # dequantize from a kept copy of the codes

NO_THRESHOLD = 1 << 62  # "never switch to the dense path"

KERNEL_TINYGEMM = 0
# fourbit's kernel, one code per numerics of kernels/int4_cpu.py (w4a16 1, w4a8 2, w4a8_group 3)
KERNEL_CODE = {"tinygemm": KERNEL_TINYGEMM,
               **{name: 1 + i for i, name in enumerate(int4_cpu.NUMERICS)}}
KERNEL_NAME = {v: k for k, v in KERNEL_CODE.items()}

# Calls per path in this process ("w4a16", "w4a8", "w4a8_group", "tinygemm", "direct", "kept",
# "w8a16", "w8a8" and "int8_dense" for 8-bit matrices, and "embedding" for a quantized table's
# lookups), the Python paths only: path_calls() adds the extension op's, for tests and
# sanity checks.
calls: Counter[str] = Counter()


def kept_copy(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
    """(codes uint8 [N, K], scales fp32 [N, K/G], offsets fp32 [N, K/G]) with W = codes*s + off.

    off = -zeros * scale. Every term is exact in float32 (4-bit integer times a float16
    scale needs <= 15 significant bits), and so is the sum, because the exact result
    (code - zero) * scale is representable and IEEE addition rounds correctly.
    """
    s = scales.float()
    return codes.contiguous(), s.contiguous(), (-zeros.float() * s).contiguous()


def dequantize_kept(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> torch.Tensor:
    """W_hat float32 [N, K] from ``kept_copy``'s tensors."""
    n, k = codes.shape
    grouped = codes.view(n, k // group_size, group_size).float()  # [N, K] -> [N, K/G, G]
    w = torch.addcmul(offsets.unsqueeze(-1), grouped, scales.unsqueeze(-1))  # off + q*s
    return w.view(n, k)  # [N, K/G, G] -> [N, K]


# fourbit's layout is expanded to W_hat at most this many bytes at a time. A whole
# large matrix (gate_up at Qwen2.5-0.5B's shapes: 35 MB) is above glibc's largest mmap
# threshold (32 MB), so every call would map it afresh and fault its pages in: 10 of the
# 11 ms its expansion took (docs/engines.md).
DENSE_BLOCK_BYTES = 16 << 20


def linear_by_row_blocks(x: torch.Tensor, n: int, step: int, expand) -> torch.Tensor:
    """x [M, K] @ W_hat.T -> [M, N] in x's dtype, W_hat expanded `step` of its N rows at a
    time by expand(first, last) -> [last - first, K], so no whole expansion is held."""
    parts = [F.linear(x, expand(first, min(n, first + step)).to(x.dtype))  # -> [M, rows]
             for first in range(0, n, step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def dense_blocks(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """x [M, K] @ W_hat.T -> [M, N] in x's dtype, W_hat read out of fourbit's layout in x's
    dtype a block of rows (a multiple of the layout's 4) at a time."""
    n, k = packed.shape[0], packed.shape[1] * 2
    row_bytes = x.element_size() * k
    step = max(int4_cpu.ROWS, DENSE_BLOCK_BYTES // row_bytes // int4_cpu.ROWS * int4_cpu.ROWS)

    def expand(first: int, last: int) -> torch.Tensor:
        blocks = slice(first // int4_cpu.ROWS, -(-last // int4_cpu.ROWS))  # [N/4, K/G, 4] rows
        return int4_cpu.dequantize(packed[first:last], scales[blocks], zeros[blocks], group_size,
                                   x.dtype)

    return linear_by_row_blocks(x, n, step, expand)


def _dense_weight(packed, scales_and_zeros, codes, scales, offsets, zeros, mode, group_size,
                  in_features):
    """W_hat of the tinygemm kernel's tensors (DIRECT) or of the kept copy (KEPT)."""
    if mode == MODE_DIRECT:
        n = packed.shape[0]
        w = tinygemm.dequantize_packed(packed, scales_and_zeros, group_size, n, in_features)
        if w is None:
            raise RuntimeError("fourbit: direct dequant selected but the packed layout is unknown")
        return w
    return dequantize_kept(codes, scales, offsets, group_size)


def int4_linear_impl(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    zeros: torch.Tensor,
    knobs: torch.Tensor,
    group_size: int,
    out_features: int,
) -> torch.Tensor:
    """x [M, K] -> [M, out_features] in x's dtype; knobs = int64 [threshold, mode, dtype
    code, kernel code]."""
    # The extension's op takes the same decision for its decode path (csrc, "the plugin's op").
    threshold, mode, _, kernel = (int(v) for v in knobs.tolist())
    rows, in_features = x.shape
    if rows == 0:
        return x.new_empty((0, out_features))
    use_dense = mode != MODE_NEVER and rows >= threshold
    if use_dense:
        compute = knobs_dtype(knobs)
        calls["direct" if mode == MODE_DIRECT else "kept"] += 1
        if mode == MODE_DIRECT and kernel != KERNEL_TINYGEMM:
            y = dense_blocks(x.to(compute), packed, scales, zeros, group_size)  # [M, N]
        else:
            w = _dense_weight(packed, scales_and_zeros, codes, scales, offsets, zeros, mode,
                              group_size, in_features)
            y = F.linear(x.to(compute), w.to(compute))  # [M, K] x [N', K] -> [M, N']
    elif kernel != KERNEL_TINYGEMM:
        calls[KERNEL_NAME[kernel]] += 1
        numerics = int4_cpu.numerics_code(KERNEL_NAME[kernel])
        y = int4_cpu.linear_tensors(x, packed, scales, zeros, group_size, numerics)  # [M, N]
    else:
        calls["tinygemm"] += 1
        xc = x.to(scales_and_zeros.dtype).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xc, packed, group_size, scales_and_zeros
        )  # [M, K] -> [M, N']
    if y.shape[1] != out_features:
        y = y[:, :out_features].contiguous()  # drop the rows padded to tinygemm's multiple of 16
    return y if y.dtype == x.dtype else y.to(x.dtype)


# The op the traced graph holds. With fourbit's kernel built, fourbit::int4_linear is the
# extension's (kernels/csrc/int4_cpu.cpp, "the plugin's op"; the cost it saves is in
# kernels/int4_cpu.py): it runs the decode path itself and hands every other path to
# fourbit::int4_linear_general below, this function. Without the extension the Python op
# is fourbit::int4_linear itself.
def _int4_linear_fake(
    x, packed, scales_and_zeros, codes, scales, offsets, zeros, knobs, group_size, out_features
):
    return x.new_empty((x.shape[0], out_features))


int4_linear_general = torch.library.custom_op("fourbit::int4_linear_general",
                                              mutates_args=())(int4_linear_impl)
int4_linear_general.register_fake(_int4_linear_fake)
if int4_cpu._ext() is None:
    torch.library.custom_op("fourbit::int4_linear", mutates_args=())(
        int4_linear_impl).register_fake(_int4_linear_fake)
else:
    torch.library.register_fake("fourbit::int4_linear")(_int4_linear_fake)


def path_calls() -> Counter[str]:
    """Calls per path in this process since ``clear_calls``: ``calls`` and the decode-path
    calls the extension's op counts itself."""
    counts = Counter(calls)
    ext = int4_cpu._ext()
    if ext is not None:
        counts.update({name: n for name, n in zip(int4_cpu.NUMERICS, ext.op_kernel_calls())
                       if n})
    return counts


def clear_calls() -> None:
    calls.clear()
    ext = int4_cpu._ext()
    if ext is not None:
        ext.op_kernel_calls(reset=True)


# From this many rows (prefill) an 8-bit matrix is expanded and multiplied densely, a block
# of INT8_BLOCK_ROWS rows of W_hat at a time, so the expansion of a large head stays small.
INT8_DENSE_ROWS = 32
INT8_BLOCK_ROWS = 4096


def int8_linear_impl(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     group_size: int, int8_activations: bool = False) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype for an 8-bit matrix: codes int8 [N, K], scales float32
    [N, K/G]. fourbit's W8A16 kernel (W8A8 with ``int8_activations``) for small batches where
    the ISA has it; otherwise the exact W_hat (fourbit.quant.int8), block by block,
    multiplied in x's dtype."""
    if x.shape[0] < INT8_DENSE_ROWS and int4_cpu.isa() != "none":
        calls["w8a8" if int8_activations and x.shape[0] >= int4_cpu.W8A8_MIN_ROWS else "w8a16"] += 1
        y = int4_cpu.linear_int8(x, codes, scales, group_size, int8_activations)  # [M, N] float32
        return y if y.dtype == x.dtype else y.to(x.dtype)
    calls["int8_dense"] += 1
    return linear_by_row_blocks(  # [M, N]
        x, codes.shape[0], INT8_BLOCK_ROWS,
        lambda first, last: Int8Weight(codes[first:last], scales[first:last], group_size).dequantize(x.dtype))


int8_linear = torch.library.custom_op("fourbit::int8_linear", mutates_args=())(int8_linear_impl)


@int8_linear.register_fake
def _int8_linear_fake(x, codes, scales, group_size, int8_activations=False):
    return x.new_empty((x.shape[0], codes.shape[0]))


# The dense path's compute dtype travels in knobs[2] (tinygemm uses scales_and_zeros' dtype).
_DTYPE_CODES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
DTYPE_CODE = {v: k for k, v in _DTYPE_CODES.items()}


def knobs_dtype(knobs: torch.Tensor) -> torch.dtype:
    return _DTYPE_CODES[int(knobs[2])]
