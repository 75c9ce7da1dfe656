"""fourbit's CPU 4-bit linear (kernels/int4_cpu.py) against plain PyTorch references.

Shapes sweep odd N (a last row block shorter than the kernel's 4 rows), K at every group
size including K % 64 == 32 (the half chunk at G = 32), symmetric and asymmetric zeros,
and batches of 1 to 17 rows (one row; the multi-row kernels' passes of 4 or 8 rows, full
and short). W4A16 is held to float32 summation error of x @ W_hat.T;
W4A8 and W4A8_GROUP to the same bound against x_rounded @ W_hat.T, where x_rounded is
recomputed here from Q8_0's definition (per 32 columns, or per group), so both the
kernel's integer arithmetic and its rounding are checked. Every numerics is checked on
each ISA path: AVX2 anywhere the kernel runs, AVX-512 VNNI where the host has it (its
tests skip elsewhere; on such a host the AVX2 code is checked too, by asking for it).
The ISA tests skip where the host has no AVX2 (the fallback test runs anywhere).
"""

from __future__ import annotations

import pytest
import torch

from fourbit.kernels import int4_cpu
from fourbit.quant.qweight import QuantizedWeight

needs_kernel = pytest.mark.skipif(int4_cpu.isa() == "none", reason="no AVX2+FMA kernel here")
# Every ISA path the kernel has; a path this host lacks is skipped, by name.
PATHS = [
    "avx2",
    pytest.param("avx512_vnni", marks=pytest.mark.skipif(
        int4_cpu.isa() != "avx512_vnni", reason="this host has no AVX-512 VNNI")),
]

# (N, K, G): odd and small N, K with the half chunk (96, 160, 1120 at G=32), every group
# size, K over several of the multi-row kernels' 512-column slices (1120, 1152)
SHAPES = [(1, 32, 32), (7, 96, 32), (33, 160, 32), (5, 64, 64), (13, 192, 64), (9, 256, 128),
          (130, 384, 128), (3, 512, 256), (6, 1120, 32), (5, 1152, 64)]


def random_qweight(n: int, k: int, g: int, sym: bool, seed: int) -> QuantizedWeight:
    from conftest import random_qweight as draw

    return draw(n, k, g, sym=sym, gen=torch.Generator().manual_seed(seed))


def q8_reference(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [M, K] rounded as Q8_0 defines it, per ``block`` columns: d = amax/127,
    q = round(x*127/amax) (ties to even), x_rounded = d * q; computed in float32 like the
    kernel."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // block, block)  # [M, K] -> [M, K/block, block]
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)
    d = amax / 127.0
    return q.reshape(m, k), d.reshape(m, k // block), (q * d).reshape(m, k)


def activation_block(numerics: str, group_size: int) -> int:
    """The columns one int8 activation scale covers (kernels/int4_cpu.py numerics)."""
    return group_size if numerics == "w4a8_group" else 32


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A float32 summation bound for x @ w.T: 1e-6 of sum |x| |w| per output (K <= 512 terms;
    the kernel's extra term s*z*sum(x) is covered since |q - z| <= 15 and |q|, |z| <= 15)."""
    return 1e-6 * 16 * (x.abs().double() @ w.abs().double().T) + 1e-30


def test_pack_layout_golden():
    """Byte i of a 64-column chunk is k=i low, k=32+i high; the half chunk k=i low, 16+i high."""
    k = 96
    codes = (torch.arange(k) % 16).to(torch.uint8)[None]  # [1, 96]: code of column k is k % 16
    packed = int4_cpu.pack_codes(codes)
    assert packed.shape == (1, 48) and packed.dtype == torch.uint8
    want = [(i % 16) | (((32 + i) % 16) << 4) for i in range(32)]  # chunk 0
    want += [((64 + i) % 16) | (((80 + i) % 16) << 4) for i in range(16)]  # half chunk
    assert packed[0].tolist() == want
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_cpu.pack_codes(torch.zeros(2, 48, dtype=torch.uint8))


@needs_kernel
@pytest.mark.parametrize(("n", "k", "g"), SHAPES)
@pytest.mark.parametrize("sym", [True, False])
def test_dequantize_is_exact(n, k, g, sym):
    qw = random_qweight(n, k, g, sym, seed=n * k + g)
    w = int4_cpu.repack(qw)
    assert w.shape == (n, k)
    exact = qw.dequantize()
    assert torch.equal(int4_cpu.dequantize(w.packed, w.scales, w.zeros, g), exact)
    # bfloat16 (a bfloat16 prefill's dense path): the exact W_hat rounded once, as .to() does
    narrow = int4_cpu.dequantize(w.packed, w.scales, w.zeros, g, torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, exact.bfloat16())


@needs_kernel
def test_all_zero_group_and_extreme_codes():
    """Codes 0 and 15 against zero 0 and 15 (the largest |q - z|), and an all-zero group."""
    n, k, g = 4, 128, 64
    codes = torch.tensor([0, 15], dtype=torch.uint8).repeat(n, k // 2)
    zeros = torch.tensor([[0, 15], [15, 0], [8, 8], [0, 0]], dtype=torch.uint8)
    scales = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.0, 0.0], [0.125, 4.0]]).half()
    qw = QuantizedWeight(codes, scales, zeros, g)
    w = int4_cpu.repack(qw)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ qw.dequantize().double().T
    for numerics in int4_cpu.NUMERICS:
        y = int4_cpu.linear(x, w, numerics)
        assert torch.all(y[:, 2] == 0)  # zero scales: exactly zero, not a rounding residue
    y = int4_cpu.linear(x, w, "w4a16")
    assert torch.all((y.double() - ref).abs() <= error_bound(x, qw.dequantize()))


