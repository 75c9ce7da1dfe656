"""PyTorch's CPU int4 kernel fed from a QuantizedWeight: the float32 mode reproduces
x @ W_hat.T to float rounding, the packed layout is what probe_layout measured, and
dequantize_packed reads W_hat back bit for bit -- or returns None, never a wrong W.

Measured on this project's hosts (AMD EPYC, torch 2.13.0+cpu). On an AVX-512 host
(avx512f/bw/vl/vnni/bf16 in /proc/cpuinfo) the default dispatch packs in
blocks of 64 output channels: in each k-row of a block, byte d holds channel d in its
low nibble and channel d + 32 in its high one; tail blocks of 16/32/48 hold channel
pairs (2d low, 2d + 1 high). Forced to ATEN_CPU_CAPABILITY=avx2 (what an AVX2-only
machine runs): blocks of 32, byte d holds channel d (low) and d + 16 (high), a tail of
16 holds pairs. ATEN_CPU_CAPABILITY=default: blocks of 32, pairs everywhere.
test_probe_under_other_capabilities re-measures the last two in subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fourbit.kernels import tinygemm
from fourbit.quant.qweight import QuantizedWeight

SRC = Path(__file__).resolve().parents[1] / "src"

# capability -> (block width, how a full block's k-row is laid out); tails are always pairs.
MEASURED = {"AVX512": (64, "halves"), "AVX2": (32, "halves"), "DEFAULT": (32, "pairs")}


def expected_rows(block_n: int, full: str) -> dict[int, tuple[int, ...]]:
    half = block_n // 2
    # byte d: channel d low, d + half high
    halves = tuple(c for d in range(half) for c in (d, d + half))
    rows = {block_n: halves if full == "halves" else tuple(range(block_n))}
    rows.update({tail: tuple(range(tail)) for tail in range(16, block_n, 16)})
    return rows


def random_qw(n: int, k: int, g: int, *, sym: bool, seed: int = 0) -> QuantizedWeight:
    """Random codes/zeros/float16 scales; group 0 of row 0 all zero (codes == zero, scale 0)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8)
    zeros = torch.full((n, k // g), 8) if sym else torch.randint(0, 16, (n, k // g), generator=gen)
    zeros = zeros.to(torch.uint8)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-4).to(torch.float16)
    codes[0, :g] = zeros[0, 0]
    scales[0, 0] = 0
    return QuantizedWeight(codes, scales, zeros, g)


SHAPES = [(n, k, g) for n in (64, 256, 768, 80) for k in (256, 768) for g in (32, 64, 128)]


def test_probe_matches_what_was_measured():
    layout = tinygemm.probe_layout()
    assert layout is not None
    assert layout.capability == torch.backends.cpu.get_cpu_capability()
    if layout.capability not in MEASURED:
        pytest.skip(f"no measurement recorded for capability {layout.capability}")
    block_n, full = MEASURED[layout.capability]
    assert layout.block_n == block_n
    assert layout.rows == expected_rows(block_n, full)


@pytest.mark.parametrize(("n", "k", "g"), SHAPES)
@pytest.mark.parametrize("sym", [False, True])
def test_int4_linear_float32_matches_dequantized(n, k, g, sym):
    qw = random_qw(n, k, g, sym=sym, seed=n + k + g)
    packed, sz = tinygemm.to_tinygemm(qw)
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(1))
    y = tinygemm.int4_linear(x, packed, sz, g, n)
    w = qw.dequantize()
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    bound = x.abs() @ w.abs().T  # the size of any summation order's rounding
    assert torch.all((y - x @ w.T).abs() <= 1e-5 * bound + 1e-30)


@pytest.mark.parametrize(("n", "k", "g"), SHAPES)
@pytest.mark.parametrize("sym", [False, True])
def test_dequantize_packed_is_bit_exact(n, k, g, sym):
    qw = random_qw(n, k, g, sym=sym, seed=n * k + g)
    packed, sz = tinygemm.to_tinygemm(qw)
    assert tinygemm.supports_direct_dequant(n, k)
    assert torch.equal(tinygemm.dequantize_packed(packed, sz, g, n, k), qw.dequantize())


def test_float_domain_zero_worked_example():
    # z = 3, scale 0.5: zero_f = (8 - 3) * 0.5 = 2.5,
    # and code 5 -> (5 - 8) * 0.5 + 2.5 = 1.0 = (5 - 3) * 0.5.
    qw = QuantizedWeight(
        torch.full((16, 32), 5, dtype=torch.uint8),
        torch.full((16, 1), 0.5, dtype=torch.float16),
        torch.full((16, 1), 3, dtype=torch.uint8),
        32,
    )
    packed, sz = tinygemm.to_tinygemm(qw)
    assert sz.shape == (1, 16, 2)
    assert torch.all(sz[..., 0] == 0.5) and torch.all(sz[..., 1] == 2.5)
    assert torch.all(tinygemm.int4_linear(torch.ones(1, 32), packed, sz, 32, 16) == 32.0)


