"""quantize -> dequantize -> score on a tiny real checkpoint, for every method's format."""

import json

import pytest
import torch

from fourbit.checkpoint import load_tensors, read_config
from fourbit.config import canonical_quant, load_schema
from fourbit.dequantize import dequantize_checkpoint
from fourbit.engines import reference
from fourbit.quantize import GroupSizeError, quantize_checkpoint
from fourbit.quantized_checkpoint import read_quantized

SETTINGS = {"name": "reference", "dtype": "float32", "threads": 2}
WINDOWS = torch.randint(0, 512, (3, 48), generator=torch.Generator().manual_seed(0)).tolist()


def arm(**quant):
    return {"name": "t", "id": "t-0000000000", "quant": canonical_quant(quant, load_schema())}


@pytest.mark.parametrize(
    "quant, fmt",
    [
        ({"method": "cpu_int4", "group_size": 64, "shrink_steps": 4}, "fourbit_int4"),
        ({"method": "rtn", "group_size": 128, "sym": True}, "gptq"),
        ({"method": "rtn", "group_size": 32, "sym": False}, "compressed-tensors"),
    ],
)
def test_arm_runs_in_4_bits_and_matches_its_dense_control(tiny_untied, tmp_path, quant, fmt):
    spec = arm(**quant)
    manifest = quantize_checkpoint(tiny_untied, tmp_path / "q", tmp_path / "arm.json", spec)
    assert read_config(tmp_path / "q")["quantization_config"]["quant_method"] == fmt
    assert "lm_head" in manifest["quantized_modules"]
    group = spec["quant"]["group_size"]
    # 4-bit codes plus a 16-bit scale and the zero point per group, counted from the file.
    assert 4 + 16 / group < manifest["storage"]["quantized_bits_per_weight"] <= 4 + 48 / group
    assert json.loads((tmp_path / "arm.json").read_text())["id"] == spec["id"]

    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    assert "quantization_config" not in read_config(tmp_path / "d")
    quantized = reference.score_windows(tmp_path / "q", WINDOWS, SETTINGS, 2)
    dense = reference.score_windows(tmp_path / "d", WINDOWS, SETTINGS, 2)
    for q, d in zip(quantized, dense):
        assert q["tokens"] == d["tokens"] == 47
        assert abs(q["nll_sum"] - d["nll_sum"]) / q["tokens"] < 1e-5
    assert "tinygemm" in reference.runtime(tmp_path / "q", SETTINGS)


def test_dense_expansion_is_exactly_the_quantizers_weights(tiny_untied, tmp_path):
    quantize_checkpoint(tiny_untied, tmp_path / "q", tmp_path / "arm.json", arm(method="cpu_int4"))
    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    _, _, qweights = read_quantized(tmp_path / "q")
    dense = load_tensors(tmp_path / "d")
    for name, qweight in qweights.items():
        assert torch.equal(dense[f"{name}.weight"], qweight.dequantize(torch.float32))


def test_group_that_does_not_divide_a_layer_names_the_layer(tmp_path):
    from conftest import save_tiny_llama

    save_tiny_llama(tmp_path / "m", tied=False, hidden=256, intermediate=320)
    with pytest.raises(GroupSizeError, match=r"mlp.down_proj: K=320 is not a multiple of group_size 128"):
        quantize_checkpoint(tmp_path / "m", tmp_path / "q", tmp_path / "arm.json", arm(method="cpu_int4"))
    assert not (tmp_path / "q").exists()


def test_quantize_head_off_keeps_the_head_dense(tiny_untied, tmp_path):
    manifest = quantize_checkpoint(
        tiny_untied, tmp_path / "q", tmp_path / "arm.json", arm(method="cpu_int4", quantize_head=False)
    )
    assert "lm_head" not in manifest["quantized_modules"]


def test_both_int4_paths_agree(tiny_untied, tmp_path):
    """Decoding-sized inputs run the int4 kernel; window-sized ones the expanded packed weight."""
    quantize_checkpoint(tiny_untied, tmp_path / "q", tmp_path / "arm.json", arm(method="cpu_int4"))
    model = reference.load_model(tmp_path / "q", torch.float32)
    linear = model.model.layers[0].mlp.down_proj
    x = torch.randn(reference.DEQUANT_ROWS, linear.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        many = linear(x)  # the expanded path
        few = torch.cat([linear(row[None]) for row in x])  # the kernel, one row at a time
    assert linear._expanded is not None
    assert torch.allclose(many, few, rtol=1e-5, atol=1e-5)


def test_quantized_embedding_is_looked_up_from_4_bits(tiny_untied, tmp_path):
    """quantize_embedding: the table [V, H] is stored like a linear and read back exactly."""
    manifest = quantize_checkpoint(
        tiny_untied, tmp_path / "q", tmp_path / "arm.json",
        arm(method="cpu_int4", group_size=64, quantize_embedding=True),
    )
    assert "model.embed_tokens" in manifest["quantized_modules"]
    table_size = load_tensors(tiny_untied)["model.embed_tokens.weight"].numel()
    without = quantize_checkpoint(tiny_untied, tmp_path / "q0", tmp_path / "arm0.json",
                                  arm(method="cpu_int4", group_size=64))
    assert manifest["storage"]["linear_weights"] == without["storage"]["linear_weights"] + table_size
    assert manifest["storage"]["size_bytes"] < without["storage"]["size_bytes"]
    assert manifest["method_facts"]["embedding"] == "rtn"
    assert read_config(tmp_path / "q")["quantization_config"]["embedding"] is True
    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    table = read_quantized(tmp_path / "q")[2]["model.embed_tokens"]
    assert torch.equal(load_tensors(tmp_path / "d")["model.embed_tokens.weight"],
                       table.dequantize(torch.float32))
    original = load_tensors(tiny_untied)["model.embed_tokens.weight"]
    assert not torch.equal(table.dequantize(torch.float32), original)  # really rounded
    quantized = reference.score_windows(tmp_path / "q", WINDOWS, SETTINGS, 2)
    dense = reference.score_windows(tmp_path / "d", WINDOWS, SETTINGS, 2)
    for q, d in zip(quantized, dense):
        assert abs(q["nll_sum"] - d["nll_sum"]) / q["tokens"] < 1e-5


def test_only_cpu_int4_can_quantize_the_embedding():
    from fourbit import formats

    with pytest.raises(Exception, match="quantize_embedding"):
        arm(method="gptq", quantize_embedding=True)
    with pytest.raises(ValueError, match="only with method cpu_int4"):
        formats.get_format("gptq").quantization_config(128, True, embedding=True)