@needs_kernel
@pytest.mark.parametrize(("n", "k", "g"), SHAPES)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 17])
@pytest.mark.parametrize("on", PATHS)
def test_w4a16_matches_float_reference(n, k, g, sym, rows, on):
    qw = random_qweight(n, k, g, sym, seed=7 * n + k)
    w_hat = qw.dequantize()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = int4_cpu.linear(x, int4_cpu.repack(qw), "w4a16", on)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    err = (y.double() - x.double() @ w_hat.double().T).abs()
    assert torch.all(err <= error_bound(x, w_hat)), err.max()


@needs_kernel
@pytest.mark.parametrize("block", [32, 64, 128, 256])
def test_int8_rounding_is_q8_0_per_block(block):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 512, generator=gen) * torch.logspace(-3, 2, 512)  # blocks of every scale
    x[1, :block] = 0  # an all-zero block: d = 0, q = 0
    x[2, 40] = 1000.0  # one outlier owns its block's scale
    q, d = int4_cpu.quantize_activations(x, block)
    q_ref, d_ref, _ = q8_reference(x, block)
    assert q.dtype == torch.int8 and torch.equal(q.float(), q_ref)
    assert d.shape == (5, 512 // block) and torch.equal(d, d_ref)
    assert q.abs().max() == 127


@needs_kernel
@pytest.mark.parametrize(("n", "k", "g"), SHAPES)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 17])
@pytest.mark.parametrize("numerics", ["w4a8", "w4a8_group"])
@pytest.mark.parametrize("on", PATHS)
def test_int8_numerics_match_rounded_reference(n, k, g, sym, rows, numerics, on):
    qw = random_qweight(n, k, g, sym, seed=11 * n + k)
    w_hat = qw.dequantize()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + 5))
    if on != int4_cpu.path(numerics, g, rows) and on != "avx2":
        assert g % 128  # one row: VNNI covers groups of 128 * n; several: w4a8_group at 64 * n
        with pytest.raises(RuntimeError, match="it runs 'avx2'"):
            int4_cpu.linear(x, int4_cpu.repack(qw), numerics, on)
        return
    y = int4_cpu.linear(x, int4_cpu.repack(qw), numerics, on)
    _, _, x_rounded = q8_reference(x, activation_block(numerics, g))
    err = (y.double() - x_rounded.double() @ w_hat.double().T).abs()
    assert torch.all(err <= error_bound(x_rounded, w_hat)), err.max()
    # and the rounding itself is the only other difference: at most d/2 per activation
    exact = x.double() @ w_hat.double().T
    half_step = (x_rounded - x).abs().double() @ w_hat.abs().double().T
    assert torch.all((y.double() - exact).abs() <= half_step + error_bound(x, w_hat))
    assert torch.any((y.double() - exact).abs() > error_bound(x, w_hat))  # it does round


