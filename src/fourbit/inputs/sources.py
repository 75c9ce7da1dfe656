"""Where a study's model comes from: one fetcher per ``model.source``.

Each source registers two things: a fetcher, which fills a temporary folder with a
Hugging Face model (config.json, *.safetensors, tokenizer files) that the download
step (fourbit.steps.prepare.fetch_model) renames into place, adding ``fourbit-source.json`` with the content hash of every
weight file; and a config reader, which gives the model's config.json before any job
runs (``model_config``), so the workflow checks every arm's shapes against the model
while it builds the DAG. Config readers import neither torch nor transformers. A source
whose model is a folder before any job (``path``) also names it (``folder``), and the
DAG's build checks that folder whole (``check_local_folder``, fourbit.inputs.model_folder).

``model.tokenizer`` (``path`` and ``hf``) names a local folder whose tokenizer files take
the place of the model's own in the folder the download job writes, so every later step
reads it as the model's tokenizer. The DAG's build checks it like the model's own, and
the model id holds its files' hashes (fourbit.config.model_identity).

The local folders (the model's, the tokenizer's) are recorded as the DAG's build finds
them, and compared with that record before a job uses them (fourbit.inputs.folder_state).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fourbit.hashing import file_sha256, model_weights_sha256
from fourbit.inputs import model_folder, tokenizer_files
from fourbit.inputs.weight_headers import FolderError

log = logging.getLogger("fourbit")
ARCHITECTURES = Path(__file__).parent / "architectures"
MANIFEST = "fourbit-source.json"



def source_weights_sha256(source_dir: str | os.PathLike) -> str:
    """The sha256 of the source model's weights (fourbit.hashing.model_weights_sha256) that
    every record made from the model carries, from the download job's folder."""
    return model_weights_sha256(Path(source_dir) / MANIFEST)


Fetcher = Callable[[dict, Path, Path, int], None]
# (spec, folder the download job writes, which may already exist) -> config.json as a dict
ConfigReader = Callable[[dict, Path], dict]
# (spec, that folder) -> a folder with the model's own tokenizer files before any job, or
# None when there is none yet or the workflow makes the tokenizer itself
TokenizerFinder = Callable[[dict, Path], "Path | None"]
# spec -> the model's own folder before any job (a local path), which the DAG's build
# checks whole (fourbit.inputs.model_folder); None: the download job makes the folder
FolderFinder = Callable[[dict], "Path | None"]


@dataclass(frozen=True)
class Source:
    fetch: Fetcher
    config: ConfigReader
    tokenizer: TokenizerFinder = lambda spec, source_dir: None  # noqa: E731
    folder: FolderFinder = lambda spec: None  # noqa: E731


SOURCES: dict[str, Source] = {}


def register_source(
    name: str, *, config: ConfigReader, tokenizer: TokenizerFinder | None = None,
    folder: FolderFinder | None = None,
) -> Callable[[Fetcher], Fetcher]:
    def add(fetcher: Fetcher) -> Fetcher:
        extra = {"tokenizer": tokenizer, "folder": folder}
        SOURCES[name] = Source(fetcher, config, **{k: v for k, v in extra.items() if v})
        return fetcher

    return add


def source_of(spec: dict) -> Source:
    """The registered source ``spec['source']`` names."""
    if spec["source"] not in SOURCES:
        raise ValueError(f"model.source {spec['source']!r} is not known; allowed: {', '.join(sorted(SOURCES))}")
    return SOURCES[spec["source"]]


def model_config(spec: dict, source_dir: str | os.PathLike) -> dict:
    """The config.json the download job's model will have, without running it.

    ``source_dir`` is where that job writes the model (results/<model id>/source); a
    reader uses it when the model is already there. Raises ValueError naming what is
    wrong (an unknown architecture, a folder without config.json, a Hub revision that
    cannot be read)."""
    return source_of(spec).config(spec, Path(source_dir))


def tokenizer_folder(spec: dict, source_dir: str | os.PathLike) -> Path | None:
    """A folder holding the model's tokenizer files before any job (the one model.tokenizer
    names, else the model's own), for checks such as llama.cpp's converter's; None when
    there is none to check yet."""
    return named_tokenizer(spec) or source_of(spec).tokenizer(spec, Path(source_dir))


def named_tokenizer(spec: dict) -> Path | None:
    """The folder model.tokenizer names, or None; FolderError unless it is a folder."""
    if not spec.get("tokenizer"):
        return None
    folder = Path(spec["tokenizer"])
    if not folder.is_dir():
        raise FolderError(f"model.tokenizer: {folder} is not a folder; name the folder that holds "
                          "the tokenizer's files (tokenizer.json or tokenizer.model, "
                          "tokenizer_config.json)")
    return folder


