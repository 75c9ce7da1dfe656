"""fourbit.quantizers.shapes: the plan made from config.json before any job is the one the
quantize job makes from the real module tree and the real format tables."""

import itertools

import pytest

from fourbit.schema import allowed
from fourbit.formats import FORMATS, get_format
from fourbit.layouts import GGUF_TYPES, LAYOUTS
from fourbit.quantizers import shapes
from fourbit.quantizers.methods import get_method

# A 135M-like model (hidden 576, 9 / 3 heads), two layers: 576 is not a multiple of 128.
WIDE_576 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
}


def quant(method="cpu_int4", group_size=128, **extra):
    base = {"method": method, "group_size": group_size, "sym": method != "cpu_int4", "quantize_head": True}
    return {**base, **extra}


def test_every_format_packs_by_the_table_the_planner_reads():
    assert set(LAYOUTS) == set(FORMATS)
    assert all(FORMATS[name].layout is LAYOUTS[name] for name in FORMATS)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_does_not_fit_exactly_when_the_format_refuses(name):
    fmt = get_format(name)
    for n, k, g in itertools.product((8, 12, 16, 192, 200), (64, 96, 99, 100, 576, 1536), allowed("group_size")):
        try:
            fmt.shapes(n, k, g)
            refused = False
        except ValueError:
            refused = True
        assert (shapes.does_not_fit(name, n, k, g) is not None) == refused, (n, k, g)


@pytest.mark.parametrize("method,sym", [("cpu_int4", False), ("rtn", True), ("rtn", False),
                                        ("gptq", True), ("gptq", False)])
def test_format_of_agrees_with_the_method(method, sym):
    q = {"method": method, "sym": sym}
    assert shapes.format_of(q) == get_method(method).format(q)


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}),
    ("llama", {"head_dim": 32}),  # head_dim not hidden / heads
    ("qwen2", {}),
    ("mistral", {}),
])
def test_matrices_from_config_are_the_skeletons(model_type, extra):
    """The DAG-time arithmetic against the module tree transformers builds (what
    fourbit.steps.quantize.select_modules reads)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fourbit.checkpoints.hf import module_name, quantizable_linears
    from fourbit.checkpoints.quantized import matrix_shape

    config = {"model_type": model_type, "hidden_size": 192, "intermediate_size": 320,
              "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
              "vocab_size": 1000, "tie_word_embeddings": False, **extra}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    planned = shapes.matrices_from_config(config)
    linears = {name: matrix_shape(m) for name, m in quantizable_linears(model).items()}
    assert list(planned.linears.items()) == list(linears.items())
    assert planned.head == module_name(model, model.get_output_embeddings())
    assert planned.embedding == module_name(model, model.get_input_embeddings())
    assert planned.embedding_shape == matrix_shape(model.get_input_embeddings())


def test_a_layout_fourbit_does_not_walk_is_refused_by_name():
    with pytest.raises(shapes.ShapeError, match="model_type 'gpt2'.*llama, mistral, qwen2"):
        shapes.matrices_from_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_group_128_on_576_wide_layers_names_layers_widths_and_the_groups_that_fit():
    plan = shapes.plan_arm(shapes.matrices_from_config(WIDE_576), quant(group_size=128), "g128")
    assert plan.refusal is not None
    assert "arm g128 (cpu_int4, group_size 128" in plan.refusal
    assert ("model.layers.{0-1}.self_attn.q_proj: K=576 is not a multiple of group_size 128 "
            "(N=576, K=576)") in plan.refusal
    assert "lm_head: K=576" in plan.refusal
    assert "mlp.down_proj" not in plan.refusal  # K=1536 = 12 x 128 fits
    assert "group sizes that fit every matrix: 32, 64" in plan.refusal
    assert "fallback: dense" in plan.refusal


def test_group_64_fits_the_576_wide_model():
    plan = shapes.plan_arm(shapes.matrices_from_config(WIDE_576), quant(group_size=64), "g64")
    assert plan.refusal is None and not plan.kept_dense
    assert len(plan.quantized) == 2 * 7 + 1


def test_the_embedding_is_checked_only_when_the_arm_quantizes_it():
    matrices = shapes.matrices_from_config(WIDE_576)  # the table [49152, 576] is grouped along 576
    without = shapes.plan_arm(matrices, quant(group_size=128))
    with_table = shapes.plan_arm(matrices, quant(group_size=128, quantize_embedding=True))
    assert "model.embed_tokens" not in without.refusal
    assert "model.embed_tokens: K=576 is not a multiple of group_size 128 (N=49152, K=576)" in with_table.refusal
    assert "model.embed_tokens" in shapes.plan_arm(matrices, quant(group_size=64, quantize_embedding=True)).quantized


def test_a_4_bit_table_is_checked_against_its_own_layout_in_every_format():
    """The table is stored in cpu_int4's layout whatever the arm's format, so a vocabulary
    that compressed-tensors' zero points [N/8, K/G] could not hold does not refuse it."""
    matrices = shapes.matrices_from_config({**WIDE_576, "vocab_size": 49155})
    plan = shapes.plan_arm(matrices, quant("gptq", 64, sym=False, quantize_head=False, quantize_embedding=True))
    assert plan.refusal is None and "model.embed_tokens" in plan.quantized
    head = shapes.plan_arm(matrices, quant("gptq", 64, sym=False))  # the head is in the format's own
    assert "lm_head: N=49155 is not a multiple of 8" in head.refusal


