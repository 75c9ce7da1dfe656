"""PyTorch's CPU int4 "tinygemm" kernel, fed from a QuantizedWeight.

Two aten ops (torch 2.13, CPU):

    _convert_weight_to_int4pack_for_cpu(codes int32 [N, K], innerKTiles) -> packed uint8 [N, K/2]
        Takes the codes one per int32 (not pre-packed nibbles; uint8 is refused with
        "expect weight to be kInt"), needs N % 16 == 0 and K even, and ignores
        innerKTiles (any value gives the same bytes).
    _weight_int4pack_mm_for_cpu(x [M, K], packed, G, scales_and_zeros [K/G, N, 2]) -> [M, N]
        x 2-D, contiguous, and the same dtype as scales_and_zeros (float32, bfloat16
        or float16); G in {32, 64, 128, 256}.

The zero-point convention. tinygemm dequantizes with a *float-domain* zero:

    w = (q - 8) * scale + zero_f

while a QuantizedWeight means w = (q - z) * scale with an integer z. Equal when
zero_f = (8 - z) * scale. Worked example: z = 3, scale = 0.5, code q = 5 means
(5 - 3) * 0.5 = 1.0; tinygemm computes (5 - 8) * 0.5 + (8 - 3) * 0.5 = -1.5 + 2.5 = 1.0.
On a symmetric grid z = 8, so zero_f = 0.

Exactness. |8 - z| <= 8 needs at most 3 significant bits, a float16 scale has 11, so
zero_f needs at most 14 and is exact in float32 (24); so is (q - 8) * scale, and their
sum (q - z) * scale (at most 15 significant bits, see quant/qweight.py). float32
scales_and_zeros therefore reproduce W_hat exactly: float32 is the exact mode. In
bfloat16 (8 bits) neither the float16 scale nor zero_f survives the cast, and in
float16 zero_f (up to 14 bits) does not fit either; those modes are approximations.

The packed layout is the kernel's business and depends on the CPU capability torch
dispatches to (aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack_kernel:
BLOCK_N = Vectorized<float>::size() * 4). ``probe_layout`` measures it at run time
by packing an index pattern, and ``dequantize_packed`` reads codes straight out of
the packed tensor, so no second copy of the weights needs to be kept. The layouts of
torch 2.13.0+cpu, per capability (docs/engines.md says where they were read):

    capability  block  byte d of a k-row in a full block   tail blocks (N % block)
    AVX512      64     channel d low, channel d + 32 high   16/32/48: channel 2d low, 2d + 1 high
    AVX2        32     channel d low, channel d + 16 high   16:       channel 2d low, 2d + 1 high
    DEFAULT     32     channel 2d low, 2d + 1 high          16:       same

Each block of ``nb`` output channels is stored as [K, nb/2] bytes, blocks in order
along N, i.e. the [N, K/2] tensor is really [N/block][K][block/2] bytes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from fourbit.quant.qweight import SYMMETRIC_ZERO, QuantizedWeight

log = logging.getLogger(__name__)

GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: N % 16 == 0
INNER_K_TILES = 1  # required argument, unused by the CPU op


def check_shape(out_features: int, in_features: int, group_size: int) -> None:
    """Raise naming the first tinygemm constraint that (N, K, G) fails."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group {group_size} is not one of tinygemm's {GROUP_SIZES}")
    if in_features % group_size:
        raise ValueError(f"K={in_features} is not a multiple of group {group_size}")
    if out_features % N_MULTIPLE:
        raise ValueError(f"N={out_features} is not a multiple of {N_MULTIPLE} (tinygemm packing)")


# torch's CPU capabilities whose int4mm_kernel.cpp has SIMD code; it is written for
# bfloat16 activations only (the AVX-512 and AVX2 overloads take BFloat16*), float32 and
# float16 take the scalar template.
VECTORIZED_CAPABILITIES = ("AVX2", "AVX512")


def vectorized(dtype: torch.dtype) -> bool:
    """Whether tinygemm has SIMD code for ``dtype`` on this CPU (see VECTORIZED_CAPABILITIES)."""
    return dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() in (
        VECTORIZED_CAPABILITIES
    )


def kernel_dtype(compute: torch.dtype, requested: str = "auto") -> torch.dtype:
    """The dtype tinygemm runs in for a compute dtype: bfloat16 instead of float32 where only
    bfloat16 is vectorized, unless float32 was asked for by name (``requested``).

    float32 runs the scalar template, over ten times slower than bfloat16 at decode shapes
    (issue 15; docs/engines.md has the measurements). bfloat16 rounds the scales, zeros
    and activations, so such an arm is held to bfloat16's tolerance, not exactness.
    """
    if requested == "auto" and compute == torch.float32 and vectorized(torch.bfloat16):
        return torch.bfloat16
    return compute


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32).contiguous(), INNER_K_TILES
    )