@needs_kernel
def test_low_precision_inputs_are_cast_up():
    qw = random_qweight(20, 128, 64, False, seed=1)
    w = int4_cpu.repack(qw)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = int4_cpu.linear(x, w, "w4a16")
    assert y.dtype == torch.float32
    assert torch.equal(y, int4_cpu.linear(x.float(), w, "w4a16"))


def test_unsupported_shapes_are_named():
    if int4_cpu.isa() != "none":
        assert int4_cpu.unsupported(16, 128, 128) is None
        assert "group 16" in int4_cpu.unsupported(16, 128, 16)
        assert "group 96" in int4_cpu.unsupported(16, 192, 96)
        assert "K=160 is not a multiple of group 64" in int4_cpu.unsupported(16, 160, 64)
    with pytest.raises(ValueError, match="group 16"):
        int4_cpu.repack(random_qweight(4, 64, 16, True, seed=0))


def test_fallback_when_the_isa_is_missing(monkeypatch):
    """FOURBIT_INT4_ISA=none hides the kernel as a CPU without AVX2 would: callers are told
    why, and the op itself refuses rather than running code the CPU lacks."""
    monkeypatch.setenv("FOURBIT_INT4_ISA", "none")
    assert int4_cpu.isa() == "none"
    assert "AVX2" in int4_cpu.unsupported(16, 128, 128)
    qw = random_qweight(8, 128, 128, True, seed=0)
    w = int4_cpu.repack(qw)  # packing needs no ISA
    if int4_cpu._ext() is not None:
        with pytest.raises(RuntimeError, match="AVX2"):
            int4_cpu.linear(torch.randn(1, 128), w, "w4a8")


@needs_kernel
@pytest.mark.parametrize("numerics", int4_cpu.NUMERICS)
def test_threads_split_rows_not_sums(numerics):
    """Rows are split over torch's threads, each row's sum stays on one thread: any thread
    count gives the same bits."""
    qw = random_qweight(1030, 256, 64, False, seed=5)  # many row blocks, a short last one
    w = int4_cpu.repack(qw)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int4_cpu.linear(x, w, numerics)
        torch.set_num_threads(2)
        two = int4_cpu.linear(x, w, numerics)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


# --- 8-bit weights (W8A16) ---------------------------------------------------------------


def random_int8(n: int, k: int, g: int, seed: int):
    """An Int8Weight as fourbit.quant.int8 rounds one, and its scales widened to float32."""
    from fourbit.quant.int8 import quantize_int8

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    qw = quantize_int8(w, g)
    return qw, qw.scales.float().contiguous()


@needs_kernel
@pytest.mark.parametrize(("n", "k", "g"), [(1, 32, 32), (7, 96, 32), (13, 192, 64), (130, 384, 128),
                                           (3, 512, 256), (5, 48, 16), (6, 1152, 64)])
@pytest.mark.parametrize("rows", [1, 2, 4, 9, 17])
@pytest.mark.parametrize("on", PATHS)
def test_w8a16_matches_float_reference(n, k, g, rows, on, monkeypatch):
    """On each ISA path (linear_int8 runs the host's; FOURBIT_INT4_ISA caps it at AVX2);
    K = 1152 spans three of the multi-row kernels' 512-column slices."""
    monkeypatch.setenv("FOURBIT_INT4_ISA", on)
    assert int4_cpu.path_int8(rows) == ("avx2" if rows < int4_cpu.multirow_min() else on)
    qw, scales = random_int8(n, k, g, seed=n + k)
    w_hat = qw.dequantize()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = int4_cpu.linear_int8(x, qw.codes, scales, g)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    err = (y.double() - x.double() @ w_hat.double().T).abs()
    # float32 sums of products of 8-bit codes: 1e-6 x 128 of sum |x| |w| covers them
    assert torch.all(err <= 8 * error_bound(x, w_hat)), err.max()


