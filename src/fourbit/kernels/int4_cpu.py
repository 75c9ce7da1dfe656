"""fourbit's own CPU 4-bit linear for decode: W4A16 and W4A8 on AVX2 and on AVX-512
(csrc/int4_cpu.cpp, csrc/multirow.inc), and the 8-bit W8A16 beside it.

Why its own kernel. PyTorch's tinygemm (kernels/tinygemm.py) is vectorized on x86 only
for bfloat16 activations, and vLLM has no 4-bit CPU path on AVX2 hosts at all. At batch 1
a 4-bit linear reads half a byte per weight and does a few instructions per weight; the
design below keeps both small (docs/engines.md has the measurements).

The layout, one per weight, repacked at load from any QuantizedWeight (all three
checkpoint formats decode to one through fourbit.formats), no dense copy kept:

    packed  uint8   [N, K/2]   row n, K in chunks of 64 columns = 32 bytes: byte i of
                               chunk c holds k = 64c + i in its low nibble and
                               k = 64c + 32 + i in its high one. If K % 64 == 32 (only
                               possible at G = 32) the last 16 bytes hold k = 64C + i low
                               and 64C + 16 + i high.
    scales  float32 [ceil(N/4), K/G, 4]  the QuantizedWeight's scales, exactly (float16
                               and bfloat16 are subsets of float32), in blocks of the 4
                               rows the kernel computes together: row n's group g is at
                               [n // 4, g, n % 4]; rows past N are padded with 0
    zeros   uint8   [ceil(N/4), K/G, 4]  integer zero points 0..15 (8 everywhere when
                               symmetric), blocked the same way

so one 32-byte load gives two 32-column blocks: ``bytes & 15`` and ``(bytes >> 4) & 15``,
each already in column order. That is llama.cpp's Q4_0 nibble order widened from 16 to
32 bytes, so the AVX2 unpack needs no lane-crossing insert. The 4-row blocks of scales
and zeros let the kernel apply four rows' zero-point terms in one vector operation per
group, instead of a scalar loop per row.

Bytes per weight: 1/2 + 5/G, i.e. 4.31 bits at G=128 (0.27 x bfloat16), 4.63 at G=64
(0.29 x), 5.25 at G=32 (0.33 x).

Numerics. With W_hat = s * (q - z) a group's dot product is s * (sum q*x - z * sum x):
the codes stay unsigned, and sum x is one number per group shared by every row.

    w4a16  x in float32 (bfloat16/float16 inputs are cast up): exact against the dense
           control up to float32 summation order.
    w4a8   x rounded per 32-column block to int8, d = amax/127, q = round-half-even(x *
           127/amax) (llama.cpp's Q8_0, with d kept in float32 instead of float16); the
           block products sum q*qy in int32 by _mm256_maddubs_epi16 (codes unsigned,
           activations signed) and _mm256_madd_epi16, as ggml's Q4_1 x Q8_1 dot does. The
           result is W_hat @ x_rounded: the only error is the activation rounding.
    w4a8_group  the same rounding per weight group instead of per 32 columns (one d per G
           columns: per 128 at G = 128, finer than the Q8_K, per 256, that Q4_K_M's dot
           products use). A group's products then need one scale, so a row sums the whole
           group in int32 and converts and scales it once (s * d), where w4a8 converts
           and scales every 32 columns. At G = 32 it is w4a8.

W4A8's tolerance. Its rounding moves a linear's output by ~0.5% (relative L2), the same as
llama.cpp's Q8_0 and less than the Q8_K (per 256 columns) that Q4_K_M's dot products use
(benchmarks/int4_kernel.py --activation-error). Through a whole model that is no longer
exact against the dense control: tests/test_vllm_plugin.py holds W4A8 to 0.3 max
|logprob difference| on its random 2-layer model.

Instructions per weight. W4A8 needs fewer than ggml's row dots (benchmarks/int4_kernel.py
--instructions counts both under callgrind, on the AVX2 path) because a 32-byte load feeds
two blocks with no lane-crossing unpack, codes stay unsigned (no sign tricks before
maddubs), four rows share each activation load, and a group's blocks are scaled into one
partial before its scale (ggml's Q4_0 8x8 GEMV, read in arch/x86/repack.cpp, spends a
sign-extending shuffle per code vector and a blend and two shuffles per multiply to pair
interleaved rows with broadcast activations). At batch 1 the time falls less than the
count: the weights' reads are most of it.

8-bit weights (``linear_int8``, W8A16). A matrix an arm keeps on the 8-bit grid
(fourbit.formats.int8: quantize_head 8, mixed_precision) runs from its stored layout, int8
codes [N, K] and its scales widened to float32 [N, K/G]: 8 codes at a time sign-extended
and converted to float32, multiplied by FMA with float32 x, each group's sum scaled once
per row. Exact against the dense control up to float32 summation order, as w4a16; about
1.03 bytes per weight at G = 128, so a quarter of the float32 matrix it replaces.
W8A8 (``int8_activations``, what an arm whose kernel rounds activations runs its 8-bit
matrices with): x rounded to int8 per weight group as W4A8_GROUP rounds it, and integer
dot products on the multi-row lanes kernel, from W8A8_MIN_ROWS rows (one row runs W8A16,
which is faster there); the codes go into vpdpbusd as q + 128 with each group's sum
corrected by 128 * sum(qy), exactly; on AVX2 |q| into maddubs against qy with q's sign.
Groups of 64 * n up to 512 (w8a8_runs).

ISA, chosen at run time for each call (``path``): AVX2+FMA code for every numerics and
group size; where the host has AVX-512 VNNI (avx512f/bw/vl/vnni), W4A16 at every group
size runs 16 columns per instruction on it instead of 8 (same group sums, float32
summation order aside), and W4A8 and W4A8_GROUP at groups that are multiples of 128:
vpdpbusd adds four code x activation products per int32 lane in one instruction (AVX2:
maddubs, madd, add) and one 64-byte load holds a whole 128-column group of a row. The
integer sums are the AVX2 path's lane for lane; only the float accumulation order differs.
What it buys is small where the weights' reads bound the time. FOURBIT_INT4_ISA=avx2 caps
a process at AVX2, =none hides the kernel; ``linear(..., on="avx2")`` runs the AVX2 code
for one call (benchmarks and tests time and check both paths in one process). Where the
ISA is missing or a shape is not covered (``unsupported``), callers fall back to tinygemm
by name.

Steps of several rows (csrc/multirow.inc). A batched decode step (one row per running
sequence, what a server runs) or a short prefill has M > 1 activation rows. The one-row
kernels above then unpack each weight again for every row; from ``multirow_min()`` rows
(4) the multi-row kernels unpack a weight row once per pass of 8 activation rows (4 on
AVX2, which has half the registers) and multiply it into each: W4A16 forms W_hat = s * (q -
z) per 8 columns (exactly the dense control's value) and accumulates W_hat * x by FMA;
W8A16 as W4A16 with 8-bit codes. Their activations are interleaved per pass
([K/8][rows][8]) so every load is a constant offset from one pointer, and the columns are
taken in slices of 512 so a pass's activations stay in L1 across a row block's 4 output
rows. W4A8_GROUP (groups of 64 * n) puts 8 activation rows in the 8 int32 lanes of one
vector (on AVX2 too; activations as [K/4][8][4]): 4 codes of an output row are broadcast
and multiplied into 4 columns of every row at once (vpdpbusd on AVX-512 VNNI, maddubs +
madd on AVX2), so a group's sums land one per lane and are scaled for all the rows in one
multiply, with no sum across lanes, and each activation load serves a block's 4 output
rows. W8A8 runs on the same kernel. Each W4A16, W8A16 and W4A8_GROUP output is the same sum
as the one-row kernel's up to float32 summation order (W8A8 has none: one row runs W8A16). The gain is in
the instructions per weight per row, not in the weights' reads (they are shared either
way); docs/engines.md has the measurements. FOURBIT_INT4_MULTIROW_MIN moves the
threshold, so ``benchmarks/int4_kernel.py --rows`` times both kernels on one step.
W4A8 (per 32 columns) and the int8 numerics at G = 32 keep the one-row kernels.

Prefetch. Each row block asks for the weights 4 KiB past its own before it starts
(csrc PREFETCH_AHEAD): a 4-row block is four short streams that the hardware prefetchers
restart at each 4 KiB page, which without it held every 4-bit kernel far below the
triad bandwidth that float32 sgemv reaches.

Threads: the op splits output rows over torch's intra-op threads (at::parallel_for).

The plugin's op. The extension also registers ``fourbit::int4_linear`` (csrc, "the
plugin's op"; its arguments and paths are fourbit/vllm_plugin/ops.py's), the op a compiled
vLLM model calls for every quantized linear. It runs the decode path in C++ and hands the
others (the dense expansion, tinygemm) to the Python op ``fourbit::int4_linear_general``:
through the dispatcher a Python op costs several times what ``linear`` itself takes at
decode shapes, once per quantized linear per token (docs/engines.md has the measurements).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from fourbit.quant.qweight import QuantizedWeight

log = logging.getLogger(__name__)

NUMERICS = ("w4a16", "w4a8", "w4a8_group")  # in the order of csrc/int4_cpu.cpp's Numerics codes
_NUMERICS_CODE = {name: code for code, name in enumerate(NUMERICS)}
INT8_ACTIVATIONS = frozenset({"w4a8", "w4a8_group"})  # the numerics that round x to int8
BLOCK = 32  # activation block (W4A8) and the K granularity of the layout
CHUNK = 64  # columns per 32 packed bytes


@functools.cache
def _ext():
    """The compiled extension, or None (with the import error logged once)."""
    try:
        from fourbit.kernels import _int4_cpu
    except ImportError as e:  # not built (e.g. a non-editable copy without a compiler)
        log.warning("fourbit int4 CPU kernel not built (%s); tinygemm is used instead", e)
        return None
    return _int4_cpu


def isa() -> str:
    """The best ISA path this CPU has: "avx512_vnni", "avx2", or "none" (no kernel here).
    FOURBIT_INT4_ISA=avx2 or =none caps it (read at every call)."""
    ext = _ext()
    return "none" if ext is None else ext.isa()


def multirow_min() -> int:
    """Rows from which a step runs the multi-row kernels (module doc, "Steps of several
    rows"); FOURBIT_INT4_MULTIROW_MIN sets it (read at every call)."""
    return _ext().multirow_min()


def path(numerics: str, group_size: int, rows: int = 1) -> str:
    """The ISA path a call of ``rows`` activation rows with these numerics and group size
    runs on this CPU."""
    ext = _ext()
    return "none" if ext is None else ext.path(_NUMERICS_CODE[numerics], group_size, rows)


def paths(numerics: str) -> str:
    """Which path runs ``numerics`` here, by group size, for a runtime string."""
    wide = path(numerics, 2 * CHUNK)
    one = wide if wide == path(numerics, CHUNK) else (
        f"{wide} at groups that are multiples of 128, {path(numerics, CHUNK)} at others")
    several = path(numerics, CHUNK, multirow_min())
    if several == path(numerics, CHUNK):  # no multi-row kernel, or the same ISA as one row
        return one
    return f"one row: {one}; several rows: {several} at groups that are multiples of 64"


def path_int8(rows: int = 1, int8_activations: bool = False) -> str:
    """The ISA path of the 8-bit kernel (linear_int8): W8A16 runs AVX2 code for one row and
    the host's ISA for several (module doc, "Steps of several rows"); W8A8 the host's."""
    host = isa()
    if host == "none":
        return host
    return host if rows >= (W8A8_MIN_ROWS if int8_activations else multirow_min()) else "avx2"


MAX_W8A8_GROUP = 512  # csrc/int4_cpu.cpp: its group sums stay exact in float32 up to here
W8A8_MIN_ROWS = 2  # csrc/int4_cpu.cpp: one row runs W8A16 even when int8 activations are asked


def w8a8_runs(group_size: int) -> bool:
    """Whether the W8A8 kernel runs 8-bit matrices of this group size on this host."""
    return isa() != "none" and group_size % CHUNK == 0 and group_size <= MAX_W8A8_GROUP


def unsupported(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why the kernel cannot run this shape on this host, or None if it can."""
    if isa() == "none":
        return "no fourbit int4 kernel for this CPU (needs AVX2+FMA, or the extension is not built)"
    if group_size % BLOCK or (group_size != BLOCK and group_size % CHUNK):
        return f"group {group_size} is not 32 or a multiple of 64"
    if in_features % group_size:
        return f"K={in_features} is not a multiple of group {group_size}"
    if out_features < 1:
        return "N=0"
    return None


@dataclass(frozen=True)
class PackedInt4:
    """A QuantizedWeight in the kernel's layout (module doc)."""

    packed: torch.Tensor  # uint8 [N, K/2]
    scales: torch.Tensor  # float32 [ceil(N/4), K/G, 4]
    zeros: torch.Tensor  # uint8 [ceil(N/4), K/G, 4]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zeros))


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] (K % 32 == 0) -> uint8 [N, K/2] in the kernel's nibble order."""
    n, k = codes.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    full = k - k % CHUNK
    c = codes[:, :full].reshape(n, full // CHUNK, 2, BLOCK)  # [N, K] -> [N, C, 2, 32]
    parts = [(c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, full // 2)]  # -> [N, C, 32] -> [N, 32C]
    if k % CHUNK:
        t = codes[:, full:].reshape(n, 2, 16)  # [N, 32] -> [N, 2, 16]
        parts.append(t[:, 0] | (t[:, 1] << 4))  # -> [N, 16]
    return torch.cat(parts, dim=1).contiguous()


ROWS = 4  # rows the kernel computes together (csrc/int4_cpu.cpp ROWS)


def block_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, K/G] -> [ceil(N/4), K/G, 4], rows past N zero."""
    n, groups = t.shape
    padded = torch.zeros(-(-n // ROWS) * ROWS, groups, dtype=t.dtype)
    padded[:n] = t
    blocks = padded.view(-1, ROWS, groups)  # [N', K/G] -> [N'/4, 4, K/G]
    return blocks.transpose(1, 2).contiguous()  # -> [N'/4, K/G, 4]


def repack(qw: QuantizedWeight) -> PackedInt4:
    n, k = qw.shape
    reason = unsupported(n, k, qw.group_size)
    if reason and not reason.startswith("no fourbit"):  # packing needs no CPU support
        raise ValueError(reason)
    return PackedInt4(
        pack_codes(qw.codes),
        block_rows(qw.scales.float()),
        block_rows(qw.zeros),
        qw.group_size,
    )


def linear(x: torch.Tensor, w: PackedInt4, numerics: str, on: str = "") -> torch.Tensor:
    """x [M, K] -> [M, N] float32; ``on`` picks the ISA path ("avx2" runs anywhere the
    kernel does), "" the one ``path`` names."""
    return _ext().linear(x, w.packed, w.scales, w.zeros, w.group_size, _NUMERICS_CODE[numerics], on)


def linear_tensors(x, packed, scales, zeros, group_size: int, numerics_code: int) -> torch.Tensor:
    """``linear`` on the bare tensors (what the plugin's custom op holds)."""
    return _ext().linear(x, packed, scales, zeros, group_size, numerics_code)


def numerics_code(numerics: str) -> int:
    return _NUMERICS_CODE[numerics]


def dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W_hat [N, K] in ``dtype`` read from the layout; in float32 bit for bit
    QuantizedWeight.dequantize(), in another dtype that rounded once (bfloat16 in the
    kernel's own loop, others by .to())."""
    w = _ext().dequantize(packed, scales, zeros, group_size, bfloat16=dtype == torch.bfloat16)
    return w if w.dtype == dtype else w.to(dtype)


def quantize_activations(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 numerics' rounding of x [M, K] per ``block`` columns (32: w4a8; the group:
    w4a8_group): (int8 [M, K], d float32 [M, K/block]), as the kernel does it."""
    q, d = _ext().quantize_activations(x, block)
    return q, d


def linear_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                int8_activations: bool = False) -> torch.Tensor:
    """x [M, K] @ W_hat.T -> [M, N] float32 with W_hat = codes int8 [N, K] * scales float32
    [N, K/G] per group (8-bit weights: W8A16, or W8A8 with ``int8_activations``; module doc)."""
    return _ext().linear_int8(x, codes, scales, group_size, int8_activations)