def to_tinygemm(
    qw: QuantizedWeight, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K/2] in the kernel's layout, scales_and_zeros [K/G, N, 2] in ``dtype``)."""
    n, k = qw.shape
    check_shape(n, k, qw.group_size)
    packed = _pack(qw.codes)  # [N, K] int32 -> [N, K/2] uint8, kernel layout
    scales = qw.scales.float()  # [N, K/G]
    zero_f = (SYMMETRIC_ZERO - qw.zeros.float()) * scales  # [N, K/G], exact in float32 (module doc)
    pairs = torch.stack([scales, zero_f], dim=-1)  # [N, K/G] x2 -> [N, K/G, 2]
    scales_and_zeros = pairs.transpose(0, 1).contiguous().to(dtype)  # [N, K/G, 2] -> [K/G, N, 2]
    return packed, scales_and_zeros


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    out_features: int,
) -> torch.Tensor:
    """x [..., K] @ W_hat.T -> [..., N], computed in scales_and_zeros' dtype, returned in x's."""
    if packed.shape[0] != out_features:
        raise ValueError(f"packed has {packed.shape[0]} rows, expected out_features={out_features}")
    x2 = x.reshape(-1, x.shape[-1]).to(scales_and_zeros.dtype).contiguous()  # [..., K] -> [M, K]
    # [M, K] -> [M, N]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group_size, scales_and_zeros)
    return y.reshape(*x.shape[:-1], out_features).to(x.dtype)  # [M, N] -> [..., N]


@dataclass(frozen=True)
class PackedLayout:
    """The kernel's packed layout as measured: blocks of output channels along N.

    A block of ``nb`` channels is [K, nb/2] bytes; in each k-row, nibble j (nibble 2d
    is the low half of byte d, 2d + 1 the high half) holds channel ``rows[nb][j]`` of
    the block. Full blocks have nb = ``block_n``; the last block may be narrower.
    """

    capability: str
    block_n: int
    rows: dict[int, tuple[int, ...]]

    def blocks(self, out_features: int) -> list[tuple[int, int]]:
        """(first channel, width) of each block along N."""
        return [
            (s, min(self.block_n, out_features - s)) for s in range(0, out_features, self.block_n)
        ]

    def predict(self, out_features: int, in_features: int) -> torch.Tensor:
        """For each nibble of the packed tensor, in byte order, the flat index n*K + k it holds."""
        k = torch.arange(in_features)
        parts = []
        for start, nb in self.blocks(out_features):
            channels = start + torch.tensor(self.rows[nb])  # [nb]
            flat_index = channels[None, :] * in_features + k[:, None]  # [K, nb]
            parts.append(flat_index.reshape(-1))  # [K, nb] -> [K*nb]
        return torch.cat(parts)


def _where_nibbles_land(out_features: int, in_features: int) -> torch.Tensor:
    """Pack an index pattern one bit plane at a time; read back which code each nibble holds."""
    index = torch.arange(out_features * in_features).reshape(out_features, in_features)  # [N, K]
    landed = torch.zeros(out_features * in_features, dtype=torch.int64)
    for bit in range((out_features * in_features - 1).bit_length()):
        packed = _pack((index >> bit) & 1)  # [N, K] codes 0/1 -> [N, K/2] bytes
        nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1)  # [N, K/2] -> [N, K/2, 2]
        nibbles = nibbles.reshape(-1)  # [N, K/2, 2] -> [N*K], low nibble first
        landed |= nibbles.to(torch.int64) << bit
    return landed


PROBE_N = 256  # larger than any block width torch uses (64 on AVX-512)
PROBE_K = 4


