"""Text corpora for training, calibrating and evaluating, one kind per ``source``.

Every kind turns a spec (the workflow config's ``corpus`` block, whose
``source`` names the kind) into three lists of documents (train, calibration,
evaluation); fourbit.steps.prepare.prepare_corpus writes them as plain text plus a manifest
that says exactly what was taken, so a corpus can be checked and reproduced.

A new kind is a function ``spec -> Selection`` decorated with
``@register_corpus("name")``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fourbit import schema

log = logging.getLogger("fourbit")

SPLITS = ("train", "calibration", "evaluation")


@dataclass
class Document:
    name: str
    text: str


@dataclass
class Selection:
    """What a corpus kind chose: documents per split, a fingerprint, kind-specific facts."""

    splits: dict[str, list[Document]]
    sha256: str
    details: dict[str, Any] = field(default_factory=dict)


CORPUS_KINDS: dict[str, Callable[[dict], Selection]] = {}


def register_corpus(
    name: str,
) -> Callable[[Callable[[dict], Selection]], Callable[[dict], Selection]]:
    def register(make: Callable[[dict], Selection]) -> Callable[[dict], Selection]:
        if name in CORPUS_KINDS:
            raise ValueError(f"corpus kind {name!r} is registered twice; kind names must be unique")
        CORPUS_KINDS[name] = make
        return make

    return register


def select(spec: dict) -> Selection:
    """The documents of each split for ``spec``, none of them empty."""
    kind = spec.get("source")
    if kind not in CORPUS_KINDS:
        raise ValueError(
            f"unknown corpus source {kind!r}; the spec's 'source' must be one of "
            f"{sorted(CORPUS_KINDS)}"
        )
    selection = CORPUS_KINDS[kind](spec)
    _require_non_empty_splits(selection)
    return selection


def manifest(spec: dict, selection: Selection, split_texts: dict[str, str]) -> dict:
    """What was taken: the spec, the selection's hash, and each split's size and hash."""
    return {
        "kind": spec["source"],
        "spec": spec,
        "selection_sha256": selection.sha256,
        "splits": {
            split: {
                "bytes": len(text.encode("utf-8")),
                "documents": len(selection.splits[split]),
                "sha256": _sha256_text(text),
            }
            for split, text in split_texts.items()
        },
        **selection.details,
    }


def join_documents(documents: list[Document]) -> str:
    """Documents separated by exactly one blank line, the text ending in one newline."""
    return "\n\n".join(doc.text.rstrip("\n") for doc in documents) + "\n"


def _require_non_empty_splits(selection: Selection) -> None:
    sizes = {split: len(selection.splits.get(split, [])) for split in SPLITS}
    for split, count in sizes.items():
        if count == 0:
            raise ValueError(
                f"corpus split {split!r} came out empty (documents per split: {sizes}); "
                "every split needs at least one document: give more text or larger fractions"
            )


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _fingerprint(lines: list[str]) -> str:
    return _sha256_text("".join(line + "\n" for line in lines))


# --- builtin: the running Python's standard library ---------------------------------------

SKIPPED_STDLIB_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__"}


def _written_by_the_build(relpath: str) -> bool:
    """Files generated when Python was built: they hold that machine's paths and flags.

    Leaving them out keeps the corpus identical on every machine with the same Python.
    """
    return relpath.startswith("config-") or relpath.startswith("_sysconfigdata_")


@register_corpus("builtin")
def builtin_corpus(spec: dict) -> Selection:
    """Python's own standard-library sources: real text that ships with the pinned Python.

    The *.py files under the stdlib folder, except site-packages, test suites,
    idlelib, files that are not UTF-8 or hold only whitespace, and files the
    build generated, are taken in sorted order of their relative POSIX path
    until the next one would exceed ``max_bytes``. Each file is one document,
    so a file never straddles two splits; see :func:`_split_by_path_hash`.
    """
    options = schema.block("corpus", spec)
    # The schema keeps each fraction below 0.5, so train always keeps some text.
    calibration, evaluation = options["calibration_fraction"], options["evaluation_fraction"]
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = _take_until(_stdlib_sources(root), int(options["max_bytes"]))
    splits = _split_by_path_hash(documents, calibration, evaluation)
    return Selection(
        splits=splits,
        sha256=_fingerprint([f"{d.name}\t{_sha256_text(d.text)}" for d in documents]),
        details={
            "python_version": sys.version,
            "source_root": str(root),
            "files": {split: [d.name for d in docs] for split, docs in splits.items()},
        },
    )


def _stdlib_sources(root: Path) -> list[Document]:
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library folder {root} does not exist")
    documents = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        relpath = path.relative_to(root).as_posix()
        if SKIPPED_STDLIB_DIRS & set(relpath.split("/")[:-1]) or _written_by_the_build(relpath):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():  # empty __init__.py files are not text, just extra blank lines
            documents.append(Document(relpath, text))
    return documents


def _take_until(documents: list[Document], max_bytes: int) -> list[Document]:
    taken, total = [], 0
    for doc in documents:
        size = _size(doc)
        if total + size > max_bytes:
            break
        taken.append(doc)
        total += size
    return taken


def _split_by_path_hash(
    documents: list[Document], calibration: float, evaluation: float
) -> dict[str, list[Document]]:
    """Deal whole files, in the order of their paths' sha256, to evaluation then calibration.

    Each of the two takes files until it holds its fraction of the bytes
    (overshooting by at most one file); the rest is train. Filling by bytes
    rather than flipping a hash-weighted coin per file keeps small corpora of a
    few large files from leaving a split empty or a few bytes long. sha256, not
    hash(): Python salts str hashes per process.
    """
    total = sum(_size(doc) for doc in documents)
    queue = sorted(documents, key=lambda doc: hashlib.sha256(doc.name.encode("utf-8")).hexdigest())
    splits: dict[str, list[Document]] = {split: [] for split in SPLITS}
    for split, fraction in (("evaluation", evaluation), ("calibration", calibration)):
        while queue and sum(_size(doc) for doc in splits[split]) < fraction * total:
            splits[split].append(queue.pop(0))
    splits["train"] = queue
    # Within a split, path order: neighbouring modules read alike, as in the source tree.
    return {split: sorted(docs, key=lambda doc: doc.name) for split, docs in splits.items()}


def _size(doc: Document) -> int:
    return len(doc.text.encode("utf-8"))


# --- file: one local text file -------------------------------------------------------------


@register_corpus("file")
def file_corpus(spec: dict) -> Selection:
    """A local UTF-8 text file, cut into paragraphs at blank lines.

    The splits are contiguous blocks of paragraphs: the last
    ``evaluation_fraction`` of them is evaluation, the ``calibration_fraction``
    before that is calibration, the rest (the beginning) is train.
    """
    options = schema.block("corpus", spec)
    # The schema keeps each fraction below 0.5, so train always keeps some text.
    calibration, evaluation = options["calibration_fraction"], options["evaluation_fraction"]
    path = Path(options["path"])
    text = _read_utf8(path)
    paragraphs = split_paragraphs(text)
    splits = _contiguous_splits(paragraphs, calibration, evaluation)
    return Selection(
        splits={
            split: [Document(f"paragraph {i}", p) for i, p in block]
            for split, block in splits.items()
        },
        sha256=_sha256_text(text),
        details={
            "source": str(path),
            "paragraph_ranges": {
                split: [block[0][0], block[-1][0] + 1] if block else []
                for split, block in splits.items()
            },
        },
    )


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs separated by one or more blank (or whitespace-only) lines; indentation is kept."""
    return [p for p in re.split(r"\n(?:[ \t\r]*\n)+", text) if p.strip()]


