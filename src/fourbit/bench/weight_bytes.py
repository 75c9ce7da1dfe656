"""Bytes of weights a checkpoint costs an engine: what one decode step reads, and what the
engine holds resident.

A decode step reads every matrix it multiplies by once per token, so its bytes over the
triad bandwidth bound the decode rate (fourbit.bench.bandwidth.decode_roofline); the
bytes an engine holds resident are what the memory plan of a bench job adds up
(fourbit.bench.memory_groups). Both are read from the files' headers: nothing is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from safetensors import safe_open

from fourbit.checkpoints.hf import quantizable_linears, skeleton, weight_files
from fourbit.formats.int8 import WIDE_LAYOUTS

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2,
                      "I8": 1, "U8": 1, "BOOL": 1}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FLOATING = ("F64", "F32", "BF16", "F16")


def decode_weight_bytes(checkpoint: str | os.PathLike, *, reads: str,
                        dense_dtype: str | None = None) -> dict:
    """Bytes of weights one decode step reads, for the kind of checkpoint the engine runs:
    ``reads`` is its EngineSpec's ("hf" or "gguf"), ``dense_dtype`` the dtype an "hf"
    engine casts dense weights to.

    Every matrix a decode step multiplies by (the head included) is read once per token;
    embeddings (one row per token), norms and biases are left out: together well under
    1% of the bytes.
    """
    if reads == "gguf":
        return gguf_weight_bytes(checkpoint)
    return linear_weight_bytes(checkpoint, dense_dtype)


def linear_weight_bytes(checkpoint: str | os.PathLike, dense_dtype: str) -> dict:
    """A Hugging Face folder's linear weights (the head included), as an engine reads them.

    A quantized module counts its stored tensors (packed codes, scales, zeros: the
    runtime's copy differs by a few percent in how scales and zeros are held), codes of a
    5- or 6-bit grid as the int8 codes the plugin unpacks them to; a dense one counts its
    weights in the engine's dtype, since the engine casts the checkpoint to that.
    """
    if dense_dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dense_dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    modules = set(quantizable_linears(skeleton(checkpoint)))
    quantized = dense = 0
    for path in weight_files(checkpoint):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                module, _, suffix = name.rpartition(".")
                if module not in modules or suffix == "bias":
                    continue
                piece = handle.get_slice(name)
                count = _elements(piece)
                if suffix == "weight":
                    dense += count * _DTYPE_BYTES[dense_dtype]
                else:
                    quantized += _held(suffix, count, piece.get_dtype())
    return {"bytes": quantized + dense, "quantized_bytes": quantized, "dense_bytes": dense,
            "dense_dtype": dense_dtype, "linear_modules": len(modules)}


def gguf_weight_bytes(checkpoint: str | os.PathLike) -> dict:
    """A GGUF file's matrix weights as stored (llama.cpp computes on its block formats)."""
    from fourbit.llamacpp.installed import find_llamacpp
    from fourbit.llamacpp.quantize import gguf_bits_per_weight

    tools = find_llamacpp()
    if tools is None:
        raise FileNotFoundError("llama.cpp is not built, so its gguf-py cannot read "
                                f"{checkpoint}; the build_llamacpp rule builds it")
    matmul = gguf_bits_per_weight(Path(checkpoint), tools.check_complete().gguf_py)["matmul_2d"]
    return {"bytes": matmul["bytes"], "tensors": matmul["tensors"], "weights": matmul["weights"]}


def resident_weight_bytes(checkpoint: str | os.PathLike, dense_dtype: str) -> int:
    """Every tensor of a Hugging Face folder as an engine holds it: dense weights and
    biases in the engine's dtype (the input embedding and the norms included), packed
    codes, scales and zeros as stored, except a linear's 5- or 6-bit codes, which the
    plugin holds as int8 (a table's stay packed: only looked-up rows are unpacked)."""
    linears = set(quantizable_linears(skeleton(checkpoint)))
    total = 0
    for path in weight_files(checkpoint):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                module, _, suffix = name.rpartition(".")
                piece = handle.get_slice(name)
                stored = piece.get_dtype()
                count = _elements(piece)
                if suffix in ("weight", "bias") and stored in _FLOATING:
                    total += count * _DTYPE_BYTES[dense_dtype]
                else:
                    total += (_held(suffix, count, stored) if module in linears
                              else count * _SAFETENSORS_BYTES[stored])
    return total


# a 5- or 6-bit grid's packed codes (fourbit.formats.int8) -> its bits per code
_PACKED_CODES = {layout.codes: bits for bits, layout in WIDE_LAYOUTS.items() if bits < 8}


def _held(suffix: str, count: int, stored: str) -> int:
    """Bytes a quantized linear's tensor takes in the plugin: as stored, or, for packed
    5- or 6-bit codes, one int8 per code."""
    if suffix in _PACKED_CODES:
        return count * 8 // _PACKED_CODES[suffix]
    return count * _SAFETENSORS_BYTES[stored]


def _elements(piece) -> int:
    """The number of elements of a safetensors slice, from its header's shape."""
    count = 1
    for size in piece.get_shape():
        count *= size
    return count