@needs_kernel
@pytest.mark.parametrize(("n", "k", "g"), [(1, 64, 64), (13, 192, 64), (130, 384, 128),
                                           (3, 512, 256), (5, 1024, 512), (6, 1152, 64)])
@pytest.mark.parametrize("rows", [2, 3, 8, 9, 17])
@pytest.mark.parametrize("on", PATHS)
def test_w8a8_matches_rounded_reference(n, k, g, rows, on, monkeypatch):
    """W8A8 against x rounded per group (Q8_0's definition, recomputed here) @ W_hat.T on
    each ISA path (vpdpbusd's q + 128 with its correction; maddubs' sign trick), extreme
    codes (-127 and 127, where an unsigned offset or int16 pair sums would overflow first)
    and passes of 8 rows, full and short."""
    monkeypatch.setenv("FOURBIT_INT4_ISA", on)
    assert int4_cpu.path_int8(rows, int8_activations=True) == on
    assert rows >= int4_cpu.W8A8_MIN_ROWS  # one row runs W8A16: test_w8a8_leaves_one_row_exact
    qw, scales = random_int8(n, k, g, seed=n + k + 1)
    qw.codes[0, : k // 2] = 127
    qw.codes[-1, k // 2:] = -127
    w_hat = qw.dequantize()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + 2))
    x[0, :g] = 100 * x[0, :g].abs()  # a group of large positive activations: sums near the limit
    y = int4_cpu.linear_int8(x, qw.codes, scales, g, int8_activations=True)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    _, _, x_rounded = q8_reference(x, g)
    err = (y.double() - x_rounded.double() @ w_hat.double().T).abs()
    assert torch.all(err <= 8 * error_bound(x_rounded, w_hat)), err.max()
    exact = x.double() @ w_hat.double().T
    assert torch.any((y.double() - exact).abs() > 8 * error_bound(x, w_hat))  # it does round


@needs_kernel
def test_w8a8_leaves_one_row_exact():
    """One row runs W8A16 even when int8 activations are asked (it is faster there): bit for
    bit the W8A16 call's result."""
    qw, scales = random_int8(130, 384, 128, seed=2)
    x = torch.randn(1, 384, generator=torch.Generator().manual_seed(3))
    assert int4_cpu.path_int8(1, int8_activations=True) == "avx2"
    assert torch.equal(int4_cpu.linear_int8(x, qw.codes, scales, 128, int8_activations=True),
                       int4_cpu.linear_int8(x, qw.codes, scales, 128))


@needs_kernel
def test_w8a8_names_the_groups_it_takes():
    qw, scales = random_int8(4, 96, 32, seed=1)
    x = torch.randn(2, 96)
    with pytest.raises(RuntimeError, match="W8A8 takes groups of 64 \\* n up to 512"):
        int4_cpu.linear_int8(x, qw.codes, scales, 32, int8_activations=True)
    assert int4_cpu.w8a8_runs(64) and int4_cpu.w8a8_runs(512)
    assert not int4_cpu.w8a8_runs(32) and not int4_cpu.w8a8_runs(1024)


@needs_kernel
def test_w8a16_splits_rows_over_threads_and_names_bad_inputs():
    qw, scales = random_int8(1030, 256, 64, seed=3)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int4_cpu.linear_int8(x, qw.codes, scales, 64)
        torch.set_num_threads(2)
        two = int4_cpu.linear_int8(x, qw.codes, scales, 64)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    for int8_activations in (False, True):  # and W8A8's rows split the same way
        eight = [None, None]
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                eight[threads - 1] = int4_cpu.linear_int8(x, qw.codes, scales, 64, int8_activations)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(eight[0], eight[1])
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        int4_cpu.linear_int8(x, qw.codes, qw.scales, 64)  # float16, as stored: widen it first
    with pytest.raises(RuntimeError, match="group 24"):
        int4_cpu.linear_int8(x, qw.codes, scales, 24)