def test_bfloat16_mode_is_only_approximate():
    qw = random_qw(64, 256, 64, sym=False, seed=7)
    packed, sz = tinygemm.to_tinygemm(qw, torch.bfloat16)
    assert sz.dtype == torch.bfloat16
    approx = tinygemm.dequantize_packed(packed, sz, 64, 64, 256)
    assert not torch.equal(approx, qw.dequantize())  # the scales and zero_f were rounded
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    w = qw.dequantize()
    y = tinygemm.int4_linear(x, packed, sz, 64, 64)
    assert y.dtype == torch.float32
    assert torch.all((y - x @ w.T).abs() <= 2e-2 * (x.abs() @ w.abs().T) + 1e-6)


def test_unsupported_shapes_give_none_never_a_wrong_weight(monkeypatch):
    dummy_packed, dummy_sz = torch.zeros(72, 128, dtype=torch.uint8), torch.zeros(2, 72, 2)
    assert not tinygemm.supports_direct_dequant(72, 256)  # N not a multiple of 16: no such packing
    assert tinygemm.dequantize_packed(dummy_packed, dummy_sz, 128, 72, 256) is None

    qw = random_qw(80, 256, 64, sym=False)
    packed, sz = tinygemm.to_tinygemm(qw)
    measured = tinygemm.probe_layout()
    full_only = {measured.block_n: measured.rows[measured.block_n]}
    monkeypatch.setattr(
        tinygemm,
        "probe_layout",
        lambda: tinygemm.PackedLayout(measured.capability, measured.block_n, full_only),
    )
    assert tinygemm.dequantize_packed(packed, sz, 64, 80, 256) is None  # tail block not understood
    whole = random_qw(128, 256, 64, sym=True)  # whole blocks only: still read
    assert torch.equal(
        tinygemm.dequantize_packed(*tinygemm.to_tinygemm(whole), 64, 128, 256), whole.dequantize()
    )
    monkeypatch.setattr(tinygemm, "probe_layout", lambda: None)
    # layout not understood at all
    assert tinygemm.dequantize_packed(packed, sz, 64, 80, 256) is None


def test_shape_errors_name_the_constraint():
    with pytest.raises(ValueError, match="group 16 is not one of tinygemm's"):
        tinygemm.to_tinygemm(random_qw(64, 256, 16, sym=True))
    with pytest.raises(ValueError, match="N=72 is not a multiple of 16"):
        tinygemm.to_tinygemm(random_qw(72, 256, 64, sym=True))
    with pytest.raises(ValueError, match="K=200 is not a multiple of group 128"):
        tinygemm.check_shape(64, 200, 128)
    qw = random_qw(64, 256, 64, sym=True)
    packed, sz = tinygemm.to_tinygemm(qw)
    with pytest.raises(ValueError, match="expected"):
        tinygemm.dequantize_packed(packed, sz, 64, 64, 512)
    with pytest.raises(ValueError, match="out_features=32"):
        tinygemm.int4_linear(torch.randn(1, 256), packed, sz, 64, 32)


CHILD = """
import json, torch
from fourbit.kernels import tinygemm
from fourbit.quant.qweight import QuantizedWeight
layout = tinygemm.probe_layout()
ok = []
for n in (32, 48, 80, 96):
    gen = torch.Generator().manual_seed(n)
    qw = QuantizedWeight(torch.randint(0, 16, (n, 256), generator=gen).to(torch.uint8),
                         (torch.rand(n, 4, generator=gen) * 0.02).half(),
                         torch.randint(0, 16, (n, 4), generator=gen).to(torch.uint8), 64)
    packed, sz = tinygemm.to_tinygemm(qw)
    x = torch.randn(3, 256, generator=gen)
    w = qw.dequantize()
    y = tinygemm.int4_linear(x, packed, sz, 64, n)
    ok.append(bool(torch.equal(tinygemm.dequantize_packed(packed, sz, 64, n, 256), w))
              and bool(torch.all((y - x @ w.T).abs() <= 1e-5 * (x.abs() @ w.abs().T) + 1e-30)))
print(json.dumps({"capability": layout.capability, "block_n": layout.block_n,
                  "rows": {str(k): v for k, v in layout.rows.items()}, "ok": ok}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("forced", ["avx2", "default"])
def test_probe_under_other_capabilities(forced):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": forced, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["capability"] == forced.upper()
    block_n, full = MEASURED[got["capability"]]
    assert got["block_n"] == block_n
    assert {int(k): tuple(v) for k, v in got["rows"].items()} == expected_rows(block_n, full)
    assert all(got["ok"])


def test_kernel_dtype_avoids_the_scalar_float32_path():
    """tinygemm has SIMD code on x86 only for bfloat16: a float32 compute dtype is run in
    bfloat16 there unless float32 was asked for by name; elsewhere it is kept."""
    vector = torch.backends.cpu.get_cpu_capability() in tinygemm.VECTORIZED_CAPABILITIES
    assert tinygemm.vectorized(torch.bfloat16) == vector
    assert not tinygemm.vectorized(torch.float32)
    assert tinygemm.kernel_dtype(torch.float32) == (torch.bfloat16 if vector else torch.float32)
    assert tinygemm.kernel_dtype(torch.float32, "float32") == torch.float32
    assert tinygemm.kernel_dtype(torch.bfloat16) == torch.bfloat16
