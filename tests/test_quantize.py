"""quantize -> dequantize -> score on a tiny real checkpoint, for every method's format."""

import json

import pytest
import torch

from fourbit.checkpoints.hf import load_tensors, read_config
from fourbit.checkpoints.quantized import read_quantized
from fourbit.schema import canonical_quant, load_schema
from fourbit.engines import reference
from fourbit.steps.quantize import GroupSizeError, dequantize_checkpoint, quantize_checkpoint

SETTINGS = {"name": "reference", "dtype": "float32", "threads": 2}
WINDOWS = torch.randint(0, 512, (3, 48), generator=torch.Generator().manual_seed(0)).tolist()


def arm(**quant):
    return {"name": "t", "id": "t-0000000000", "quant": canonical_quant(quant, load_schema())}


def assert_reference_scores_like_its_control(quantized, dense):
    """The reference engine scores a quantized checkpoint as its dense expansion."""
    for q, d in zip(reference.score_windows(quantized, WINDOWS, SETTINGS, 2),
                    reference.score_windows(dense, WINDOWS, SETTINGS, 2)):
        assert abs(q["nll_sum"] - d["nll_sum"]) / q["tokens"] < 1e-5


@pytest.mark.parametrize(
    "quant, fmt",
    [
        ({"method": "cpu_int4", "group_size": 64, "search": "minmax"}, "fourbit_int4"),
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
    quantize_checkpoint(tiny_untied, tmp_path / "q", tmp_path / "arm.json", arm(method="cpu_int4", search="minmax"))
    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    _, _, qweights = read_quantized(tmp_path / "q")
    dense = load_tensors(tmp_path / "d")
    for name, qweight in qweights.items():
        assert torch.equal(dense[f"{name}.weight"], qweight.dequantize(torch.float32))


def test_group_that_does_not_divide_a_layer_names_the_layer(tmp_path):
    from conftest import save_tiny_llama

    save_tiny_llama(tmp_path / "m", tied=False, hidden=256, intermediate=320)
    with pytest.raises(GroupSizeError, match=r"mlp.down_proj: K=320 is not a multiple of group_size 128"):
        quantize_checkpoint(tmp_path / "m", tmp_path / "q", tmp_path / "arm.json", arm(method="cpu_int4", search="minmax"))
    assert not (tmp_path / "q").exists()


def test_quantize_head_off_keeps_the_head_dense(tiny_untied, tmp_path):
    manifest = quantize_checkpoint(
        tiny_untied, tmp_path / "q", tmp_path / "arm.json", arm(method="cpu_int4", search="minmax", quantize_head=False)
    )
    assert "lm_head" not in manifest["quantized_modules"]


def test_both_int4_paths_agree(tiny_untied, tmp_path):
    """Decoding-sized inputs run the int4 kernel; window-sized ones the expanded packed weight."""
    quantize_checkpoint(tiny_untied, tmp_path / "q", tmp_path / "arm.json", arm(method="cpu_int4", search="minmax"))
    model = reference.load_model(tmp_path / "q", torch.float32)
    linear = model.model.layers[0].mlp.down_proj
    x = torch.randn(reference.DEQUANT_ROWS, linear.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        many = linear(x)  # the expanded path
        few = torch.cat([linear(row[None]) for row in x])  # the kernel, one row at a time
    assert linear._expanded is not None
    assert torch.allclose(many, few, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("quant", "fmt"), [
    ({"method": "cpu_int4", "search": "minmax"}, "fourbit_int4"),
    ({"method": "rtn", "sym": True}, "gptq"),
    ({"method": "rtn", "sym": False}, "compressed-tensors"),
])
def test_quantized_embedding_is_looked_up_from_4_bits(tiny_untied, tmp_path, quant, fmt):
    """quantize_embedding: true stores the table [V, H] in cpu_int4's row layout in every
    format (cpu_int4 marks it itself, the others name it under INT4_EMBEDDING), counts it
    in the bits, and reads it back exactly; the dense control and the reference engine agree."""
    from fourbit.formats import INT4_EMBEDDING

    embedding = "model.embed_tokens"
    quant = {**quant, "group_size": 64}
    manifest = quantize_checkpoint(tiny_untied, tmp_path / "q", tmp_path / "arm.json",
                                   arm(**quant, quantize_embedding=True))
    assert embedding in manifest["quantized_modules"]
    table_size = load_tensors(tiny_untied)[f"{embedding}.weight"].numel()
    without = quantize_checkpoint(tiny_untied, tmp_path / "q0", tmp_path / "arm0.json", arm(**quant))
    assert manifest["storage"]["linear_weights"] == without["storage"]["linear_weights"] + table_size
    assert manifest["storage"]["size_bytes"] < without["storage"]["size_bytes"]
    assert manifest["method_facts"]["embedding"] == "rtn"
    config = read_config(tmp_path / "q")["quantization_config"]
    assert config["quant_method"] == fmt
    own = fmt == "fourbit_int4"
    assert config.get("embedding", False) is own and config.get(INT4_EMBEDDING) == (None if own else embedding)
    stored = load_tensors(tmp_path / "q")
    vocab, hidden = load_tensors(tiny_untied)[f"{embedding}.weight"].shape
    assert stored[f"{embedding}.qweight"].shape == (vocab, hidden // 2)  # whole rows, two codes a byte
    assert stored[f"{embedding}.qweight"].dtype == torch.uint8
    # the table's stored bits: 4 per weight and a float16 scale and a uint8 zero per group
    table_bits = sum(t.numel() * t.element_size() * 8 for name, t in stored.items()
                     if name.startswith(f"{embedding}."))
    assert table_bits == table_size * (4 + 24 / 64)
    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    table = read_quantized(tmp_path / "q")[2][embedding]
    assert torch.equal(load_tensors(tmp_path / "d")[f"{embedding}.weight"], table.dequantize(torch.float32))
    original = load_tensors(tiny_untied)[f"{embedding}.weight"]
    assert not torch.equal(table.dequantize(torch.float32), original)  # really rounded
    assert_reference_scores_like_its_control(tmp_path / "q", tmp_path / "d")


def test_gptq_and_compressed_tensors_do_not_mark_a_table_in_their_own_config():
    """Their loaders would expect a dense table; the 4-bit table is named beside them."""
    from fourbit import formats

    for name in ("gptq", "compressed_tensors"):
        assert not formats.get_format(name).marks_embedding
        assert formats.table_layout(formats.get_format(name)) is formats.get_format("cpu_int4")
        with pytest.raises(ValueError, match="fourbit.formats.table"):
            formats.get_format(name).quantization_config(128, True, embedding=True)


# ---- calibrated methods: the held-out guard on the grid search ----

@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny untied Llama with a real SentencePiece tokenizer, and a calibration split."""
    from conftest import save_tiny_llama

    from fourbit.inputs.tokenizer import train_tokenizer
    from fourbit.steps.prepare import prepare_corpus

    root = tmp_path_factory.mktemp("calibrated")
    prepare_corpus({"source": "builtin", "max_bytes": 300_000, "calibration_fraction": 0.2,
                    "evaluation_fraction": 0.1}, root / "corpus")
    save_tiny_llama(root / "model", tied=False)
    train_tokenizer(root / "corpus" / "train.txt", root / "model", 512)
    return root / "model", root / "corpus" / "calibration.txt"


CALIBRATION = {"samples": 6, "seq_len": 64, "heldout": 3}


@pytest.fixture
def one_thread():
    """One torch thread: on a shared 2-core host two threads spin-wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_held_out_windows_are_disjoint_from_the_calibration_ones(calibrated):
    from fourbit.quantizers.methods import QuantizeJob, calibration_tokens

    model, text = calibrated
    quant = {"method": "gptq", "calibration": {**CALIBRATION, "seed": 0}}
    job = QuantizeJob(model, {}, quant, text, 1)
    windows = calibration_tokens(job, CALIBRATION["heldout"])
    assert windows.shape == (6 + 3, 64)
    fit, held = windows[:6], windows[6:]
    assert not any(torch.equal(a, b) for a in fit for b in held)
    # one non-overlapping draw: no token position is shared (windows are distinct slices)
    assert len({tuple(w.tolist()) for w in windows}) == 9
    assert torch.equal(calibration_tokens(job, 3), windows)  # seeded


def test_split_hessian_keeps_the_held_out_rows_apart():
    from fourbit.quant.hessian import Hessian
    from fourbit.quantizers.methods import _HeldOutHessian

    x = torch.randn(5, 40, 16, generator=torch.Generator().manual_seed(0))  # 5 windows [1, T, K]
    split = _HeldOutHessian(16, fit_tokens=3 * 40)
    fit, held = Hessian(16), Hessian(16)
    for i, window in enumerate(x):
        split.add_batch(window.unsqueeze(0))
        (fit if i < 3 else held).add_batch(window)
    torch.testing.assert_close(split.h, fit.h)
    torch.testing.assert_close(split.heldout.h, held.h)
    assert split.n == 120 and split.heldout.n == 80


HELDOUT_ONLY = {"seq_len": 64, "heldout": 3}  # a search that fits nothing: only held-out windows


@pytest.mark.slow
@pytest.mark.parametrize(
    "quant, calibration",
    [
        ({"method": "cpu_int4", "group_size": 64, "importance": "activation"}, CALIBRATION),
        ({"method": "gptq", "group_size": 32, "sym": False, "quantize_embedding": True}, CALIBRATION),
        ({"method": "gptq", "group_size": 128, "sym": True, "head_method": "rtn"}, CALIBRATION),
        # searches without importance: the held-out windows are all they read
        ({"method": "cpu_int4", "group_size": 64, "quantize_embedding": True}, HELDOUT_ONLY),
        ({"method": "rtn", "group_size": 32, "sym": True, "search": "weighted"}, HELDOUT_ONLY),
    ],
)
def test_every_searched_arm_keeps_the_better_of_search_and_minmax_per_layer(
        calibrated, tmp_path, quant, calibration, one_thread):
    """Every layer's stored weight is no worse on held-out output error than plain min/max
    rounding of the same grid: checked against the first layer's inputs recomputed here
    from the unquantized model (nothing before them is quantized), and for every layer
    against what the guard recorded; a quantized embedding likewise, on the held-out
    windows' tokens."""
    from transformers import AutoModelForCausalLM

    from fourbit.quant.grid import Grid, quantize_rtn
    from fourbit.quant.hessian import Hessian
    from fourbit.quantizers.methods import QuantizeJob, calibration_tokens, heldout_error, lookup_error

    model_dir, text = calibrated
    spec = arm(**quant, calibration=calibration)
    fitted = calibration.get("samples", 0)
    manifest = quantize_checkpoint(model_dir, tmp_path / "q", tmp_path / "arm.json", spec,
                                   calibration_text=text)
    facts = manifest["method_facts"]
    guard = facts["heldout_guard"]
    assert facts["tokens"] == fitted * 64 and facts["heldout_tokens"] == 3 * 64
    assert guard["search"] == "weighted" and guard["heldout_windows"] == 3
    layers = set(manifest["quantized_modules"])
    assert set(guard["kept_search"]) | set(guard["kept_minmax"]) == layers
    assert not set(guard["kept_search"]) & set(guard["kept_minmax"])
    for name, errors in guard["heldout_relative_error"].items():
        kept = "weighted" if name in guard["kept_search"] else "minmax"
        assert errors[kept] <= min(errors.values()), name
    assert guard["kept_search"]  # the search is not simply switched off

    # Independently: layer 0's q/k/v read the unquantized embedding's normed output.
    windows = calibration_tokens(QuantizeJob(model_dir, {}, spec["quant"], text, 1), 3)
    assert len(windows) == fitted + 3
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    h_held = Hessian(model.config.hidden_size)
    hook = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda _m, args: h_held.add_batch(args[0]))
    with torch.no_grad():
        for ids in windows[fitted:]:
            model(ids.unsqueeze(0))
    hook.remove()
    _, _, qweights = read_quantized(tmp_path / "q")
    grid = Grid(group_size=quant["group_size"], sym=spec["quant"]["sym"])
    if quant.get("quantize_embedding"):
        name, table = "model.embed_tokens", model.model.embed_tokens.weight.detach()
        counts = torch.bincount(windows[fitted:].flatten(), minlength=len(table)).float()
        stored = lookup_error(table, qweights[name].dequantize(), counts)
        plain = lookup_error(table, quantize_rtn(table, grid, search="minmax").dequantize(), counts)
        assert stored <= plain * (1 + 1e-6)
        kept = "weighted" if name in guard["kept_search"] else "minmax"
        assert stored == pytest.approx(guard["heldout_relative_error"][name][kept], rel=1e-4)
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}"
        w = getattr(model.model.layers[0].self_attn, proj).weight.detach()
        stored = heldout_error(w, qweights[name].dequantize(), h_held.h)
        kept = "weighted" if name in guard["kept_search"] else "minmax"
        assert stored == pytest.approx(guard["heldout_relative_error"][name][kept], rel=1e-4)
        if quant["method"] != "gptq":  # plain rounding, recomputed here
            plain = heldout_error(w, quantize_rtn(w, grid, search="minmax").dequantize(), h_held.h)
            assert stored <= plain * (1 + 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("quant, calibration", [
    ({"method": "cpu_int4", "group_size": 64, "quantize_embedding": True}, HELDOUT_ONLY),
    ({"method": "rtn", "group_size": 64, "sym": True, "search": "shrink"}, HELDOUT_ONLY),
    ({"method": "gptq", "group_size": 64, "sym": False}, CALIBRATION),
])
def test_a_search_worse_than_plain_rounding_is_dropped_layer_by_layer(
        calibrated, tmp_path, monkeypatch, quant, calibration, one_thread):
    """A search that makes every grid worse (its codes shifted one level, a fault injected
    here) is kept nowhere: every tensor is stored exactly as plain min/max rounding of
    the same grid would store it (for gptq: as its minmax pass would)."""
    from fourbit.quant import gptq
    from fourbit.quant.grid import quantize_rtn
    from fourbit.quant.qweight import QuantizedWeight
    from fourbit.quantizers import methods

    def one_level_off(quantize):
        def searched_badly(weight, hessian_or_grid, *args, search="weighted", **kwargs):
            result = quantize(weight, hessian_or_grid, *args, search=search, **kwargs)
            qweight = result[0] if isinstance(result, tuple) else result
            if search == "minmax":
                return result
            worse = QuantizedWeight((qweight.codes.int() + 1).clamp(max=15).to(torch.uint8),
                                    qweight.scales, qweight.zeros, qweight.group_size)
            return (worse, result[1]) if isinstance(result, tuple) else worse
        return searched_badly

    monkeypatch.setattr(methods, "quantize_rtn", one_level_off(quantize_rtn))
    monkeypatch.setattr(gptq, "gptq_quantize", one_level_off(gptq.gptq_quantize))
    manifest = quantize_checkpoint(calibrated[0], tmp_path / "q", tmp_path / "arm.json",
                                   arm(**quant, calibration=calibration), calibration_text=calibrated[1])
    guard = manifest["method_facts"]["heldout_guard"]
    assert guard["kept_search"] == []
    assert set(guard["kept_minmax"]) == set(manifest["quantized_modules"])
    if quant["method"] != "gptq":  # plain rounding needs no walk to recompute
        _, _, qweights = read_quantized(tmp_path / "q")
        weights = load_tensors(calibrated[0])
        grid = methods.grid_of(arm(**quant, calibration=calibration)["quant"])
        for name, qweight in qweights.items():
            plain = quantize_rtn(weights[f"{name}.weight"].float(), grid, search="minmax")
            assert torch.equal(qweight.codes, plain.codes), name


@pytest.mark.parametrize("quant, fmt", [
    ({"method": "cpu_int4", "group_size": 64, "search": "minmax"}, "fourbit_int4"),
    ({"method": "rtn", "group_size": 64, "sym": True}, "gptq"),
    ({"method": "rtn", "group_size": 64, "sym": False}, "compressed-tensors"),
])
def test_an_8_bit_head_is_stored_in_its_layout_counted_and_expanded_exactly(tiny_untied, tmp_path,
                                                                            quant, fmt):
    """quantize_head: 8 keeps the head on the 8-bit grid inside any format: listed in the
    quantization_config, its bits counted from the file, and the dense control and the
    reference engine read the very same W_hat."""
    from fourbit.formats import INT8_MODULES
    from fourbit.quant.int8 import quantize_int8

    manifest = quantize_checkpoint(tiny_untied, tmp_path / "q", tmp_path / "arm.json",
                                   arm(**quant, quantize_head=8))
    four_bit = quantize_checkpoint(tiny_untied, tmp_path / "q4", tmp_path / "arm4.json", arm(**quant))
    config = read_config(tmp_path / "q")["quantization_config"]
    assert config["quant_method"] == fmt and config[INT8_MODULES] == ["lm_head"]
    assert manifest["method_facts"]["head"] == "rtn, 8 bits" and "lm_head" in manifest["quantized_modules"]
    head = load_tensors(tiny_untied)["lm_head.weight"]  # [512, 256]
    _, _, qweights = read_quantized(tmp_path / "q")
    assert qweights["lm_head"].equal(quantize_int8(head, 64))
    # 4 bits more per head weight (8-bit codes; one float16 scale per group either way,
    # the 4-bit grid's zero points and GPTQ's index aside), over every quantized weight
    extra = manifest["storage"]["quantized_bits_per_weight"] - four_bit["storage"]["quantized_bits_per_weight"]
    share = head.numel() / manifest["storage"]["linear_weights"]
    assert 3.5 * share < extra < 4.1 * share
    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    assert torch.equal(load_tensors(tmp_path / "d")["lm_head.weight"], qweights["lm_head"].dequantize())
    assert_reference_scores_like_its_control(tmp_path / "q", tmp_path / "d")


@pytest.mark.parametrize("quant, fmt", [
    ({"method": "cpu_int4", "group_size": 64, "search": "minmax"}, "fourbit_int4"),
    ({"method": "rtn", "group_size": 64, "sym": True}, "gptq"),
    ({"method": "rtn", "group_size": 32, "sym": False}, "compressed-tensors"),
])
def test_an_8_bit_embedding_is_stored_in_its_layout_counted_and_expanded_exactly(tiny_untied, tmp_path,
                                                                                 quant, fmt):
    """quantize_embedding: 8 keeps the table on the 8-bit grid inside any format, flagged
    for readers that see it without its name, counted in the bits per weight, and expanded
    exactly by the dense control, which the reference engine scores alike."""
    from fourbit.formats import INT8_EMBEDDING, INT8_MODULES
    from fourbit.quant.int8 import quantize_int8

    manifest = quantize_checkpoint(tiny_untied, tmp_path / "q", tmp_path / "arm.json",
                                   arm(**quant, quantize_embedding=8))
    dense = quantize_checkpoint(tiny_untied, tmp_path / "q4", tmp_path / "arm4.json", arm(**quant))
    config = read_config(tmp_path / "q")["quantization_config"]
    embedding = "model.embed_tokens"
    assert config["quant_method"] == fmt and config[INT8_MODULES] == [embedding]
    assert config[INT8_EMBEDDING] is True and not config.get("embedding", False)
    assert manifest["method_facts"]["embedding"] == "rtn, 8 bits"
    table = load_tensors(tiny_untied)[f"{embedding}.weight"]  # [512, 256]
    _, _, qweights = read_quantized(tmp_path / "q")
    assert qweights[embedding].equal(quantize_int8(table, quant["group_size"]))
    # the table at 8 bits and a float16 scale per group, where the plain arm stores 32
    bits = {k: v["storage"]["matrix_bits_per_weight"] for k, v in (("8", manifest), ("dense", dense))}
    share = table.numel() / manifest["storage"]["matrix_weights"]
    saved = (32 - 8 - 16 / quant["group_size"]) * share
    assert bits["dense"] - bits["8"] == pytest.approx(saved, rel=1e-6)
    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    assert torch.equal(load_tensors(tmp_path / "d")[f"{embedding}.weight"], qweights[embedding].dequantize())
    assert_reference_scores_like_its_control(tmp_path / "q", tmp_path / "d")


def test_vllm_native_is_not_given_an_arm_with_an_8_bit_matrix():
    from fourbit.engines import ENGINES

    runs = ENGINES["vllm_native"].runs_arm
    assert runs(arm(method="gptq", group_size=128, sym=True)["quant"])
    assert not runs(arm(method="gptq", group_size=128, sym=True, quantize_head=8)["quant"])
    assert not runs(arm(method="gptq", group_size=128, sym=True, quantize_embedding=8)["quant"])
    assert not runs(arm(method="gptq", group_size=128, sym=True, quantize_embedding=True)["quant"])
    assert not runs(arm(method="gptq", group_size=128, sym=True, mixed_precision={"extra_bits": 0.5})["quant"])


@pytest.mark.parametrize("extra", [{"quantize_head": False}, {"quantize_embedding": True}])
def test_matrix_bits_count_the_head_and_embedding_however_stored(tiny_untied, tmp_path, extra):
    """matrix_bits_per_weight spends every matrix's stored bits over every matrix's weights:
    a dense head or embedding at its 32 bits, a quantized one at its grid's."""
    from fourbit.checkpoints.hf import load_tensors
    from fourbit.checkpoints.quantized import storage_stats

    quant = {"method": "cpu_int4", "group_size": 64, "search": "minmax", **extra}
    storage = quantize_checkpoint(tiny_untied, tmp_path / "q", tmp_path / "arm.json", arm(**quant))["storage"]
    dense = load_tensors(tiny_untied)
    head, embedding = dense["lm_head.weight"].numel(), dense["model.embed_tokens.weight"].numel()
    quantized_bits = storage["quantized_bits_per_weight"] * storage["linear_weights"]
    dense_weights = (head if "quantize_head" in extra else 0) + (0 if "quantize_embedding" in extra else embedding)
    assert storage["linear_weights"] + dense_weights == storage["matrix_weights"]
    assert storage["matrix_bits_per_weight"] == pytest.approx(
        (quantized_bits + 32 * dense_weights) / storage["matrix_weights"])
    assert storage_stats(tiny_untied)["matrix_bits_per_weight"] == 32  # the float32 baseline
