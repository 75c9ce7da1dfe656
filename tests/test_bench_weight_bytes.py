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
