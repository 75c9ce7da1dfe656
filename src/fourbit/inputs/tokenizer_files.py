"""A model folder's tokenizer, checked before a job needs it: present, UTF-8 where it is
text, loadable, and no larger than the embedding.

Every engine tokenizes the evaluation text with the model's own tokenizer, which
transformers' AutoTokenizer loads from the folder (fourbit.steps.evaluate). It reads one
of: tokenizer.json (a "fast" tokenizer: the tokenizers library, no other package), or
tokenizer.model (a SentencePiece model, converted with sentencepiece), or vocab.json
with merges.txt (a GPT-2 style BPE); tokenizer_config.json and its siblings add special
tokens. Without any, transformers stops inside a job with "Couldn't instantiate the
backend tokenizer". The DAG-time check loads the same files with the tokenizers library
or sentencepiece (milliseconds to a second; transformers' import costs seconds and brings
torch), and a job's check adds AutoTokenizer itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from fourbit.inputs.weight_headers import FolderError

# The tokenizer's text files transformers may read; each must be UTF-8 (and JSON where so named).
TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
              "chat_template.json")
# Every tokenizer file transformers may read: what a tokenizer folder the study names
# (model.tokenizer) brings into the model's folder, in place of the model's own.
FILES = (*TEXT_FILES, "tokenizer.model")
RESAVE = ("save it again as UTF-8, e.g. AutoTokenizer.from_pretrained(<where it came from>)"
          ".save_pretrained(<this folder>), or copy it again from where the model came from")


def check_tokenizer(folder: Path, embedding_rows: int, *, load: bool = False,
                    named: bool = False) -> None:
    """FolderError naming the file unless ``folder`` holds a tokenizer that loads and whose
    ids all fall inside the embedding's ``embedding_rows`` rows; ``load``: also load it
    with transformers' AutoTokenizer (seconds of imports); ``named``: the folder is the
    one the study names in model.tokenizer, not the model's own."""
    texts = {name: _text(folder / name) for name in TEXT_FILES if (folder / name).is_file()}
    if "tokenizer.json" in texts:
        kind = "tokenizer.json"
        largest = _fast_largest_id(folder / kind, texts[kind])
    elif (folder / "tokenizer.model").is_file():
        kind, largest = "tokenizer.model", _sentencepiece_largest_id(folder / "tokenizer.model")
    elif "vocab.json" in texts and "merges.txt" in texts:
        vocab = json.loads(texts["vocab.json"])
        ids = vocab.values() if isinstance(vocab, dict) else []
        kind, largest = "vocab.json", max((i for i in ids if isinstance(i, int)), default=0)
    elif named:
        raise FolderError(
            f"{folder}: no tokenizer (neither tokenizer.json, nor tokenizer.model, nor vocab.json "
            "with merges.txt), yet model.tokenizer names it as the tokenizer to use: point "
            "model.tokenizer at the folder that holds the model's tokenizer files")
    else:
        raise FolderError(
            f"{folder}: no tokenizer (neither tokenizer.json, nor tokenizer.model, nor vocab.json "
            "with merges.txt); every engine tokenizes the evaluation text with the model's own "
            "tokenizer: copy its tokenizer files (tokenizer.json, tokenizer_config.json, "
            "special_tokens_map.json) from where the model came from into the folder, or name "
            "a folder that holds them in the study's model.tokenizer")
    largest = max([largest, *_added_ids(texts)])
    if largest >= embedding_rows:
        raise FolderError(
            f"{folder / kind}: the tokenizer's ids run up to {largest}, but the model's embedding "
            f"has {embedding_rows} rows (ids 0..{embedding_rows - 1}): ids {embedding_rows}.."
            f"{largest} would index past it; use the tokenizer that came with these weights")
    if load:
        _load_with_transformers(folder)


def _text(path: Path) -> str:
    """The file as UTF-8 text (and parsed, if JSON, to check it); FolderError naming it."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FolderError(
            f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start} is "
            f"not valid UTF-8); transformers reads tokenizer files as UTF-8: {RESAVE}") from None
    if path.suffix == ".json":
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            raise FolderError(f"{path}: not valid JSON ({error}); {RESAVE}") from None
    return text


def _fast_largest_id(path: Path, text: str) -> int:
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as error:  # noqa: BLE001 - the tokenizers library's parse errors
        raise FolderError(f"{path}: the tokenizers library cannot load it ({error}); "
                          f"{RESAVE}") from None
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=0)


def _sentencepiece_largest_id(path: Path) -> int:
    import sentencepiece

    try:
        processor = sentencepiece.SentencePieceProcessor(model_proto=path.read_bytes())
    except Exception as error:  # noqa: BLE001 - sentencepiece raises RuntimeError, OSError, ...
        raise FolderError(f"{path}: sentencepiece cannot load it ({error}); copy it again from "
                          "where the model came from") from None
    return processor.get_piece_size() - 1


def _added_ids(texts: dict[str, str]) -> list[int]:
    """Ids of the tokens tokenizer_config.json (added_tokens_decoder) and added_tokens.json
    add on top of the tokenizer's own vocabulary."""
    ids = []
    if "tokenizer_config.json" in texts:
        config = json.loads(texts["tokenizer_config.json"])
        decoder = config.get("added_tokens_decoder") if isinstance(config, dict) else None
        ids += [int(i) for i in decoder or {} if str(i).isdigit()]
    if "added_tokens.json" in texts:
        added = json.loads(texts["added_tokens.json"])
        values = added.values() if isinstance(added, dict) else []
        ids += [i for i in values if isinstance(i, int)]
    return ids


def _load_with_transformers(folder: Path) -> None:
    """AutoTokenizer.from_pretrained(folder), as fourbit.steps.evaluate loads it."""
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001 - whatever stops transformers stops the evaluation
        raise FolderError(
            f"{folder}: transformers' AutoTokenizer cannot load its tokenizer "
            f"({type(error).__name__}: {str(error)[:300]}); fix or replace the tokenizer files "
            "(tokenizer.json, tokenizer_config.json) with the ones the model came with") from None