@needs_kernel
def test_each_call_names_its_path(monkeypatch):
    """One row: where the host has AVX-512 VNNI, it runs the int8 numerics at groups of
    128 * n and W4A16 at every group, AVX2 every other call and 8-bit weights. Several rows
    (the multi-row kernels: W4A16, W4A8_GROUP at groups of 64 * n, W8A16) and W8A8 from 2
    rows run the host's ISA; W4A8 and G = 32 int8 stay on the one-row path. FOURBIT_INT4_ISA=avx2 caps a whole
    process at AVX2."""
    host = int4_cpu.isa()
    assert host in ("avx2", "avx512_vnni")
    for numerics in ("w4a8", "w4a8_group"):
        assert int4_cpu.path(numerics, 128) == int4_cpu.path(numerics, 256) == host
        assert int4_cpu.path(numerics, 64) == int4_cpu.path(numerics, 32) == "avx2"
        assert int4_cpu.path(numerics, 32, rows=8) == "avx2"
    several = int4_cpu.multirow_min()
    assert int4_cpu.path("w4a8_group", 64, rows=several) == host
    assert int4_cpu.path("w4a8_group", 64, rows=several - 1) == "avx2"
    assert int4_cpu.path("w4a8", 64, rows=8) == "avx2"
    assert all(int4_cpu.path("w4a16", g, rows) == host for g in (32, 64, 128, 256) for rows in (1, 9))
    assert int4_cpu.paths("w4a16") == host
    assert int4_cpu.path_int8() == "avx2" and int4_cpu.path_int8(rows=several) == host
    assert int4_cpu.path_int8(2, int8_activations=True) == host  # W8A8 from 2 rows
    wide = "avx512_vnni at groups that are multiples of 128, avx2 at others"
    rows = "; several rows: avx512_vnni at groups that are multiples of 64"
    assert int4_cpu.paths("w4a8_group") == (f"one row: {wide}{rows}" if host == "avx512_vnni"
                                            else "avx2")
    assert int4_cpu.paths("w4a8") == (wide if host == "avx512_vnni" else "avx2")
    monkeypatch.setenv("FOURBIT_INT4_ISA", "avx2")
    assert int4_cpu.isa() == int4_cpu.path("w4a8_group", 128) == "avx2"
    assert int4_cpu.path("w4a16", 64, rows=8) == int4_cpu.path_int8(rows=8) == "avx2"


def test_avx2_code_has_no_avx512_instructions():
    """The AVX2 functions (the one-row kernels' and multirow.inc's AVX2 region) must run on
    an AVX2-only host; an AVX-512 host runs them without noticing an EVEX instruction in
    them, so the built extension's disassembly is read instead: no zmm, no ymm16-31, no
    mask registers, no vpdpbusd in any of them."""
    import re
    import shutil
    import subprocess

    ext = int4_cpu._ext()
    if ext is None or shutil.which("objdump") is None:
        pytest.skip("no built extension or no objdump")
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", ext.__file__],
                             capture_output=True, text=True, check=True).stdout
    avx2 = re.compile(r"<\(anonymous namespace\)::(multirow_avx2::\w+|rows_w4a8\w*|rows_w4a16|"
                      r"rows_w8a16|quantize_q8_avx2)[<(]")
    wide = re.compile(r"%zmm|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[0-7]\b|vpdpbusd")
    functions, current, offending = 0, None, []
    for line in listing.splitlines():
        if line and not line.startswith(" "):  # "<address> <name>:" starts a function
            current = line if avx2.search(line) else None
            functions += current is not None
        elif current and wide.search(line):
            offending.append((current, line.strip()))
    assert functions >= 8, "the AVX2 functions were not found by name"
    assert not offending, offending[:5]
