"""Hugging Face checkpoint folders: read, write, and find what to quantize.

A checkpoint is a folder with config.json, one or more *.safetensors files and
the tokenizer files. fourbit reads safetensors only: pickle weights can run
code when loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHT_SUFFIX = ".safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that fourbit cannot use, with what was expected instead."""


def read_config(folder: str | os.PathLike) -> dict:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG}; expected a Hugging Face model folder")
    return json.loads(path.read_text())


def weight_files(folder: str | os.PathLike) -> list[Path]:
    files = sorted(Path(folder).glob(f"*{WEIGHT_SUFFIX}"))
    if not files:
        pickles = sorted(p.name for p in Path(folder).glob("*.bin")) + sorted(
            p.name for p in Path(folder).glob("*.pt")
        )
        found = f" (found pickle weights {', '.join(pickles)}, which fourbit does not load)" if pickles else ""
        raise CheckpointError(
            f"{folder}: no *.safetensors weights{found}; convert with "
            "save_pretrained(..., safe_serialization=True)"
        )
    return files


def load_tensors(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def write_checkpoint(
    folder: Path, tensors: dict[str, torch.Tensor], config: dict, copy_from: str | os.PathLike
) -> None:
    """Write weights and config into ``folder``; copy every other file of ``copy_from``.

    ``folder`` is expected to be a temporary folder that the caller renames into
    place (fourbit.atomic), so a half-written checkpoint never looks finished.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for path in Path(copy_from).iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIX) and path.name not in (CONFIG, INDEX):
            shutil.copy2(path.resolve(), folder / path.name)
    # safetensors refuses tensors that share memory; every stored tensor is its own copy.
    contiguous = {name: t.contiguous().clone() if _shares_storage(t, tensors) else t.contiguous()
                  for name, t in tensors.items()}
    save_file(contiguous, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _shares_storage(tensor: torch.Tensor, tensors: dict[str, torch.Tensor]) -> bool:
    pointer = tensor.untyped_storage().data_ptr()
    return sum(t.untyped_storage().data_ptr() == pointer for t in tensors.values()) > 1


def skeleton(folder: str | os.PathLike) -> torch.nn.Module:
    """The model's module tree on the meta device: structure without weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except ValueError as error:
        raise CheckpointError(
            f"{folder}: {config.model_type!r} is not a decoder-only causal LM that transformers "
            f"knows ({error})"
        ) from error


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The stack of decoder blocks (model.model.layers in Llama-style models)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise CheckpointError(
            f"{type(model).__name__} has no decoder layer stack (expected model.layers, a "
            "ModuleList of blocks); fourbit handles decoder-only causal LMs"
        )
    return layers


def quantizable_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every nn.Linear inside the decoder layers, plus the output head.

    Keys are module names as they appear in the state dict (``<name>.weight``).
    """
    layers = decoder_layers(model)
    layer_ids = {id(m) for layer in layers for m in layer.modules()}
    linears = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and id(module) in layer_ids
    }
    if not linears:
        raise CheckpointError(
            f"{type(model).__name__}: its decoder layers contain no nn.Linear projections; "
            "fourbit quantizes linear layers"
        )
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    if not isinstance(head, torch.nn.Linear) or head_name is None:
        raise CheckpointError(f"{type(model).__name__} has no linear output head (get_output_embeddings)")
    linears[head_name] = head
    return linears


def module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


class TensorReader:
    """Read single tensors from a checkpoint's safetensors files on demand.

    Quantizing one layer at a time should not need the whole model in memory.
    """

    def __init__(self, folder: str | os.PathLike):
        self._files = {}
        for path in weight_files(folder):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    self._files[name] = path

    def names(self) -> list[str]:
        return sorted(self._files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint")
        with safe_open(str(self._files[name]), framework="pt") as handle:
            return handle.get_tensor(name)
