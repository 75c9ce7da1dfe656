import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fourbit.builtin_model import DEFAULT_SPEC, TINY_SPEC, resolve_spec, train_builtin_model
from fourbit.corpus import prepare_corpus

# Smaller than TINY_SPEC so the unit tests stay quick; TINY_SPEC is for workflow tests.
MICRO_SPEC = {**TINY_SPEC, "seq_len": 64, "batch_size": 4, "steps": 4, "eval_windows": 4}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "corpus"
    spec = {
        "source": "builtin",
        "max_bytes": 1_000_000,
        "calibration_fraction": 0.2,
        "evaluation_fraction": 0.2,
    }
    prepare_corpus(spec, out)
    return out


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "model"
    return out, train_builtin_model(corpus, out, MICRO_SPEC)


def test_training_twice_gives_bit_identical_weights(corpus, trained, tmp_path):
    first_dir, first = trained
    second = train_builtin_model(corpus, tmp_path / "again", MICRO_SPEC)
    files = sorted(p.name for p in first_dir.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "again").iterdir())
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.model"} < set(
        files
    )
    for name in set(files) - {"training.json"}:  # which holds the wall time
        assert (tmp_path / "again" / name).read_bytes() == (first_dir / name).read_bytes(), name
    assert second["model_sha256"] == first["model_sha256"]
    assert second["held_out_perplexity"] == first["held_out_perplexity"]


def test_training_leaves_the_callers_torch_settings_alone(corpus, trained):
    assert not torch.are_deterministic_algorithms_enabled()


def test_saved_folder_loads_as_a_hugging_face_causal_lm(trained):
    out, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer("def f(x):\n    return", return_tensors="pt")
    assert inputs["input_ids"][0, 0].item() == tokenizer.bos_token_id == model.config.bos_token_id
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[-1] == MICRO_SPEC["vocab_size"] and torch.isfinite(logits).all()


def test_training_report_is_saved_and_returned(trained):
    out, report = trained
    assert json.loads((out / "training.json").read_text()) == report
    assert report["spec"] == resolve_spec(MICRO_SPEC)
    assert report["train_tokens_seen"] == 4 * 4 * 63
    assert report["uniform_perplexity"] == MICRO_SPEC["vocab_size"]
    assert 1 < report["held_out_perplexity"] < report["uniform_perplexity"]
    assert report["held_out_windows"] == 4


@pytest.mark.parametrize(
    "key, value", [("hidden_size", 200), ("intermediate_size", 700), ("vocab_size", 1000)]
)
def test_dimensions_must_be_multiples_of_256(key, value):
    with pytest.raises(ValueError, match=f"{key}={value} must be a multiple of 256"):
        resolve_spec({key: value})


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"num_heads": 3}, "hidden_size=256 / num_heads=3 must give a whole, even head_dim"),
        ({"num_kv_heads": 3}, "num_heads=4 must be a multiple of num_kv_heads=3"),
        ({"steps": 0}, "steps=0 must be more than zero"),
        ({"steps": 2.5}, "steps=2.5 must be a whole number"),
        ({"lr": "fast"}, "lr='fast' must be a number"),
        ({"layers": 2}, r"unknown key\(s\) \['layers'\]"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_spec(spec)


def test_default_and_tiny_specs_are_valid():
    assert resolve_spec({}) == DEFAULT_SPEC
    assert resolve_spec(TINY_SPEC) == TINY_SPEC


def test_a_missing_corpus_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.txt does not exist; prepare the corpus"):
        train_builtin_model(tmp_path, tmp_path / "model", MICRO_SPEC)
