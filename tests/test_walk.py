import pytest
import torch

from fourbit.checkpoints.hf import CheckpointError
from fourbit.quantizers.calibration import calibration_samples
from fourbit.quant.grid import Grid, quantize_rtn
from fourbit.quant.hessian import Hessian
from fourbit.quantizers.walk import quantize_sequential

LINEARS = [
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
]


def save_tiny(folder, arch="llama", tied=False):
    """A random 2-layer model, hidden 64; the Qwen2 one has a sliding-window layer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    if arch == "llama":
        config, cls = LlamaConfig(**shape), LlamaForCausalLM
    else:
        sliding = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
        config, cls = Qwen2Config(**shape, **sliding), Qwen2ForCausalLM
    torch.manual_seed(0)
    cls(config).eval().save_pretrained(folder)
    return folder


def samples(n=3, t=16):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(1))


def reference_hessians(folder, ids, w_hats=None):
    """Each linear's input Hessian in the whole model, with every W_hat in place
    (None: the float model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hessians = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if w_hats is not None:
                module.weight.data.copy_(w_hats[name])
            hessians[name] = Hessian(module.in_features)
            module.register_forward_pre_hook(lambda m, args, n=name: hessians[n].add_batch(args[0]))
    with torch.no_grad():
        model(ids)
    return {name: h.h for name, h in hessians.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantize", ["identity", "rtn"])
def test_walk_is_faithful_and_sequential(tmp_path, arch, quantize):
    """Every linear's Hessian equals the one its input has in the full model with all
    returned W_hat in place: with W unchanged, that is the float model (the captured
    layer inputs reproduce its hidden states); with RTN, each linear saw the outputs
    of every linear before it quantized, across layers and within one."""
    folder = save_tiny(tmp_path / arch, arch)
    ids, seen, w_hats = samples(), {}, {}

    def callback(name, w, h):
        assert name not in seen, f"{name} quantized twice"
        seen[name] = h.clone()
        if quantize == "identity":
            w_hats[name] = w.clone()
        else:
            qw = quantize_rtn(w, Grid(group_size=32), importance=h.diagonal())
            w_hats[name] = qw.dequantize()
        return w_hats[name]

    info = quantize_sequential(folder, ids, callback)

    expected = [f"model.layers.{i}.{n}" for i in range(2) for n in LINEARS] + ["lm_head"]
    assert list(seen) == expected  # once each, in forward order
    assert info["layers"] == 2 and info["linears_quantized"] == 15 and info["tokens"] == ids.numel()
    assert info["peak_rss_mb"] > 0
    reference = reference_hessians(folder, ids, w_hats)
    for name in expected:
        want = reference[name]
        assert seen[name].shape == want.shape and w_hats[name].dim() == 2
        torch.testing.assert_close(seen[name], want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    if quantize == "rtn":  # the test has teeth: the float model's inputs differ by now
        float_model = reference_hessians(folder, ids)
        assert not torch.allclose(float_model["lm_head"], reference["lm_head"], rtol=1e-3)


def test_head_false_skips_the_head_and_allows_a_tied_model(tmp_path):
    folder = save_tiny(tmp_path / "tied", tied=True)
    names = []
    quantize_sequential(folder, samples(1, 8), lambda n, w, h: names.append(n) or w, head=False)
    assert len(names) == 14 and "lm_head" not in names
    with pytest.raises(CheckpointError, match="no lm_head.weight"):
        quantize_sequential(folder, samples(1, 8), lambda n, w, h: w)


def test_unexpected_architecture_names_the_missing_module(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel has no model.embed_tokens"):
        quantize_sequential(tmp_path, samples(1, 8), lambda n, w, h: w)


def test_wrong_shape_from_quantizer_names_the_layer(tmp_path):
    folder = save_tiny(tmp_path / "m")
    message = r"model.layers.0.self_attn.q_proj: quantizer returned \(64, 32\) for a \(64, 64\)"
    with pytest.raises(ValueError, match=message):
        quantize_sequential(folder, samples(1, 8), lambda n, w, h: w[:, :32])


def test_calibration_windows_are_seeded_and_disjoint():
    stream = torch.arange(1000)
    a = calibration_samples(stream, 20, 10, seed=0)
    assert a.shape == (20, 10) and a.dtype == torch.int64
    assert torch.equal(a, a[:, :1] + torch.arange(10))  # each window is a run of the stream
    starts = a[:, 0]
    assert (starts.diff() >= 10).all()  # in stream order, never overlapping
    assert torch.equal(calibration_samples(stream.tolist(), 20, 10, seed=0), a)
    assert not torch.equal(calibration_samples(stream, 20, 10, seed=1), a)


def test_too_small_calibration_split_names_the_numbers():
    with pytest.raises(ValueError, match="has 50 tokens; 6 windows of 10 need 60"):
        calibration_samples(list(range(50)), 6, 10, seed=0)


def test_linears_kept_dense_are_walked_but_not_counted_as_quantized(tmp_path):
    """A fallback: dense linear comes back from the quantizer as itself; the layers after
    it are measured with it as it is, and linears_quantized does not count it."""
    folder = save_tiny(tmp_path / "m")
    seen = []

    def keep_down_dense(name, w, h):
        seen.append(name)
        return w if name.endswith("mlp.down_proj") else w.clone()

    info = quantize_sequential(folder, samples(), keep_down_dense)
    assert len(seen) == 2 * len(LINEARS) + 1  # every linear of both layers, and the head
    assert info["linears_quantized"] == 2 * (len(LINEARS) - 1) + 1