def _contiguous_splits(
    paragraphs: list[str], calibration: float, evaluation: float
) -> dict[str, list[tuple[int, str]]]:
    numbered = list(enumerate(paragraphs))
    n = len(numbered)
    evaluation_start = n - round(n * evaluation)
    calibration_start = evaluation_start - round(n * calibration)
    return {
        "train": numbered[:calibration_start],
        "calibration": numbered[calibration_start:evaluation_start],
        "evaluation": numbered[evaluation_start:],
    }


def _read_utf8(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus file {path} does not exist; give the path of a UTF-8 text file"
        )
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"corpus file {path} is not valid UTF-8 ({error}); convert it to UTF-8"
        ) from error


# --- hf: files of a Hugging Face dataset repository at a pinned commit -------------------------


@register_corpus("hf")
def hf_corpus(spec: dict) -> Selection:
    """One file per split from a Hugging Face dataset repository, at a pinned commit.

    ``files`` maps each split to a file in the repository: plain text (cut into
    paragraphs at blank lines) or parquet with a ``text`` column (one document
    per row). Files come through ``huggingface_hub.hf_hub_download``, so the
    usual cache and HF_HUB_OFFLINE apply.
    """
    options = schema.block("corpus", spec)
    revision = options["revision"]
    files = options["files"]  # the schema requires exactly the three splits
    splits, fingerprint_lines = {}, []
    for split in SPLITS:
        path = _download(options["repo_id"], files[split], revision)
        splits[split] = _documents_of_file(path, files[split])
        fingerprint_lines.append(
            f"{split}\t{files[split]}\t{hashlib.sha256(path.read_bytes()).hexdigest()}"
        )
    return Selection(
        splits=splits,
        sha256=_fingerprint(fingerprint_lines),
        details={"repo_id": options["repo_id"], "revision": revision},
    )


def _download(repo_id: str, filename: str, revision: str) -> Path:
    from huggingface_hub import hf_hub_download  # only this kind needs it

    return Path(hf_hub_download(repo_id, filename, revision=revision, repo_type="dataset"))


def _documents_of_file(path: Path, filename: str) -> list[Document]:
    if filename.endswith(".parquet"):
        return [
            Document(f"{filename} row {i}", text) for i, text in enumerate(_parquet_texts(path))
        ]
    return [
        Document(f"{filename} paragraph {i}", p)
        for i, p in enumerate(split_paragraphs(_read_utf8(path)))
    ]


def _parquet_texts(path: Path) -> list[str]:
    if importlib.util.find_spec("pyarrow") is None:
        raise RuntimeError(
            f"reading the parquet file {path} needs pyarrow, which is not installed; "
            "add a pinned pyarrow to envs/requirements.txt (or use a plain-text file)"
        )
    import pandas as pd

    frame = pd.read_parquet(path)
    if "text" not in frame.columns:
        raise ValueError(
            f"parquet file {path} has no 'text' column; its columns are {list(frame.columns)}"
        )
    return [text for text in frame["text"].astype(str) if text.strip()]