def test_fallback_dense_keeps_misfits_and_their_merged_siblings_dense():
    # head_dim 4 with one KV head: k/v have N=4, which GPTQ's qzeros [K/G, N/8] cannot
    # hold; q fits alone but vLLM merges it with k and v, so all three stay dense.
    config = {**WIDE_576, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 64,
              "num_key_value_heads": 1}
    plan = shapes.plan_arm(shapes.matrices_from_config(config), quant("gptq", 128, fallback="dense"))
    assert plan.refusal is None
    dense_suffixes = {name.split(".", 3)[3] for name in plan.kept_dense}
    assert dense_suffixes == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
    assert set(plan.misfits) == {f"model.layers.{i}.self_attn.{m}_proj" for i in (0, 1) for m in "kv"}
    assert "N=4 is not a multiple of 8" in plan.misfits["model.layers.0.self_attn.k_proj"]
    assert "model.layers.0.self_attn.o_proj" in plan.quantized and "lm_head" in plan.quantized


def test_refuse_is_the_default_policy():
    config = {**WIDE_576, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 64,
              "num_key_value_heads": 1}
    plan = shapes.plan_arm(shapes.matrices_from_config(config), quant("gptq", 128))
    assert "no group size fits every matrix" in plan.refusal


def test_fallback_dense_that_leaves_nothing_quantized_is_refused():
    plan = shapes.plan_arm(shapes.matrices_from_config({**WIDE_576, "intermediate_size": 1000}),
                           quant(group_size=128, fallback="dense"))
    assert plan.refusal and "would leave nothing quantized" in plan.refusal


def test_llamacpp_arms_are_never_refused_but_their_fallbacks_are_listed():
    matrices = shapes.matrices_from_config(WIDE_576)
    fallbacks = shapes.llamacpp_fallbacks(matrices, {"type": "Q4_K_M"})
    assert "model.layers.0.mlp.down_proj" not in fallbacks  # 1536 = 6 x 256
    assert fallbacks["model.layers.1.self_attn.q_proj"] == "K=576 is not a multiple of 256 (Q4_K_M's block)"
    assert shapes.llamacpp_fallbacks(matrices, {"type": "Q4_0"}) == {}  # 576 = 18 x 32
    named = shapes.llamacpp_fallbacks(matrices, {"type": "Q4_0", "output_tensor_type": "q6_k",
                                                 "token_embedding_type": "f16"})
    assert named == {"lm_head": "K=576 is not a multiple of 256 (q6_k's block)"}


@pytest.mark.parametrize("qtype", allowed("llamacpp_type"))
def test_every_llamacpp_type_falls_back_where_its_block_does_not_divide_the_rows(qtype):
    fallbacks = shapes.llamacpp_fallbacks(shapes.matrices_from_config(WIDE_576), {"type": qtype})
    if GGUF_TYPES[qtype].block == 256:  # the K types and IQ4_XS: 576 = 2.25 x 256
        assert fallbacks["model.layers.0.self_attn.q_proj"] == (
            f"K=576 is not a multiple of 256 ({qtype}'s block)")
    else:  # 576 = 18 x 32
        assert fallbacks == {}


