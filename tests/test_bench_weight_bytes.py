"""Weight bytes from the safetensors headers, on a tiny Llama and its cpu_int4 g64 arm."""

from __future__ import annotations

from fourbit.bench.weight_bytes import linear_weight_bytes, resident_weight_bytes

# tiny Llama: 2 layers of q, k, v, o (256 -> 256, 128, 128, 256) and gate, up, down
# (256 <-> 512), plus the 512 x 256 head.
LINEAR_WEIGHTS = 2 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 512) + 512 * 256


def test_a_decode_step_reads_every_linear_once_dense_in_the_engines_dtype(int4_checkpoints):
    arm, baseline = int4_checkpoints
    assert linear_weight_bytes(baseline, "float32") == {
        "bytes": 4 * LINEAR_WEIGHTS, "quantized_bytes": 0, "dense_bytes": 4 * LINEAR_WEIGHTS,
        "dense_dtype": "float32", "linear_modules": 15}
    assert linear_weight_bytes(baseline, "bfloat16")["bytes"] == 2 * LINEAR_WEIGHTS
    packed = linear_weight_bytes(arm, "float32")
    # 4-bit codes, a float16 scale and a uint8 zero per group of 64.
    assert packed["dense_bytes"] == 0
    assert packed["bytes"] == LINEAR_WEIGHTS // 2 + LINEAR_WEIGHTS // 64 * 3


def test_an_engine_holds_every_tensor_in_its_dtype(int4_checkpoints):
    """What an engine holds resident, the memory plan's base: dense tensors in the
    engine's dtype (the embedding included), packed ones as stored."""
    arm, baseline = int4_checkpoints
    dense = resident_weight_bytes(baseline, "float32")
    # the linears, the 512 x 256 embedding, 5 norms of 256
    assert dense == 4 * (LINEAR_WEIGHTS + 512 * 256 + 5 * 256)
    assert resident_weight_bytes(baseline, "bfloat16") == dense // 2
    packed = resident_weight_bytes(arm, "float32")
    assert packed == LINEAR_WEIGHTS // 2 + LINEAR_WEIGHTS // 64 * 3 + 4 * (512 * 256 + 5 * 256)


def test_a_linears_packed_6_bit_codes_count_as_the_int8_codes_the_plugin_holds(int4_checkpoints, tmp_path):
    """A mixed_precision arm with a down projection and the embedding table at 6 bits: the
    linear is held as one int8 per code (decode reads those), the table stays packed
    (only looked-up rows are unpacked)."""
    from fourbit.checkpoints.hf import TensorReader
    from fourbit.checkpoints.quantized import read_quantized, write_quantized
    from fourbit.quant.int8 import quantize_int8

    arm, baseline = int4_checkpoints
    _, _, qweights = read_quantized(arm)
    reader = TensorReader(baseline)
    down, table = "model.layers.0.mlp.down_proj", "model.embed_tokens"
    for name in (down, table):
        qweights[name] = quantize_int8(reader.get(f"{name}.weight"), 64, bits=6)
    write_quantized(tmp_path / "six", baseline, qweights, "cpu_int4", {"group_size": 64, "sym": False})
    four_bit = 256 * 512 // 2 + 256 * 512 // 64 * 3  # the down projection as arm stores it
    held = 256 * 512 + 256 * 512 // 64 * 2  # int8 codes, a float16 scale per 64
    assert linear_weight_bytes(tmp_path / "six", "float32")["bytes"] == (
        linear_weight_bytes(arm, "float32")["bytes"] - four_bit + held)
    packed_table = 512 * 256 * 6 // 8 + 512 * 256 // 64 * 2
    assert resident_weight_bytes(tmp_path / "six", "float32") == (
        resident_weight_bytes(arm, "float32") - four_bit + held - 4 * 512 * 256 + packed_table)