def tokenizer_identity(spec: dict) -> dict | None:
    """What the model id holds of model.tokenizer: its folder and the sha256 of each of
    its tokenizer files (a few megabytes); None when the study names no tokenizer."""
    folder = named_tokenizer(spec)
    if folder is None:
        return None
    return {"path": str(folder.resolve()),
            "sha256": {name: file_sha256(folder / name) for name in tokenizer_names(folder)}}


def check_local_folder(spec: dict, config: dict) -> None:
    """The checks of fourbit.inputs.model_folder on the model's own folder, where there is
    one before any job (a ``path`` source), and on the tokenizer folder the study names
    (against config.json's vocab_size where the weights are not here yet); FolderError (a
    ConfigError) naming the file."""
    folder = source_of(spec).folder(spec)
    tokenizer = named_tokenizer(spec)
    if folder is not None:
        model_folder.check_folder(folder, config, tokenizer=tokenizer)
    elif tokenizer is not None:
        tokenizer_files.check_tokenizer(tokenizer, config["vocab_size"], named=True)


def linked_files(folder: Path, spec: dict) -> list[str]:
    """The files of ``folder`` (a model's own) that the download job links: every file at
    its top level, but for its tokenizer files where model.tokenizer names others."""
    names = sorted(p.name for p in Path(folder).iterdir() if p.is_file())
    if spec.get("tokenizer"):
        names = [name for name in names if name not in tokenizer_files.FILES]
    return names


def tokenizer_names(folder: Path) -> list[str]:
    """The tokenizer files ``folder`` has (fourbit.inputs.tokenizer_files.FILES)."""
    return [name for name in tokenizer_files.FILES if (folder / name).is_file()]


def _builtin_spec(spec: dict) -> dict:
    from fourbit.inputs.builtin_model import DEFAULT_SPEC, TINY_SPEC

    presets = {"default": DEFAULT_SPEC, "tiny": TINY_SPEC}
    return {**presets[spec["preset"]], **spec.get("train", {})}


def _builtin_config(spec: dict, source_dir: Path) -> dict:
    """The LlamaConfig fourbit.inputs.builtin_model._new_model builds, as config.json has it
    (tests/test_sources.py compares the two)."""
    from fourbit.inputs.builtin_model import resolve_spec

    try:
        resolved = resolve_spec(_builtin_spec(spec))
    except ValueError as error:
        raise ValueError(f"model.train: {error}") from None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": resolved["vocab_size"],
        "hidden_size": resolved["hidden_size"],
        "intermediate_size": resolved["intermediate_size"],
        "num_hidden_layers": resolved["num_layers"],
        "num_attention_heads": resolved["num_heads"],
        "num_key_value_heads": resolved["num_kv_heads"],
        "head_dim": resolved["hidden_size"] // resolved["num_heads"],
        "max_position_embeddings": resolved["seq_len"],
        "tie_word_embeddings": True,
    }


@register_source("builtin", config=_builtin_config)
def _builtin(spec: dict, folder: Path, corpus_dir: Path, threads: int) -> None:
    from fourbit.inputs.builtin_model import train_builtin_model

    train_builtin_model(corpus_dir, folder, _builtin_spec(spec))


def _hub_config(spec: dict, source_dir: Path) -> dict:
    """The pinned revision's config.json: from the finished download if there is one,
    else from the Hub (one small file, kept in the Hub cache that the download job
    then reuses; with a commit hash an already cached file is read without the
    network). The download job needs the Hub anyway, so failing here loses nothing."""
    if (source_dir / "config.json").is_file():
        return _read_config(source_dir)
    from huggingface_hub import hf_hub_download

    where = f"{spec['repo_id']}@{spec['revision']}"
    try:
        path = hf_hub_download(spec["repo_id"], "config.json", revision=spec["revision"])
    except Exception as error:  # noqa: BLE001 - offline, unknown repo or revision: all stop here
        raise ValueError(
            f"model: cannot read config.json of {where} before any job ({type(error).__name__}: "
            f"{error}); the study checks every arm against the model's shapes first"
        ) from None
    config = json.loads(Path(path).read_text())
    if config.get("auto_map") and not spec.get("trust_remote_code", False):
        raise ValueError(
            f"model: {where} needs remote code (auto_map in config.json); "
            "set model.trust_remote_code: true if you trust it"
        )
    return config


