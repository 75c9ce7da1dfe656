"""Each on-disk 4-bit format's layout table, as data that needs no torch: the tensors one
N x K matrix is stored as, their shapes in N, K and G = group_size, their dtypes by name
and the arithmetic each holds.

The formats (fourbit.formats) pack, unpack and count bits by these tables, and the
planner (fourbit.quantizers.shapes) checks every matrix of a model against the same
tables while the workflow builds its DAG, where importing torch would cost seconds. So
they live here, below both, not in the format modules: importing anything under
fourbit.formats imports torch. The wide layouts (fourbit.formats.int8: 8 bits, or 5
and 6) keep their tables beside their code, since they store any N x K and the planner
never asks them. llama.cpp's
types (GGUF_TYPES) are rows of one table: their layouts are ggml's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """One row of a layout table.

    ``shape`` is written in N, K, G with at most one division per dimension
    ("K/8", "K/G", "N", "2"); a division that does not come out even is a shape
    error naming the constraint. ``dtype`` is a torch dtype's name ("int32"); None means
    "the QuantizedWeight's scale dtype (float16 by default), stored unconverted".
    """

    suffix: str
    shape: tuple[str, ...]
    dtype: str | None
    holds: str  # the arithmetic, written out

    def dims(self, n: int, k: int, g: int) -> tuple[int, ...]:
        sizes = {"N": n, "K": k, "G": g}
        out = []
        for expr in self.shape:
            num, _, den = expr.partition("/")
            value = sizes[num] if num in sizes else int(num)
            if den:
                divisor = sizes[den] if den in sizes else int(den)
                if value % divisor:
                    what = f"group {divisor}" if den == "G" else str(divisor)
                    raise ValueError(
                        f"{self.suffix} [{', '.join(self.shape)}]: "
                        f"{num}={value} is not a multiple of {what}"
                    )
                value //= divisor
            out.append(value)
        return tuple(out)


# By format name (fourbit.formats.<name>, whose module doc draws the same table).
LAYOUTS: dict[str, tuple[TensorSpec, ...]] = {
    "cpu_int4": (
        TensorSpec(
            "qweight", ("N", "K/2"), "uint8", "byte (n, j) = codes[n, 2j] | codes[n, 2j+1] << 4"
        ),
        TensorSpec("scales", ("N", "K/G"), None, "scales[n, g]"),
        TensorSpec("zeros", ("N", "K/G"), "uint8", "zeros[n, g], integer 0..15"),
    ),
    "gptq": (
        TensorSpec(
            "qweight", ("K/8", "N"), "int32", "bits 4i..4i+3 of [j, n] = codes[n, 8j+i]"
        ),
        TensorSpec(
            "qzeros", ("K/G", "N/8"), "int32", "bits 4i..4i+3 of [g, j] = zeros[8j+i, g] - 1"
        ),
        TensorSpec("scales", ("K/G", "N"), None, "scales[g, n] = qw.scales[n, g]"),
        TensorSpec("g_idx", ("K",), "int32", "k // G"),
    ),
    "compressed_tensors": (
        TensorSpec(
            "weight_packed", ("N", "K/8"), "int32", "bits 4i..4i+3 of [n, j] = codes[n, 8j+i]"
        ),
        TensorSpec("weight_scale", ("N", "K/G"), None, "scales[n, g]"),
        TensorSpec(
            "weight_zero_point",
            ("N/8", "K/G"),
            "int32",
            "bits 4i..4i+3 of [j, g] = zeros[8j+i, g]",
        ),
        TensorSpec("weight_shape", ("2",), "int64", "(N, K)"),
    ),
}

# The layout a 4-bit input embedding table is stored in, whatever the checkpoint's format:
# a lookup gathers whole rows, and this one keeps each row's codes, scales and zeros in that
# row (fourbit.formats.table).
TABLE_LAYOUT = "cpu_int4"


@dataclass(frozen=True)
class GgufType:
    """One llama-quantize type a llama.cpp arm may name (config.schema.yaml's
    $defs.llamacpp_type lists the same names; a test holds the two together)."""

    block: int  # weights per block of its main tensors: a row (K) holds whole blocks, or
    # llama-quantize stores that tensor in a fallback type (fourbit.quantizers.shapes)
    bits: float  # about what its matrices take per weight on a model whose rows its blocks
    # divide: the disk estimate's figure (fourbit.diskspace); the report counts the file
    stores: str  # what, in words


# Bits per weight of ggml's blocks: Q4_0 = 32 4-bit codes + an f16 scale (4.5), Q4_1 also
# an f16 minimum (5.0), Q8_0 = 32 int8 + f16 (8.5), IQ4_NL = Q4_0's bytes with a
# non-uniform code table (4.5), IQ4_XS = 256 of those codes with 6-bit scales per 32
# (4.25); the K types' super-blocks of 256: Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625. The _S and
# _M mixes move some tensors (attn_v, ffn_down, the head) to a wider K type: the bits
# given for them are what they average on the 135M-0.5B models studied here.
GGUF_TYPES: dict[str, GgufType] = {
    "Q4_0": GgufType(32, 4.5, "4-bit codes, one scale per 32"),
    "Q4_1": GgufType(32, 5.0, "4-bit codes, a scale and a minimum per 32"),
    "Q4_K_S": GgufType(256, 4.6, "Q4_K, a few tensors in Q5_K"),
    "Q4_K_M": GgufType(256, 4.9, "Q4_K, half of attn_v and ffn_down in Q6_K"),
    "Q5_K_S": GgufType(256, 5.5, "Q5_K"),
    "Q5_K_M": GgufType(256, 5.7, "Q5_K, half of attn_v and ffn_down in Q6_K"),
    "Q6_K": GgufType(256, 6.5625, "Q6_K"),
    "Q8_0": GgufType(32, 8.5, "8-bit codes, one scale per 32"),
    "IQ4_XS": GgufType(256, 4.25, "non-uniform 4-bit codes, 6-bit scales per 32 in 256"),
    "IQ4_NL": GgufType(32, 4.5, "non-uniform 4-bit codes, one scale per 32"),
}
