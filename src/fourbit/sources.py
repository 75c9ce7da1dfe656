"""Where a study's model comes from: one fetcher per ``model.source``.

Each fetcher fills a temporary folder with a Hugging Face model (config.json,
*.safetensors, tokenizer files); ``fetch_model`` renames it into place and adds
``fourbit-source.json`` with the content hash of every weight file.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from fourbit.atomic import atomic_dir
from fourbit.checkpoint import CheckpointError, read_config, weight_files
from fourbit.hashing import file_sha256

log = logging.getLogger("fourbit")
ARCHITECTURES = Path(__file__).parent / "architectures"
MANIFEST = "fourbit-source.json"

Fetcher = Callable[[dict, Path, Path, int], None]
SOURCES: dict[str, Fetcher] = {}


def register_source(name: str) -> Callable[[Fetcher], Fetcher]:
    def add(fetcher: Fetcher) -> Fetcher:
        SOURCES[name] = fetcher
        return fetcher

    return add


def fetch_model(spec: dict, target: str | os.PathLike, corpus_dir: str | os.PathLike, threads: int) -> None:
    source = spec["source"]
    if source not in SOURCES:
        raise ValueError(f"model.source {source!r} is not known; allowed: {', '.join(sorted(SOURCES))}")
    with atomic_dir(target) as folder:
        SOURCES[source](spec, folder, Path(corpus_dir), threads)
        weights = {p.name: file_sha256(p) for p in weight_files(folder)}
        manifest = {"spec": spec, "weights_sha256": weights}
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@register_source("builtin")
def _builtin(spec: dict, folder: Path, corpus_dir: Path, threads: int) -> None:
    from fourbit.builtin_model import DEFAULT_SPEC, TINY_SPEC, train_builtin_model

    presets = {"default": DEFAULT_SPEC, "tiny": TINY_SPEC}
    train_builtin_model(corpus_dir, folder, {**presets[spec["preset"]], **spec.get("train", {})})


@register_source("hf")
def _hugging_face(spec: dict, folder: Path, corpus_dir: Path, threads: int) -> None:
    from huggingface_hub import snapshot_download

    snapshot = Path(
        snapshot_download(
            spec["repo_id"],
            revision=spec["revision"],
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"],
        )
    )
    config = read_config(snapshot)
    if config.get("auto_map") and not spec.get("trust_remote_code", False):
        raise CheckpointError(
            f"{spec['repo_id']}@{spec['revision']} needs remote code (auto_map in config.json); "
            "set model.trust_remote_code: true if you trust it"
        )
    _link_folder(snapshot, folder)


@register_source("path")
def _local_path(spec: dict, folder: Path, corpus_dir: Path, threads: int) -> None:
    _link_folder(Path(spec["path"]), folder)


@register_source("synthetic")
def _synthetic(spec: dict, folder: Path, corpus_dir: Path, threads: int) -> None:
    """Random weights at a real architecture's shapes: for speed, not quality."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fourbit.tokenizer import train_tokenizer

    architecture = spec["architecture"]
    shipped = ARCHITECTURES / f"{architecture}.json"
    config_path = shipped if shipped.is_file() else Path(architecture)
    if not config_path.is_file():
        known = ", ".join(sorted(p.stem for p in ARCHITECTURES.glob("*.json")))
        raise ValueError(f"model.architecture {architecture!r}: not a shipped name ({known}) nor a config.json path")
    config = AutoConfig.from_pretrained(config_path)
    config.torch_dtype = "float32"
    torch.manual_seed(spec.get("seed", 0))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    # A real tokenizer so every engine tokenizes the evaluation text; its ids
    # (a few thousand) all fall inside the architecture's vocabulary.
    train_tokenizer(corpus_dir / "train.txt", folder, vocab_size=4096)


def _link_folder(source: Path, folder: Path) -> None:
    """Link a model folder's files instead of copying gigabytes."""
    weight_files(source)  # fails early, naming the folder, when there are no safetensors
    for path in source.iterdir():
        if path.is_file():
            os.symlink(path.resolve(), folder / path.name)