@pytest.mark.parametrize("method", ["cpu_int4", "rtn"])
def test_fallback_dense_writes_a_checkpoint_the_control_and_the_reference_engine_read(tmp_path, method):
    """down_proj (K=320) does not fit group 128; with fallback: dense it stays as it was,
    arm.json names it and counts its bits, and the dense control and the reference
    engine read the mixed checkpoint."""
    import json

    import torch
    from conftest import save_tiny_llama

    from fourbit.checkpoints.hf import load_tensors
    from fourbit.schema import canonical_quant, load_schema
    from fourbit.engines import reference
    from fourbit.steps.quantize import dequantize_checkpoint, quantize_checkpoint

    save_tiny_llama(tmp_path / "m", tied=False, hidden=256, intermediate=320)
    quant = canonical_quant({"method": method, "group_size": 128, "fallback": "dense", "search": "minmax"},
                            load_schema())
    arm = {"name": "t", "id": "t-0000000000", "quant": quant}
    manifest = quantize_checkpoint(tmp_path / "m", tmp_path / "q", tmp_path / "arm.json", arm)
    down = [f"model.layers.{i}.mlp.down_proj" for i in (0, 1)]
    storage = json.loads((tmp_path / "arm.json").read_text())["storage"]
    assert sorted(storage["fallback_dense"]) == down and storage["fallback_dense_weights"] == 2 * 256 * 320
    assert not set(down) & set(manifest["quantized_modules"]) and "lm_head" in manifest["quantized_modules"]
    # dense float32 weights at 32 bits pull the average up from ~4.2 bits
    assert storage["quantized_bits_per_weight"] < 5 < storage["bits_per_weight_with_fallback"] < 32
    source, stored = load_tensors(tmp_path / "m"), load_tensors(tmp_path / "q")
    for name in down:
        assert torch.equal(stored[f"{name}.weight"], source[f"{name}.weight"])
    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    assert torch.equal(load_tensors(tmp_path / "d")[f"{down[0]}.weight"], source[f"{down[0]}.weight"])
    windows = [list(range(1, 33))]
    settings = {"dtype": "float32", "threads": 1}
    quantized = reference.score_windows(tmp_path / "q", windows, settings, 1)
    dense = reference.score_windows(tmp_path / "d", windows, settings, 1)
    assert abs(quantized[0]["nll_sum"] - dense[0]["nll_sum"]) < 1e-3 * quantized[0]["tokens"]


@pytest.mark.slow
def test_vllm_serves_a_fallback_arm_whose_merged_layers_stay_dense(tmp_path):
    """hidden 320 does not fit group 128: q/k/v (vLLM's qkv_proj), o, gate/up (gate_up_proj)
    and the head stay dense, down_proj (K=512) is quantized; fourbit's plugin serves the
    mix and agrees with the arm's dense expansion."""
    import torch
    import transformers

    from fourbit.schema import canonical_quant, load_schema
    from fourbit.engines import vllm
    from fourbit.steps.quantize import dequantize_checkpoint, quantize_checkpoint

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=320, intermediate_size=512, num_hidden_layers=2, vocab_size=512, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.1)
    transformers.LlamaForCausalLM(config).float().eval().save_pretrained(tmp_path / "m")
    quant = canonical_quant({"method": "rtn", "group_size": 128, "fallback": "dense"}, load_schema())
    manifest = quantize_checkpoint(tmp_path / "m", tmp_path / "q", tmp_path / "arm.json",
                                   {"name": "t", "id": "t-0000000000", "quant": quant})
    assert manifest["quantized_modules"] == [f"model.layers.{i}.mlp.down_proj" for i in (0, 1)]
    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    settings = {"name": "vllm", "dtype": "float32", "enforce_eager": True, "kv_cache_gib": 0.25,
                "max_num_seqs": 1, "quant": {}}
    windows = [torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(1)).tolist()]
    quantized = vllm.score_windows(tmp_path / "q", windows, settings, 2)
    dense = vllm.score_windows(tmp_path / "d", windows, settings, 2)
    assert "fourbit_int4 plugin on gptq weights" in vllm.runtime(tmp_path / "q", settings)
    assert abs(quantized[0]["nll_sum"] - dense[0]["nll_sum"]) < 1e-4 * quantized[0]["tokens"]
