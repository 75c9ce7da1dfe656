import torch
from transformers import AutoModelForCausalLM

from fourbit.checkpoints.hf import load_tensors, read_config
from fourbit.steps.prepare import untie_head


def logits(folder, ids):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(ids).logits


def test_untied_model_gives_exactly_the_same_logits(tiny_tied, tmp_path):
    untie_head(tiny_tied, tmp_path / "out")
    assert read_config(tmp_path / "out")["tie_word_embeddings"] is False
    tensors = load_tensors(tmp_path / "out")
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(tiny_tied, ids), logits(tmp_path / "out", ids))


def test_untied_source_is_linked_not_copied(tiny_untied, tmp_path):
    untie_head(tiny_untied, tmp_path / "out")
    weights = tmp_path / "out" / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (tiny_untied / "model.safetensors").resolve()


def test_interrupted_untie_leaves_nothing_that_looks_finished(tiny_tied, tmp_path, monkeypatch):
    import fourbit.steps.prepare as untie

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(untie, "write_checkpoint", fail)
    try:
        untie_head(tiny_tied, tmp_path / "out")
    except KeyboardInterrupt:
        pass
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))
