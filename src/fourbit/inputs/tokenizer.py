"""A SentencePiece tokenizer that reproduces code exactly, saved in Hugging Face format.

Three tokenizers must agree on every id: sentencepiece itself (used for
training), transformers' AutoTokenizer (used for evaluation) and llama.cpp's
SPM tokenizer (fed by convert_hf_to_gguf.py from tokenizer.model). Choices that
make them agree:

- BPE, not unigram: llama.cpp's SPM tokenizer merges symbol pairs by piece
  score, which is exactly sentencepiece BPE; for a unigram model it would
  differ from sentencepiece's Viterbi segmentation. transformers also turns the
  model into a BPE tokenizers model.
- identity normalisation, no extra-whitespace removal, no dummy prefix: the
  defaults fold whitespace and prepend a space, which destroys indentation and
  makes ids differ between the three.
- byte fallback instead of user-defined symbols for "\\n", tabs and
  indentation runs: sentencepiece reads its training file one line per
  sentence, so no learned piece ever contains "\\n" and a user-defined "\\n"
  saves nothing over the byte piece <0x0A>; multi-character symbols such as
  "\\n" + 4 spaces would be matched by sentencepiece after it escapes spaces to
  "▁" but by transformers and llama.cpp on the raw text, so ids would diverge.
  Runs of spaces become learned whitespace-only pieces instead
  (allow_whitespace_only_pieces).
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger("fourbit")

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2  # Llama's conventions
# sentencepiece reserves one piece per byte plus the three specials; the rest is learned.
MIN_VOCAB_SIZE = 256 + 3 + 64
# Cap on training lines, so memory stays bounded for big corpora. The first
# lines are taken, not a shuffled sample: sentencepiece's shuffle draws from the
# C++ standard library, whose distributions differ between platforms.
MAX_TRAINING_LINES = 2_000_000

# Checked after every training: the whitespace and characters code depends on.
CODE_SAMPLES = [
    "def f(x):\n    if x:\n        return x\n    return None\n",
    "class A:\n\tdef g(self):\n\t\treturn 1\n",
    "a = 1\n\n\n\nb = 2\n",
    "x  =   3    # spaced   out  \n",
    "    leading indentation",
    "trailing spaces   \n   \n",
    "naïve café ∑ π ✓ 日本語 😀\n",
    "0123456789 3.14159 1e-10 0xFF\n",
    "crlf line\r\nnext\r\n",
    "\n",
    " ",
]


def train_tokenizer(train_text: Path, out_dir: Path, vocab_size: int, seed: int = 0) -> None:
    """Train a BPE SentencePiece model on ``train_text`` and save it as a Hugging Face tokenizer.

    Adds tokenizer.model (read by llama.cpp's converter), tokenizer.json and
    tokenizer_config.json (read by AutoTokenizer) to ``out_dir``, keeping any
    other files there, so a model folder being built can receive them. The
    files are built and checked in a temporary folder first and each lands
    atomically. The same text, vocab_size and seed give the same files.
    """
    train_text, out_dir = Path(train_text), Path(out_dir)
    if not train_text.is_file():
        raise FileNotFoundError(f"tokenizer training text {train_text} does not exist")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: 259 ids go to bytes and specials, "
            f"so it must be at least {MIN_VOCAB_SIZE}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.tokenizer-", dir=out_dir.parent) as temp:
        built = Path(temp)
        (built / "tokenizer.model").write_bytes(_train_sentencepiece(train_text, vocab_size, seed))
        _save_hugging_face_files(built)
        check_roundtrip(built, CODE_SAMPLES)
        for file in sorted(built.iterdir()):
            os.replace(file, out_dir / file.name)
    log.info("tokenizer: %d pieces trained on %s, saved to %s", vocab_size, train_text, out_dir)


def _train_sentencepiece(train_text: Path, vocab_size: int, seed: int) -> bytes:
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(train_text),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=-1,
        num_threads=1,
        input_sentence_size=MAX_TRAINING_LINES,
        shuffle_input_sentence=False,
        minloglevel=2,  # its per-iteration lines would drown the rule's log
    )
    return model.getvalue()


def _save_hugging_face_files(folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json next to tokenizer.model.

    transformers converts the sentencepiece model (this needs protobuf). Without
    add_prefix_space=False it would prepend "▁" like the legacy Llama
    tokenizer; llama.cpp's converter also reads add_prefix_space from
    tokenizer_config.json, and add_bos_token, which transformers 5 leaves out.
    """
    from transformers import LlamaTokenizer

    tokenizer = LlamaTokenizer.from_pretrained(
        folder, add_prefix_space=False, legacy=False, add_bos_token=True, add_eos_token=False
    )
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(add_prefix_space=False, add_bos_token=True, add_eos_token=False)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def check_roundtrip(tokenizer_dir: Path, samples: list[str]) -> None:
    """Raise ValueError naming the first sample the saved tokenizer does not reproduce.

    For each sample, AutoTokenizer's ids (without special tokens) must be
    non-empty for non-empty text, equal sentencepiece's own ids, and decode back
    to the sample exactly.
    """
    import sentencepiece as spm
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    for sample in samples:
        problem = _roundtrip_problem(hf, sp, sample)
        if problem:
            raise ValueError(
                f"tokenizer in {tokenizer_dir} fails on sample {_shorten(sample)}: {problem}"
            )


def _roundtrip_problem(hf, sp, sample: str) -> str | None:
    ids = hf.encode(sample, add_special_tokens=False)
    if sample and not ids:
        return "transformers encodes it to no ids (was tokenizer.json written without protobuf?)"
    sp_ids = sp.encode(sample)
    if ids != sp_ids:
        return f"transformers ids {_shorten(ids)} differ from sentencepiece ids {_shorten(sp_ids)}"
    decoded = hf.decode(ids)
    if decoded != sample:
        return f"decodes to {_shorten(decoded)} instead"
    return None


def _shorten(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(value)} in all)"
