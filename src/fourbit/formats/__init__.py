"""On-disk 4-bit formats: each is a table plus a pair of functions.

A format states its layout as data (``layout``: which tensors, their shapes in
N, K, G, their dtypes and the arithmetic each one holds; the table itself is in
fourbit.layouts, which needs no torch, so the workflow's planner reads it too) and provides

    pack(qw: QuantizedWeight) -> {suffix: tensor}
    unpack(tensors, out_features, in_features, group_size) -> QuantizedWeight   # exact inverse

A checkpoint stores tensor ``suffix`` of module ``m`` under the key f"{m}.{suffix}".
Throughout, N = out_features (rows of nn.Linear.weight), K = in_features, G = group_size.

``quantization_config(...)`` is what goes into config.json["quantization_config"]
(it always carries that ecosystem's version marker), ``format_for_config`` finds the
format that reads a given one, ``stored_bits`` counts what the table says is stored,
so bits per weight come from the bytes on disk, not from a nominal "4".

Extend by registration: subclass ``Format``, decorate it with ``@register_format``, and
add its table to fourbit.layouts.LAYOUTS.
``INT8`` and the other WIDE_LAYOUTS (fourbit.formats.int8) are Layouts, not Formats: the
8-bit (or 5- and 6-bit) matrices an arm keeps inside a checkpoint of any format. A 4-bit
input embedding table is stored in cpu_int4's layout in every format (fourbit.formats.table).
"""

from fourbit.formats.base import (
    FORMATS,
    Format,
    Layout,
    check_nibbles,
    format_for_config,
    get_format,
    pack_nibbles_int32,
    refuse_quantized_embedding,
    register_format,
    stored_dtype,
    unpack_nibbles_int32,
)

# Importing each format registers it.
from fourbit.formats import compressed_tensors, cpu_int4, gptq  # noqa: E402, F401
from fourbit.formats.int8 import (  # noqa: E402
    INT8,
    INT8_EMBEDDING,
    INT8_MODULES,
    INT_BITS,
    WIDE_LAYOUTS,
    embedding_bits,
    int8_modules,
    wide_bits,
)
from fourbit.formats.table import INT4_EMBEDDING, int4_embedding, table_layout  # noqa: E402

__all__ = [
    "FORMATS",
    "Format",
    "INT4_EMBEDDING",
    "INT8",
    "INT8_EMBEDDING",
    "INT8_MODULES",
    "INT_BITS",
    "WIDE_LAYOUTS",
    "Layout",
    "check_nibbles",
    "embedding_bits",
    "format_for_config",
    "get_format",
    "int4_embedding",
    "int8_modules",
    "pack_nibbles_int32",
    "refuse_quantized_embedding",
    "register_format",
    "stored_dtype",
    "table_layout",
    "unpack_nibbles_int32",
    "wide_bits",
]
