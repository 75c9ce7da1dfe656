"""The 4-bit table: an input embedding an arm keeps on its 4-bit grid
(``quantize_embedding: true``), inside a checkpoint of any of the 4-bit formats.

A lookup gathers whole rows, one per token, so the table is stored in the layout that
keeps each row's codes, scales and zeros in that row: cpu_int4's
(fourbit.layouts.TABLE_LAYOUT). A cpu_int4 checkpoint marks the table in its own
quantization_config ("embedding": true). GPTQ and compressed-tensors cannot: their loaders
expect a dense table, and their layouts pack across rows (GPTQ's codes along K, transposed;
compressed-tensors' zero points along N). Their checkpoints store the table in cpu_int4's
layout beside their own matrices, and their quantization_config names it under
INT4_EMBEDDING, as the 8-bit layout's modules are named (fourbit.formats.int8). Ecosystems
that read only the format itself (vLLM's own GPTQ kernel) do not know it, so such an arm
is not given to them.
"""

from __future__ import annotations

from collections.abc import Mapping

from fourbit.formats.base import FORMATS, Format
from fourbit.layouts import TABLE_LAYOUT

INT4_EMBEDDING = "fourbit_int4_embedding"  # quantization_config key: the table's module name


def table_layout(fmt: Format) -> Format:
    """The layout a checkpoint of format ``fmt`` stores a 4-bit embedding table in."""
    return fmt if fmt.marks_embedding else FORMATS[TABLE_LAYOUT]


def int4_embedding(quantization_config: Mapping) -> str | None:
    """The module a checkpoint stores as a 4-bit table beside its format's matrices, if any."""
    return quantization_config.get(INT4_EMBEDDING)