# What a tokenizer check reads: the tokenizer's own files, and config.json next to them.
HUB_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                       "special_tokens_map.json", "vocab.json", "merges.txt")


def _hub_tokenizer(spec: dict, source_dir: Path) -> Path | None:
    """The pinned revision's snapshot folder with its tokenizer files (small; fetched into
    the Hub cache the download job reuses), or None when it cannot be told which of them
    the repo has (offline, not cached): then the converter meets the tokenizer in its job."""
    if (source_dir / "config.json").is_file():
        return source_dir
    from huggingface_hub import _CACHED_NO_EXIST, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    repo, revision = spec["repo_id"], spec["revision"]
    folder = Path(hf_hub_download(repo, "config.json", revision=revision)).parent
    for name in HUB_TOKENIZER_FILES:
        try:
            hf_hub_download(repo, name, revision=revision)
        except RemoteEntryNotFoundError:
            continue  # the repo has no such file
        except LocalEntryNotFoundError:
            if try_to_load_from_cache(repo, name, revision=revision) is _CACHED_NO_EXIST:
                continue  # an earlier online look-up cached that the repo has no such file
            return None
    return folder


@register_source("hf", config=_hub_config, tokenizer=_hub_tokenizer)
def _hugging_face(spec: dict, folder: Path, corpus_dir: Path, threads: int) -> None:
    from huggingface_hub import snapshot_download

    from fourbit.checkpoints.hf import CheckpointError, read_config

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
    _link_folder(snapshot, folder, spec)


def _path_config(spec: dict, source_dir: Path) -> dict:
    return _read_config(Path(spec["path"]))


def _read_config(folder: Path) -> dict:
    """fourbit.checkpoints.hf.read_config's check, without importing torch."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json; expected a Hugging Face model folder")
    return json.loads(path.read_text())


@register_source("path", config=_path_config, tokenizer=lambda spec, source_dir: Path(spec["path"]),
                 folder=lambda spec: Path(spec["path"]))
def _local_path(spec: dict, folder: Path, corpus_dir: Path, threads: int) -> None:
    _link_folder(Path(spec["path"]), folder, spec)


def _architecture_file(spec: dict) -> Path:
    """A shipped architecture's config.json (src/fourbit/inputs/architectures/<name>.json), or
    the path the spec gives."""
    architecture = spec["architecture"]
    shipped = ARCHITECTURES / f"{architecture}.json"
    config_path = shipped if shipped.is_file() else Path(architecture)
    if not config_path.is_file():
        known = ", ".join(sorted(p.stem for p in ARCHITECTURES.glob("*.json")))
        raise ValueError(
            f"model.architecture {architecture!r}: not a shipped name ({known}) nor a path to a config.json"
        )
    return config_path


def _synthetic_config(spec: dict, source_dir: Path) -> dict:
    """The architecture's config.json, with ``layers`` decoder layers where the spec sets it."""
    config = json.loads(_architecture_file(spec).read_text())
    if spec["layers"] is not None:
        config["num_hidden_layers"] = spec["layers"]
        config.pop("layer_types", None)  # one entry per layer; transformers rebuilds it
        if "max_window_layers" in config:  # Qwen2: layers from this index use sliding windows
            config["max_window_layers"] = min(config["max_window_layers"], spec["layers"])
    return config


@register_source("synthetic", config=_synthetic_config)
def _synthetic(spec: dict, folder: Path, corpus_dir: Path, threads: int) -> None:
    """Random weights at a real architecture's shapes: for speed, not quality."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fourbit.inputs.tokenizer import train_tokenizer

    given = _synthetic_config(spec, folder)
    config = AutoConfig.for_model(given.pop("model_type"), **given)
    config.torch_dtype = "float32"
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    # A real tokenizer so every engine tokenizes the evaluation text; its ids
    # (a few thousand) all fall inside the architecture's vocabulary.
    train_tokenizer(corpus_dir / "train.txt", folder, vocab_size=4096)


def _link_folder(source: Path, folder: Path, spec: dict) -> None:
    """Link a model folder's files instead of copying gigabytes; where model.tokenizer
    names a tokenizer, its files in place of the model's own."""
    from fourbit.checkpoints.hf import weight_files

    weight_files(source)  # fails early, naming the folder, when there are no safetensors
    for name in linked_files(source, spec):
        os.symlink((source / name).resolve(), folder / name)
    tokenizer = named_tokenizer(spec)
    for name in tokenizer_names(tokenizer) if tokenizer else []:
        os.symlink((tokenizer / name).resolve(), folder / name)
