"""The base of every on-disk format: the Layout of one matrix (its table, whose rows are
fourbit.layouts.TensorSpec, plus pack/unpack) and the Format of a checkpoint built on
it, the registry, and the nibble packing the formats share."""

from __future__ import annotations

import abc
import sys
from collections.abc import Mapping
from typing import Any

import torch

from fourbit.layouts import TensorSpec
from fourbit.quant.qweight import QuantizedWeight


def stored_dtype(spec: TensorSpec, scale_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a row's tensor is stored in: its own, or ``scale_dtype`` for scales."""
    return scale_dtype if spec.dtype is None else getattr(torch, spec.dtype)


class Layout(abc.ABC):
    """How one matrix is stored: ``layout`` (the table) plus pack/unpack."""

    name: str
    layout: tuple[TensorSpec, ...]

    @abc.abstractmethod
    def pack(self, qw: Any) -> dict[str, torch.Tensor]:
        """The in-memory weight -> {suffix: tensor}, exactly the tensors of ``layout``."""

    @abc.abstractmethod
    def unpack(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_features: int,
        in_features: int,
        group_size: int,
    ) -> Any:
        """The exact inverse of ``pack``."""

    def shapes(
        self, out_features: int, in_features: int, group_size: int
    ) -> dict[str, tuple[int, ...]]:
        return {t.suffix: t.dims(out_features, in_features, group_size) for t in self.layout}

    def stored_bits(
        self,
        out_features: int,
        in_features: int,
        group_size: int,
        scale_dtype: torch.dtype = torch.float16,
    ) -> int:
        """Bits the checkpoint stores for one N x K layer, summed over the layout table."""
        total = 0
        for spec in self.layout:
            numel = 1
            for d in spec.dims(out_features, in_features, group_size):
                numel *= d
            dtype = stored_dtype(spec, scale_dtype)
            total += numel * torch.empty((), dtype=dtype).element_size() * 8
        return total

    def checked(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_features: int,
        in_features: int,
        group_size: int,
    ) -> dict[str, torch.Tensor]:
        """The layout's tensors from ``tensors``, each verified against the table."""
        want = self.shapes(out_features, in_features, group_size)
        out = {}
        for spec in self.layout:
            if spec.suffix not in tensors:
                raise ValueError(
                    f"{self.name}: missing tensor {spec.suffix!r} (have {sorted(tensors)})"
                )
            t = tensors[spec.suffix]
            if tuple(t.shape) != want[spec.suffix]:
                raise ValueError(
                    f"{self.name}: {spec.suffix} has shape {tuple(t.shape)}, expected "
                    f"{want[spec.suffix]} = [{', '.join(spec.shape)}] for N={out_features} "
                    f"K={in_features} G={group_size}"
                )
            expected = None if spec.dtype is None else getattr(torch, spec.dtype)
            if not (t.dtype.is_floating_point if expected is None else t.dtype == expected):
                raise ValueError(
                    f"{self.name}: {spec.suffix} has dtype {t.dtype}, "
                    f"expected {expected or 'a float dtype'}"
                )
            out[spec.suffix] = t
        return out


class Format(Layout):
    """An on-disk checkpoint format: a Layout for every quantized matrix, plus the
    config.json quantization_config that names it and that its readers find it by."""

    # Whether its quantization_config can say that the input embedding is stored in its
    # layout; the others keep a 4-bit table in fourbit.formats.table's.
    marks_embedding = False

    @abc.abstractmethod
    def quantization_config(
        self, group_size: int, sym: bool, *, lm_head: bool = False, embedding: bool = False
    ) -> dict[str, Any]:
        """config.json["quantization_config"] for a checkpoint in this format.

        ``embedding``: the input embedding table is stored quantized too; a format whose
        ecosystem has no way to say so (its loaders would read a table that is not there)
        raises ValueError.
        """

    @abc.abstractmethod
    def reads_config(self, cfg: Mapping[str, Any]) -> bool:
        """True if a checkpoint with this quantization_config is stored in this format."""

    @abc.abstractmethod
    def group_size_from_config(self, cfg: Mapping[str, Any]) -> int:
        """The G that ``unpack`` needs, read from a quantization_config this format reads."""

    def supports(self, sym: bool) -> bool:
        """Whether the format (as its loader reads it) can express this kind of grid."""
        return True


FORMATS: dict[str, Format] = {}


def register_format(cls: type[Format]) -> type[Format]:
    """Class decorator: instantiate the format and file it under ``cls.name``."""
    if cls.name in FORMATS:
        raise ValueError(f"format {cls.name!r} is already registered")
    FORMATS[cls.name] = cls()
    return cls


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise KeyError(f"unknown format {name!r}; known formats: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]


def format_for_config(quantization_config: Mapping[str, Any]) -> Format:
    """The one registered format that reads this config.json quantization_config."""
    readers = [f for f in FORMATS.values() if f.reads_config(quantization_config)]
    if len(readers) != 1:
        found = ", ".join(f.name for f in readers) or "none"
        raise ValueError(
            f"quantization_config with quant_method={quantization_config.get('quant_method')!r} "
            f"is read by {found}; exactly one expected "
            f"(known formats: {', '.join(sorted(FORMATS))})"
        )
    return readers[0]


def refuse_quantized_embedding(format_name: str, embedding: bool) -> None:
    if embedding:
        raise ValueError(
            f"format {format_name} cannot mark a quantized input embedding (its loaders expect "
            "a dense table); store the table in fourbit.formats.table's layout beside it"
        )


def check_nibbles(qw: QuantizedWeight) -> None:
    """Codes and zeros must fit in 4 bits before any format packs them."""
    for name in ("codes", "zeros"):
        t = getattr(qw, name)
        if t.numel() and int(t.max()) > 15:
            raise ValueError(f"{name} hold {int(t.max())}; 4-bit formats store 0..15")


def pack_nibbles_int32(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 values 0..15 -> int32, 8 per word along ``dim``.

    Element 8*j + i along ``dim`` goes to bits 4i..4i+3 of word j (element 8j in the
    lowest nibble). A word whose top nibble is >= 8 is negative as an int32; the bit
    pattern is what counts. On a little-endian host byte b of word j is bits 8b..8b+7,
    i.e. elements 8j + 2b (low nibble) and 8j + 2b + 1 (high), so the words are built
    as bytes: one byte per two elements, where shifting into int64 words took 16.
    """
    _require_little_endian()
    moved = codes.movedim(dim, -1).to(torch.uint8)  # packed dim last: [..., L]
    pairs = moved.reshape(*moved.shape[:-1], -1, 2)  # [..., L] -> [..., L/2, 2]
    packed_bytes = pairs[..., 0] | (pairs[..., 1] << 4)  # -> [..., L/2]
    words = packed_bytes.contiguous().view(torch.int32)  # [..., L/2] -> [..., L/8]; L % 8 == 0
    return words.movedim(-1, dim).contiguous()  # packed dim back in place


def unpack_nibbles_int32(words: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of ``pack_nibbles_int32``: int32 words -> uint8 values 0..15 along ``dim``.

    Read as bytes (see there), so a loader decoding a large matrix (a 150k-row head)
    holds 2 bytes per weight at most instead of the 8 of shifting int32 words.
    """
    _require_little_endian()
    moved = words.movedim(dim, -1).contiguous()  # packed dim last: [..., L/8]
    packed_bytes = moved.view(torch.uint8)  # [..., L/8] -> [..., L/2]
    pairs = torch.stack([packed_bytes & 0xF, packed_bytes >> 4], dim=-1)  # -> [..., L/2, 2]
    flat = pairs.reshape(*moved.shape[:-1], -1)  # [..., L/2, 2] -> [..., L]
    return flat.movedim(-1, dim).contiguous()  # packed dim back in place


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError(
            f"the int32 nibble packing reads words as bytes in little-endian order; this host "
            f"is {sys.byteorder}-endian (every x86-64 and common arm64 host is little-endian)"
        )
