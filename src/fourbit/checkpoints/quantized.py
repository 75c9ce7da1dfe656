"""Quantized checkpoints: Hugging Face folders whose linears (and maybe embedding) are packed.

A quantized module ``m`` stores its format's tensors as ``m.<suffix>`` (see
fourbit.formats; a 4-bit embedding table, fourbit.formats.table's) instead of
``m.weight``; everything else (norms, biases, and the input embedding unless the arm
quantizes it) stays dense. A quantized embedding
[V, H] is a matrix like any linear's [N, K], with N = V and K = H. config.json
carries the format's ``quantization_config``, which is how a reader finds the
format again.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fourbit.checkpoints.hf import (
    load_tensors,
    module_name,
    quantizable_linears,
    read_config,
    skeleton,
    weight_files,
    write_checkpoint,
)
from fourbit.formats import (
    INT4_EMBEDDING,
    INT8,
    INT8_EMBEDDING,
    INT8_MODULES,
    INT_BITS,
    WIDE_LAYOUTS,
    format_for_config,
    get_format,
    int4_embedding,
    table_layout,
    wide_bits,
)
from fourbit.quant.int8 import Int8Weight
from fourbit.quant.qweight import QuantizedWeight


def is_quantized(folder: str | os.PathLike) -> bool:
    return "quantization_config" in read_config(folder)


def write_quantized(
    folder: Path,
    source: str | os.PathLike,
    qweights: dict[str, QuantizedWeight],
    format_name: str,
    quant: dict,
) -> None:
    fmt = get_format(format_name)
    if not fmt.supports(quant["sym"]):
        raise ValueError(f"format {format_name} cannot store a {'sym' if quant['sym'] else 'asym'}metric grid")
    model = skeleton(source)
    head = module_name(model, model.get_output_embeddings())
    embedding = module_name(model, model.get_input_embeddings())
    tensors = load_tensors(source)
    wide = sorted(name for name, qweight in qweights.items() if isinstance(qweight, Int8Weight))
    four_bit = set(qweights) - set(wide)
    table = embedding if embedding in four_bit else None  # a 4-bit table, in table_layout(fmt)
    for name, qweight in qweights.items():
        del tensors[f"{name}.weight"]
        layout = (WIDE_LAYOUTS[qweight.bits] if name in wide
                  else table_layout(fmt) if name == table else fmt)
        for suffix, tensor in layout.pack(qweight).items():
            tensors[f"{name}.{suffix}"] = tensor
    config = read_config(source)
    config["quantization_config"] = fmt.quantization_config(
        quant["group_size"], quant["sym"], lm_head=head in four_bit,
        embedding=table is not None and fmt.marks_embedding,
    )
    if table is not None and not fmt.marks_embedding:
        config["quantization_config"][INT4_EMBEDDING] = table
    if wide:
        config["quantization_config"][INT8_MODULES] = wide
    narrower = {name: qweights[name].bits for name in wide if qweights[name].bits != INT8.bits}
    if narrower:
        config["quantization_config"][INT_BITS] = narrower
    if embedding in wide:  # for readers that see the table without its name (vLLM's Llama)
        bits = qweights[embedding].bits
        config["quantization_config"][INT8_EMBEDDING] = True if bits == INT8.bits else bits
    write_checkpoint(folder, tensors, config, copy_from=source)


def read_quantized(
    folder: str | os.PathLike,
) -> tuple[dict, dict[str, torch.Tensor], dict[str, QuantizedWeight | Int8Weight]]:
    """(config, dense tensors, the stored weight by module name) of a quantized checkpoint:
    a QuantizedWeight for each matrix in the checkpoint's format or in the 4-bit table
    layout (fourbit.formats.table), an Int8Weight for each one in a wide layout
    (fourbit.formats.int8)."""
    config = read_config(folder)
    if "quantization_config" not in config:
        raise ValueError(f"{folder}: config.json has no quantization_config; not a quantized checkpoint")
    fmt = format_for_config(config["quantization_config"])
    group_size = fmt.group_size_from_config(config["quantization_config"])
    tensors = load_tensors(folder)
    marker = f".{fmt.layout[0].suffix}"
    modules = sorted(name[: -len(marker)] for name in tensors if name.endswith(marker))
    if not modules and not wide_bits(config["quantization_config"]):  # mixed precision may move all
        raise ValueError(f"{folder}: {fmt.name} checkpoint without any '*{marker}' tensor")
    model = skeleton(folder)
    qweights = {}
    table = int4_embedding(config["quantization_config"])
    layouts = {**{name: fmt for name in modules},
               **{name: WIDE_LAYOUTS[bits]
                  for name, bits in wide_bits(config["quantization_config"]).items()},
               **({table: table_layout(fmt)} if table else {})}
    for name, layout in layouts.items():
        parts = {spec.suffix: tensors.pop(f"{name}.{spec.suffix}") for spec in layout.layout}
        qweights[name] = layout.unpack(parts, *matrix_shape(model.get_submodule(name)), group_size)
    return config, tensors, qweights


def matrix_shape(module: torch.nn.Module) -> tuple[int, int]:
    """(N, K) of the weight matrix a quantized module stores: a linear's (out, in), an
    embedding's (V, H)."""
    if isinstance(module, torch.nn.Linear):
        return module.out_features, module.in_features
    if isinstance(module, torch.nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    raise TypeError(f"{type(module).__name__} is neither a linear nor an embedding; not quantizable")


def storage_stats(folder: str | os.PathLike) -> dict:
    """Bits per weight from what is stored, not from a nominal 4.

    ``quantized_bits_per_weight``: every stored bit of the matrices the arm quantized
    (its linear layers, and the input embedding if it quantized that too; codes,
    scales, zeros and index tensors) over their weight count (``linear_weights``);
    for a dense checkpoint, the plain weights of the linears a quantizer would touch.
    ``matrix_bits_per_weight``: every weight matrix, however stored (each linear, the
    head included, quantized or dense, and the input embedding), over their weight count
    (``matrix_weights``): what a model's matrices cost whichever the arm quantized, so an
    arm that keeps its head or embedding dense pays for it here.
    ``file_bits_per_param``: every stored tensor over the model's parameter count
    (embeddings, norms and the untied head's copy included).
    """
    stored = load_tensors(folder)
    matrix_weights, matrix_bits = _matrix_storage(folder, stored)
    if is_quantized(folder):
        _, dense, qweights = read_quantized(folder)
        modules = set(qweights)
        weights = sum(q.codes.numel() for q in qweights.values())
        params = weights + sum(t.numel() for t in dense.values())
    else:
        modules = set(quantizable_linears(skeleton(folder)))
        weights = sum(stored[f"{name}.weight"].numel() for name in modules)
        params = sum(t.numel() for t in stored.values())
    linear_bits = sum(_bits(t) for name, t in stored.items() if name.rpartition(".")[0] in modules)
    size = sum(p.stat().st_size for p in weight_files(folder))
    return {
        "quantized_modules": len(modules) if is_quantized(folder) else 0,
        "linear_weights": weights,
        "quantized_bits_per_weight": linear_bits / weights,
        "matrix_weights": matrix_weights,
        "matrix_bits_per_weight": matrix_bits / matrix_weights,
        "file_bits_per_param": sum(_bits(t) for t in stored.values()) / params,
        "parameters": params,
        "size_bytes": size,
        "size_mib": size / 2**20,
    }


def _matrix_storage(folder, stored: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(weights, stored bits) of every weight matrix: the linears (head included) and the
    input embedding, each by the tensors stored under its name but its bias."""
    model = skeleton(folder)
    matrices = {name: matrix_shape(m) for name, m in quantizable_linears(model).items()}
    matrices[module_name(model, model.get_input_embeddings())] = matrix_shape(model.get_input_embeddings())
    bits = sum(_bits(t) for name, t in stored.items()
               if name.rpartition(".")[0] in matrices and not name.endswith(".bias"))
    return sum(n * k for n, k in matrices.values()), bits


def _bits(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size() * 8