def _measure() -> PackedLayout:
    landed = _where_nibbles_land(PROBE_N, PROBE_K)
    k_of = landed % PROBE_K
    block_n = int(torch.nonzero(k_of != 0)[0])  # a block's first k-row ends where k first changes
    if block_n % N_MULTIPLE or PROBE_N % block_n:
        raise ValueError(f"first k-row holds {block_n} channels; not a block of 16s")
    rows = {block_n: tuple((landed[:block_n] // PROBE_K).tolist())}
    tails = range(N_MULTIPLE, block_n, N_MULTIPLE)
    for tail in tails:
        tail_block = _where_nibbles_land(block_n + tail, PROBE_K)[block_n * PROBE_K :]
        rows[tail] = tuple((tail_block[:tail] // PROBE_K - block_n).tolist())
    layout = PackedLayout(torch.backends.cpu.get_cpu_capability(), block_n, rows)
    # Validate the block model on shapes it was not read from: several full blocks, every
    # tail, and K = 6 (an odd number of bytes per channel).
    for n in [3 * block_n, *(2 * block_n + tail for tail in tails)]:
        if not torch.equal(layout.predict(n, 6), _where_nibbles_land(n, 6)):
            raise ValueError(f"block model does not predict the packing of N={n}, K=6")
    return layout


@functools.cache
def probe_layout() -> PackedLayout | None:
    """The packed layout on this machine, or None if it does not fit the block model."""
    try:
        return _measure()
    except ValueError as e:
        log.warning("tinygemm packed layout not understood (%s); dequantize_packed disabled", e)
        return None


def _progression(channels: tuple[int, ...]) -> slice | None:
    """``channels`` as a slice (start, stop, step > 0) when they are evenly spaced, else None."""
    step = channels[1] - channels[0] if len(channels) > 1 else 1
    if step <= 0 or any(b - a != step for a, b in zip(channels, channels[1:])):
        return None
    return slice(channels[0], channels[-1] + 1, step)


def _nibble_channels(rows: tuple[int, ...]) -> tuple[slice, slice] | None:
    """Where a block's low and high nibbles go, as channel slices; None if not evenly spaced.

    Every layout in the module doc's table is: AVX512/AVX2 full blocks put channels 0..nb/2-1 in the
    low nibbles and nb/2..nb-1 in the high ones; pairs put even channels low, odd ones high.
    """
    low, high = _progression(rows[0::2]), _progression(rows[1::2])
    return None if low is None or high is None else (low, high)


def supports_direct_dequant(out_features: int, in_features: int) -> bool:
    layout = probe_layout()
    if layout is None or in_features % 2:
        return False
    widths = {nb for _, nb in layout.blocks(out_features)}
    return all(nb in layout.rows and _nibble_channels(layout.rows[nb]) for nb in widths)


def dequantize_packed(
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    out_features: int,
    in_features: int,
) -> torch.Tensor | None:
    """W_hat float32 [N, K] read straight from the kernel's tensors; None where the layout
    is not understood.

    Computes (q - 8) * scale + zero_f in float32, as the kernel does; with float32
    scales_and_zeros from a float16-scale QuantizedWeight this equals qw.dequantize() bit for bit.

    Whole tensor ops, no Python loop over blocks (over ten times slower per layer): all
    full blocks are one [blocks, K, nb/2] view of the bytes, transposed once to [blocks,
    nb/2, K] while still bytes, and each nibble half is written into the channels the
    measured layout gives it through a strided slice. A tail block (N not a multiple of
    the block width) is one more such view.
    """
    if not supports_direct_dequant(out_features, in_features):
        return None
    n, k, g = out_features, in_features, group_size
    if tuple(packed.shape) != (n, k // 2) or tuple(scales_and_zeros.shape) != (k // g, n, 2):
        raise ValueError(
            f"packed {tuple(packed.shape)} / scales_and_zeros {tuple(scales_and_zeros.shape)} "
            f"do not fit N={n} K={k} G={g}: expected {(n, k // 2)} / {(k // g, n, 2)}"
        )
    layout = probe_layout()
    codes = torch.empty(n, k, dtype=torch.uint8)
    flat = packed.reshape(-1)  # [N, K/2] -> [N*K/2] bytes in kernel order
    full = n - n % layout.block_n
    spans = [(0, full, layout.block_n), (full, n, n - full)]  # full blocks, then the tail
    for first, last, nb in (span for span in spans if span[1] > span[0]):
        blocks = (last - first) // nb
        raw = flat[first * k // 2 : last * k // 2].view(blocks, k, nb // 2)  # [B, K, nb/2]
        raw = raw.transpose(1, 2).contiguous()  # [B, K, nb/2] -> [B, nb/2, K]
        target = codes[first:last].view(blocks, nb, k)  # [B*nb, K] -> [B, nb, K]
        low, high = _nibble_channels(layout.rows[nb])
        torch.bitwise_and(raw, 0xF, out=target[:, low])
        torch.bitwise_right_shift(raw, 4, out=target[:, high])
    sz = scales_and_zeros.float().transpose(0, 1).contiguous()  # [K/G, N, 2] -> [N, K/G, 2]
    # In place on one float32 buffer, each op in a single dtype: a mixed int8 x float32
    # addcmul and fresh temporaries cost several times more (page faults on every new buffer).
    w = torch.empty(n, k, dtype=torch.float32)
    w.copy_(codes.view(torch.int8).sub_(SYMMETRIC_ZERO))  # q - 8, exact in int8 and float32
    grouped = w.view(n, k // g, g)  # [N, K] -> [N, K/G, G]
    grouped.mul_(sz[..., :1]).add_(sz[..., 1:])  # (q - 8) * s exact, + zero_f rounds once
    return w
