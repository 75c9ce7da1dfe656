"""Each on-disk 4-bit format's layout table, as data that needs no torch: the tensors one
N x K matrix is stored as, their shapes in N, K and G = group_size, their dtypes by name
and the arithmetic each holds.

The formats (fourbit.formats) pack, unpack and count bits by these tables, and the
planner (fourbit.quantizers.shapes) checks every matrix of a model against the same
tables while the workflow builds its DAG, where importing torch would cost seconds. So
they live here, below both, not in the format modules: importing anything under
fourbit.formats imports torch. The 8-bit layout (fourbit.formats.int8) keeps its table
beside its code, since it stores any N x K and the planner never asks it.
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
