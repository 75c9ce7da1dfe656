"""On-disk formats: exact round trips, byte layouts checked against independent decoders
written from each format's spec (numpy bit operations, not the package's unpack), a
committed golden block, and -- slow -- the real readers: compressed-tensors' own
decompressor and vLLM's GPTQ / compressed-tensors linear layers on the CPU kernel."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from fourbit.formats import FORMATS, format_for_config, get_format, stored_dtype
from fourbit.quant.qweight import QuantizedWeight

GOLDEN = Path(__file__).parent / "golden" / "formats_8x64_g32.json"


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


def grids(fmt) -> list[bool]:
    return [sym for sym in (True, False) if fmt.supports(sym)]


# --- independent decoders, written from the layout tables ------------------------------------


def spec_nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [...] -> their 8 nibbles [..., 8], nibble i = bits 4i..4i+3."""
    return (
        words.astype(np.int32).view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))
    ) & 0xF


def spec_decode(name: str, t: dict[str, np.ndarray], n: int, k: int, g: int):
    """(codes [N, K], zeros [N, K/G], scales [N, K/G]) as numpy, straight from the spec."""
    if name == "cpu_int4":
        b = t["qweight"]
        codes = np.empty((n, k), dtype=np.uint8)
        codes[:, 0::2] = b & 0xF  # even k: low nibble
        codes[:, 1::2] = b >> 4  # odd k: high nibble
        return codes, t["zeros"], t["scales"]
    if name == "gptq":
        nib = spec_nibbles(t["qweight"])  # [K/8, N, 8]: code of (n, 8j+i) at [j, n, i]
        codes = nib.transpose(1, 0, 2).reshape(n, k)
        znib = spec_nibbles(t["qzeros"])  # [K/G, N/8, 8]: stored zero of (8j+i, g) at [g, j, i]
        zeros = znib.reshape(k // g, n).T + 1  # v1: stored zero = zero - 1
        return codes, zeros, t["scales"].T
    if name == "compressed_tensors":
        codes = spec_nibbles(t["weight_packed"]).reshape(n, k)  # [N, K/8, 8] -> [N, K]
        znib = spec_nibbles(t["weight_zero_point"])  # [N/8, K/G, 8]: zero of (8j+i, g) at [j, g, i]
        zeros = znib.transpose(0, 2, 1).reshape(n, k // g)
        assert t["weight_shape"].tolist() == [n, k]
        return codes, zeros, t["weight_scale"]
    raise AssertionError(f"no spec decoder for {name}")


def test_every_format_has_a_spec_decoder():
    assert sorted(FORMATS) == ["compressed_tensors", "cpu_int4", "gptq"]


# --- round trips and layouts ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize(("n", "k", "g"), [(8, 64, 32), (64, 256, 64), (96, 512, 128)])
def test_round_trip_is_exact(name, n, k, g):
    fmt = get_format(name)
    for sym in grids(fmt):
        qw = random_qw(n, k, g, sym=sym)
        back = fmt.unpack(fmt.pack(qw), n, k, g)
        assert torch.equal(back.codes, qw.codes)
        assert torch.equal(back.zeros, qw.zeros)
        assert back.scales.dtype == qw.scales.dtype and torch.equal(back.scales, qw.scales)
        assert torch.equal(back.dequantize()[0, :g], torch.zeros(g))  # the all-zero group


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_packed_tensors_match_the_layout_table(name):
    fmt = get_format(name)
    n, k, g = 32, 128, 32
    for sym in grids(fmt):
        qw = random_qw(n, k, g, sym=sym, seed=1)
        packed = fmt.pack(qw)
        assert list(packed) == [spec.suffix for spec in fmt.layout]
        for spec in fmt.layout:
            assert tuple(packed[spec.suffix].shape) == spec.dims(n, k, g)
            assert packed[spec.suffix].dtype == stored_dtype(spec, qw.scales.dtype)
        codes, zeros, scales = spec_decode(name, {s: t.numpy() for s, t in packed.items()}, n, k, g)
        np.testing.assert_array_equal(codes, qw.codes.numpy())
        np.testing.assert_array_equal(zeros, qw.zeros.numpy())
        np.testing.assert_array_equal(scales, qw.scales.numpy())


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_stored_bits_counts_what_pack_writes(name):
    fmt = get_format(name)
    n, k, g = 64, 256, 64
    packed = fmt.pack(random_qw(n, k, g, sym=True))
    assert fmt.stored_bits(n, k, g) == sum(
        t.numel() * t.element_size() * 8 for t in packed.values()
    )


def test_bits_per_weight_examples():
    n, k, g = 4096, 4096, 128
    per_weight = {name: get_format(name).stored_bits(n, k, g) / (n * k) for name in FORMATS}
    assert per_weight["cpu_int4"] == 4 + 24 / 128
    assert per_weight["gptq"] == 4 + 20 / 128 + 32 / 4096
    assert per_weight["compressed_tensors"] == 4 + 20 / 128 + 128 / (n * k)


def test_golden_bytes_do_not_drift():
    golden = json.loads(GOLDEN.read_text())
    n, k, g = golden["N"], golden["K"], golden["G"]
    rows, cols, grp = (
        torch.arange(n)[:, None],
        torch.arange(k)[None, :],
        torch.arange(k // g)[None, :],
    )
    codes = ((5 * rows + 3 * cols + cols // 16) % 16).to(torch.uint8)
    zeros = ((3 * rows + 7 * grp + 1) % 16).to(torch.uint8)
    scales = ((rows + 1) * 0.25 + grp * 0.125).to(torch.float16)
    assert sorted(golden["formats"]) == sorted(FORMATS)
    for name, want in golden["formats"].items():
        fmt = get_format(name)
        qw = QuantizedWeight(
            codes, scales, zeros if fmt.supports(False) else torch.full_like(zeros, 8), g
        )
        packed = fmt.pack(qw)
        assert sorted(packed) == sorted(want)
        for suffix, t in packed.items():
            assert (
                t.numpy().tobytes().hex() == want[suffix]["hex"]
            ), f"{name}.{suffix} bytes changed"
        # The golden bytes themselves decode, by the spec, to the weight they claim to hold.
        raw = {
            s: np.frombuffer(bytes.fromhex(w["hex"]), dtype=w["dtype"]).reshape(w["shape"])
            for s, w in want.items()
        }
        got_codes, got_zeros, got_scales = spec_decode(name, raw, n, k, g)
        np.testing.assert_array_equal(got_codes, qw.codes.numpy())
        np.testing.assert_array_equal(got_zeros, qw.zeros.numpy())
        np.testing.assert_array_equal(got_scales, qw.scales.numpy())


def test_golden_first_word_by_hand():
    # compressed_tensors weight_packed[0, 0] holds codes[0, 0..7] = 3k % 16 = 0,3,6,9,12,15,2,5,
    # element i in bits 4i: 0x52FC9630, little-endian bytes 30 96 fc 52.
    golden = json.loads(GOLDEN.read_text())
    assert golden["formats"]["compressed_tensors"]["weight_packed"]["hex"].startswith("3096fc52")


# --- format specifics -------------------------------------------------------------------------


def test_gptq_symmetric_zero_is_stored_as_7():
    packed = get_format("gptq").pack(random_qw(16, 64, 32, sym=True))
    assert torch.all(packed["qzeros"] == 0x77777777)
    assert torch.equal(packed["g_idx"], torch.arange(64, dtype=torch.int32) // 32)


def test_gptq_refuses_asymmetric_grids():
    fmt = get_format("gptq")
    assert fmt.supports(True) and not fmt.supports(False)
    with pytest.raises(ValueError, match="symmetric grids only"):
        fmt.pack(random_qw(16, 64, 32, sym=False))
    with pytest.raises(ValueError, match="symmetric grids only"):
        fmt.quantization_config(32, sym=False)


def test_gptq_unpack_reads_v1_asymmetric_zeros_and_refuses_the_zero_0_wrap():
    fmt = get_format("gptq")
    packed = fmt.pack(random_qw(16, 64, 32, sym=True))
    packed["qzeros"] = torch.full_like(packed["qzeros"], 0x22222222)  # stored 2 -> zero 3
    assert torch.all(fmt.unpack(packed, 16, 64, 32).zeros == 3)
    packed["qzeros"][0, 0] = 0x2222222F  # stored 15 -> zero 16
    with pytest.raises(ValueError, match="zero 16"):
        fmt.unpack(packed, 16, 64, 32)


def test_gptq_refuses_act_order():
    fmt = get_format("gptq")
    packed = fmt.pack(random_qw(16, 64, 32, sym=True))
    packed["g_idx"] = packed["g_idx"].flip(0)
    with pytest.raises(ValueError, match="act-order"):
        fmt.unpack(packed, 16, 64, 32)


def test_compressed_tensors_zero_point_worked_example():
    # One group of 8 weights, code 2 and zero 5, scale 0.5: W = (2 - 5) * 0.5 = -1.5.
    qw = QuantizedWeight(
        torch.full((8, 8), 2, dtype=torch.uint8),
        torch.full((8, 1), 0.5, dtype=torch.float16),
        torch.full((8, 1), 5, dtype=torch.uint8),
        8,
    )
    packed = get_format("compressed_tensors").pack(qw)
    assert torch.all(packed["weight_packed"] == 0x22222222)  # nibble 2 = signed -6 + 8
    assert torch.all(packed["weight_zero_point"] == 0x55555555)  # nibble 5 = signed -3 + 8
    signed_q, signed_zp = 2 - 8, 5 - 8
    assert (signed_q - signed_zp) * 0.5 == -1.5 == float(qw.dequantize()[0, 0])


def test_cpu_int4_low_nibble_is_even_k():
    codes = torch.zeros(1, 32, dtype=torch.uint8)
    codes[0, 0], codes[0, 1] = 3, 12
    qw = QuantizedWeight(
        codes, torch.ones(1, 1, dtype=torch.float16), torch.zeros(1, 1, dtype=torch.uint8), 32
    )
    assert int(get_format("cpu_int4").pack(qw)["qweight"][0, 0]) == 0xC3


# --- shape and value errors name the constraint ------------------------------------------------


def test_shape_errors_name_the_constraint():
    qw = random_qw(12, 36, 12, sym=True)
    with pytest.raises(ValueError, match=r"qweight \[K/8, N\]: K=36 is not a multiple of 8"):
        get_format("gptq").pack(qw)
    with pytest.raises(ValueError, match=r"weight_packed \[N, K/8\]: K=36 is not a multiple of 8"):
        get_format("compressed_tensors").pack(qw)
    qw = random_qw(12, 64, 32, sym=True)
    with pytest.raises(ValueError, match=r"qzeros \[K/G, N/8\]: N=12 is not a multiple of 8"):
        get_format("gptq").pack(qw)
    with pytest.raises(ValueError, match="K=200 is not a multiple of group 128"):
        get_format("cpu_int4").stored_bits(64, 200, 128)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_unpack_checks_shapes_and_dtypes(name):
    fmt = get_format(name)
    packed = fmt.pack(random_qw(16, 64, 32, sym=True))
    with pytest.raises(ValueError, match="expected"):
        fmt.unpack(packed, 16, 128, 32)
    first = fmt.layout[0].suffix
    with pytest.raises(ValueError, match="missing tensor"):
        fmt.unpack({s: t for s, t in packed.items() if s != first}, 16, 64, 32)
    with pytest.raises(ValueError, match="dtype"):
        fmt.unpack({**packed, first: packed[first].to(torch.int64)}, 16, 64, 32)


def test_codes_must_fit_in_4_bits():
    qw = random_qw(16, 64, 32, sym=True)
    qw.codes[0, 0] = 16
    for fmt in FORMATS.values():
        with pytest.raises(ValueError, match="0..15"):
            fmt.pack(qw)


# --- registry and configs ---------------------------------------------------------------------


def test_get_format_lists_known_formats():
    with pytest.raises(KeyError, match="compressed_tensors, cpu_int4, gptq"):
        get_format("awq")


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("g", [32, 128])
def test_each_config_is_read_back_by_its_format(name, g):
    fmt = get_format(name)
    for sym in grids(fmt):
        for lm_head in (False, True):
            cfg = fmt.quantization_config(g, sym, lm_head=lm_head)
            json.dumps(cfg)  # goes into config.json
            assert format_for_config(cfg) is fmt
            assert fmt.group_size_from_config(cfg) == g


def test_configs_carry_a_version():
    assert get_format("cpu_int4").quantization_config(128, False)["format_version"] == 1
    assert get_format("gptq").quantization_config(128, True)["checkpoint_format"] == "gptq"
    assert get_format("compressed_tensors").quantization_config(128, False)["version"] == "0.17.0"


def test_foreign_configs_are_refused():
    with pytest.raises(ValueError, match="exactly one expected"):
        format_for_config({"quant_method": "awq", "bits": 4})
    with pytest.raises(
        ValueError, match="exactly one expected"
    ):  # GPTQ v2 stores zeros without the -1
        format_for_config(
            {**get_format("gptq").quantization_config(128, True), "checkpoint_format": "gptq_v2"}
        )
    sym_ct = get_format("compressed_tensors").quantization_config(128, False)
    sym_ct["config_groups"]["group_0"]["weights"]["symmetric"] = True  # no zero point tensor
    with pytest.raises(ValueError, match="exactly one expected"):
        format_for_config(sym_ct)
    with pytest.raises(ValueError, match="format_version 2"):
        format_for_config(
            {**get_format("cpu_int4").quantization_config(128, False), "format_version": 2}
        )


def test_compressed_tensors_lm_head_is_a_named_target():
    fmt = get_format("compressed_tensors")
    with_head = fmt.quantization_config(128, False, lm_head=True)
    without = fmt.quantization_config(128, False, lm_head=False)
    assert with_head["config_groups"]["group_0"]["targets"] == ["Linear", "lm_head"]
    assert with_head["ignore"] == []
    assert without["ignore"] == ["lm_head"]


# --- slow: the real readers -------------------------------------------------------------------


@pytest.mark.slow
def test_compressed_tensors_own_decompressor_agrees():
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    fmt = get_format("compressed_tensors")
    n, k, g = 96, 256, 64
    cfg = fmt.quantization_config(g, False)
    qcfg = QuantizationConfig.model_validate(
        {
            key: v
            for key, v in cfg.items()
            if key not in ("version", "sparsity_config", "transform_config")
        }
    )
    scheme = qcfg.config_groups["group_0"]
    qw = random_qw(n, k, g, sym=False, seed=3)
    packed = fmt.pack(qw)
    out = PackedQuantizationCompressor.decompress(dict(packed), scheme)
    assert torch.equal(out["weight"], qw.dequantize(torch.float16))  # computed in the scale dtype
    out = PackedQuantizationCompressor.decompress(
        {**packed, "weight_scale": qw.scales.float()}, scheme
    )
    assert torch.equal(out["weight"], qw.dequantize())  # float32 scales: exact
    signed_zp = out["weight_zero_point"].to(torch.int16)
    assert torch.equal(signed_zp + 8, qw.zeros.to(torch.int16))


@pytest.fixture(scope="module")
def vllm_tp1():
    """vLLM's single-rank model-parallel state, which its layers need to be built."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        yield
        destroy_model_parallel()
        destroy_distributed_environment()


def vllm_quant_config(name: str, cfg: dict):
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    return {"gptq": AutoGPTQConfig, "compressed_tensors": CompressedTensorsConfig}[
        name
    ].from_config(cfg)


def native_kernel_or_skip() -> None:
    """Skip, naming the host's reason, where vLLM's own W4A16 kernel is not built."""
    from fourbit.bench.hostprobe import choose_runtimes
    from fourbit.cpuinfo import isa_flags

    verdict = choose_runtimes(isa_flags())["vllm_native_w4a16"]
    if not verdict["available"]:
        pytest.skip(f"vLLM's own 4-bit CPU kernel is not on this host: {verdict['reason']}")


def plugin_quant_config(name: str, cfg: dict):
    from fourbit.vllm_plugin.config import FourbitInt4Config

    config = FourbitInt4Config.from_config(cfg)
    assert config.format_name == name
    return config


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["vllm_native", "fourbit_plugin"])
@pytest.mark.parametrize("name", ["gptq", "compressed_tensors"])
@pytest.mark.parametrize("g", [32, 128])
def test_vllm_serves_what_we_pack(vllm_tp1, runtime, name, g):
    """Our tensors through vLLM's own loader and a CPU 4-bit kernel give x @ W_hat.T.

    vllm_native: vLLM's own GPTQ / compressed-tensors method, repacking and
    cpu_gemm_wna16 (AVX-512 builds of vLLM only; skipped elsewhere with the reason).
    fourbit_plugin: the same checkpoint tensors read by fourbit's plugin, the path
    that serves them on every host (AVX2 included), so this case never skips.
    """
    from vllm.model_executor.layers.linear import ReplicatedLinear

    if runtime == "vllm_native":
        native_kernel_or_skip()
    make_config = vllm_quant_config if runtime == "vllm_native" else plugin_quant_config
    fmt = get_format(name)
    sym = not fmt.supports(False)
    n, k = 96, 512  # the vLLM CPU kernel wants multiples of 32
    qw = random_qw(n, k, g, sym=sym, seed=4)
    layer = ReplicatedLinear(
        k,
        n,
        bias=False,
        params_dtype=torch.float16,
        quant_config=make_config(name, fmt.quantization_config(g, sym)),
        prefix="model.layers.0.mlp.down_proj",
    )
    packed = fmt.pack(qw)
    for suffix, param in layer.named_parameters():  # g_idx is dropped by vLLM's name mapper
        param.weight_loader(param, packed[suffix])
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).half()
    y, _ = layer(x)
    w = qw.dequantize()
    bound = x.float().abs() @ w.abs().T  # scale of the float error of any summation order
    err = ((y.float() - x.float() @ w.T).abs() / bound).max()
    assert err < 1e-3
    # The check can tell a zero off by one (the GPTQ v1 trap) from the right one.
    off = QuantizedWeight(qw.codes, qw.scales, qw.zeros - 1, g).dequantize()
    assert ((y.float() - x.float() @ off.T).abs() / bound).max() > 10 * err


@pytest.mark.slow
@pytest.mark.parametrize("lm_head", [True, False])
def test_vllm_quantizes_lm_head_only_when_asked(vllm_tp1, lm_head):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    cfg = get_format("compressed_tensors").quantization_config(64, False, lm_head=lm_head)
    quant_config = vllm_quant_config("compressed_tensors", cfg)
    head = ParallelLMHead(
        128, 256, params_dtype=torch.float16, quant_config=quant_config, prefix="lm_head"
    )
    assert (type(head.quant_method).__name__ == "CompressedTensorsLinearMethod") == lm_head


# --- the wide layouts (quantize_head: 8, mixed_precision.grids) ----------------------------------------------------

def test_int8_layout_round_trip_is_exact_and_its_table_counts_what_it_stores():
    from fourbit.formats import INT8
    from fourbit.quant.int8 import quantize_int8

    weight = torch.randn(24, 128, generator=torch.Generator().manual_seed(0))
    qw = quantize_int8(weight, 32)
    packed = INT8.pack(qw)
    assert {s: tuple(t.shape) for s, t in packed.items()} == INT8.shapes(24, 128, 32)
    assert INT8.unpack(packed, 24, 128, 32).equal(qw)
    stored = sum(t.numel() * t.element_size() * 8 for t in packed.values())
    assert stored == INT8.stored_bits(24, 128, 32) == 24 * 128 * (8 + 16 / 32)
    with pytest.raises(ValueError, match="weight_int8 has dtype torch.uint8"):
        INT8.unpack({**packed, "weight_int8": packed["weight_int8"].view(torch.uint8)}, 24, 128, 32)


@pytest.mark.parametrize("bits", [5, 6])
def test_narrower_wide_layouts_pack_eight_codes_in_b_bytes_as_their_table_says(bits):
    """The 5- and 6-bit layouts: code j of each run of eight, offset by 2**(b-1), in bits
    b*j..b*j+b-1 of b little-endian bytes (checked against that rule written out here, not
    against the packer); the round trip is exact and the table counts what is stored."""
    from fourbit.formats import WIDE_LAYOUTS
    from fourbit.quant.int8 import max_code, quantize_int8

    layout = WIDE_LAYOUTS[bits]
    weight = torch.randn(24, 128, generator=torch.Generator().manual_seed(0))
    qw = quantize_int8(weight, 32, bits=bits)
    assert qw.bits == bits and int(qw.codes.abs().max()) == max_code(bits) == 2 ** (bits - 1) - 1
    packed = layout.pack(qw)
    assert {s: tuple(t.shape) for s, t in packed.items()} == layout.shapes(24, 128, 32)
    stream = packed[f"weight_int{bits}"][5, 3].tolist()  # row 5, codes 24..31
    word = sum(byte << (8 * i) for i, byte in enumerate(stream))
    assert [((word >> (bits * j)) & (2 ** bits - 1)) - 2 ** (bits - 1) for j in range(8)] == (
        qw.codes[5, 24:32].tolist())
    assert layout.unpack(packed, 24, 128, 32).equal(qw)
    stored = sum(t.numel() * t.element_size() * 8 for t in packed.values())
    assert stored == layout.stored_bits(24, 128, 32) == 24 * 128 * (bits + 16 / 32)
    tall = quantize_int8(torch.randn(1030, 64, generator=torch.Generator().manual_seed(1)), 32, bits=bits)
    assert layout.unpack(layout.pack(tall), 1030, 64, 32).equal(tall)  # packed a block of rows at a time
    with pytest.raises(ValueError, match=f"the {bits}-bit grid holds"):
        type(qw)(qw.codes.clamp(max=max_code(bits)) + 1, qw.scales, 32, bits)
    with pytest.raises(ValueError, match=f"int{bits}: a 8-bit weight"):
        layout.pack(quantize_int8(weight, 32))


def test_int8_grid_is_symmetric_per_group_and_exact_in_float32():
    """Each group's largest |w| lands on code ±127 (its scale rounded to float16 first), and
    W_hat = code * scale is the same number in float32 as in float64."""
    from fourbit.quant.int8 import quantize_int8

    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 0.02
    weight[3, :32] = 0.0  # an all-zero group stays zero
    qw = quantize_int8(weight, 32)
    assert qw.codes.abs().view(16, 2, 32).amax(-1)[[0, 3]].tolist() == [[127, 127], [0, 127]]
    assert qw.scales.dtype == torch.float16
    exact = qw.codes.double().view(16, 2, 32) * qw.scales.double().unsqueeze(-1)
    assert torch.equal(qw.dequantize(torch.float32).double(), exact.view(16, 64))
    step = qw.scales.float().repeat_interleave(32, dim=1)
    assert ((qw.dequantize() - weight).abs() <= step / 2 * 1.001 + 1e-12).all()  # nearest level
