import json

import pytest
import sentencepiece as spm
from transformers import AutoTokenizer

from fourbit.inputs.tokenizer import BOS_ID, EOS_ID, UNK_ID, check_roundtrip, train_tokenizer
from fourbit.steps.prepare import prepare_corpus

VOCAB_SIZE = 512
SAMPLES = {
    "indentation": "def f(x):\n    if x:\n        return [\n            x,\n        ]\n",
    "tabs": "class A:\n\tdef g(self):\n\t\treturn '\\t'\n",
    "blank lines": "a = 1\n\n\n\n\nb = 2\n\n",
    "runs of spaces": "x  =   3      # note   \n   \n",
    "unicode": "naïve = 'café ∑ π ✓ 日本語 😀'\n",
    "digits": "n = 1234567890 + 3.14159e-10 + 0xDEADBEEF\n",
}


@pytest.fixture(scope="module")
def training_text(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "corpus"
    prepare_corpus(
        {
            "source": "builtin",
            "max_bytes": 1_000_000,
            "calibration_fraction": 0.2,
            "evaluation_fraction": 0.2,
        },
        corpus,
    )
    return corpus / "train.txt"


@pytest.fixture(scope="module")
def tokenizer_dir(training_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer(training_text, out, VOCAB_SIZE)
    return out


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_code_round_trips_with_the_same_ids_as_sentencepiece(tokenizer_dir, name):
    sample = SAMPLES[name]
    check_roundtrip(tokenizer_dir, [sample])
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = hf.encode(sample, add_special_tokens=False)
    assert hf.decode(ids) == sample
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    assert ids == sp.encode(sample)


def test_whole_training_text_round_trips(tokenizer_dir, training_text):
    check_roundtrip(tokenizer_dir, [training_text.read_text()[:100_000]])


def test_saved_folder_keeps_llama_conventions_without_a_prefix_space(tokenizer_dir):
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in tokenizer_dir.iterdir()
    }
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["add_prefix_space"] is False and config["add_bos_token"] is True
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.vocab_size()) == (
        UNK_ID,
        BOS_ID,
        EOS_ID,
        VOCAB_SIZE,
    )
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert (hf.unk_token_id, hf.bos_token_id, hf.eos_token_id, len(hf)) == (
        UNK_ID,
        BOS_ID,
        EOS_ID,
        VOCAB_SIZE,
    )
    assert hf.encode("x = 1") == [BOS_ID] + sp.encode("x = 1")


def test_a_failing_sample_is_named(tokenizer_dir):
    # "▁" is sentencepiece's own space marker, so it decodes as a space.
    with pytest.raises(ValueError, match="fails on sample 'x▁y': decodes to 'x y' instead"):
        check_roundtrip(tokenizer_dir, ["fine\n", "x▁y", "ok\n"])


def test_a_long_failing_sample_is_shortened(tokenizer_dir):
    with pytest.raises(ValueError, match=r"fails on sample 'aaaa+\.\.\. \(201 in all\)"):
        check_roundtrip(tokenizer_dir, ["a" * 200 + "▁"])


def test_training_is_deterministic(training_text, tokenizer_dir, tmp_path):
    train_tokenizer(training_text, tmp_path / "again", VOCAB_SIZE)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tokenizer_dir / name).read_bytes(), name


def test_too_small_a_vocabulary_is_refused(training_text, tmp_path):
    with pytest.raises(ValueError, match="vocab_size=300 is too small.*at least"):
        train_tokenizer(training_text, tmp_path / "t", 300)


def test_training_into_a_model_folder_keeps_its_other_files(training_text, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    train_tokenizer(training_text, tmp_path / "model", VOCAB_SIZE)
    assert (tmp_path / "model" / "config.json").read_text() == "{}"
    assert (tmp_path / "model" / "tokenizer.model").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "a temporary folder was left"
