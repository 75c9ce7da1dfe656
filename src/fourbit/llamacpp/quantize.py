"""GGUF → a llama.cpp quantization type and back to F32, and the bits per weight a GGUF file
really stores.

A type's name is not its size: Q4_K_M mixes Q4_K with Q6_K (half of the
attention V and FFN down projections, and the output head), every type but Q8_0
keeps the head in Q6_K or wider, and llama-quantize falls back to other types for
rows it cannot cut into whole blocks (a K-quant or IQ4_XS block spans 256 weights,
a legacy or IQ4_NL one 32): Q5_0, Q5_1, Q8_0, IQ4_NL or F16. Norms and biases stay
F32. ``gguf_bits_per_weight`` therefore counts the bytes of every tensor in
the file as written.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from collections import defaultdict
from pathlib import Path

from fourbit.atomic import atomic_path
from fourbit.llamacpp import run_tool
from fourbit.llamacpp.installed import LlamaCpp
from fourbit.progress import Progress
from fourbit.schema import allowed

log = logging.getLogger("fourbit")

# The types a llama.cpp arm may name: the schema's list ($defs.llamacpp_type), the one
# written anywhere (fourbit.layouts.GGUF_TYPES holds each one's block and bits).
QTYPES = allowed("llamacpp_type")
# llama-quantize logs one "[  12/ 291] blk.1.attn_q.weight - ..." line per tensor.
_TENSOR_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")
# The lookup table: a 2-D tensor, but no matrix multiplication reads it (unless the
# head is tied to it, and then it is the head: see gguf_bits_per_weight).
TOKEN_EMBEDDING = "token_embd.weight"
OUTPUT_HEAD = "output.weight"


def quantize_gguf(
    f16_gguf: Path,
    out_path: Path,
    qtype: str,
    *,
    tools: LlamaCpp,
    threads: int,
    output_tensor_type: str | None = None,
    token_embedding_type: str | None = None,
    imatrix: Path | None = None,
) -> Path:
    """Quantize a 16- or 32-bit GGUF to ``qtype`` with llama-quantize, atomically to
    ``out_path``.

    ``output_tensor_type`` / ``token_embedding_type`` (ggml type names such as
    "q8_0", "f16") override what the type's recipe picks for the head and the
    embedding table; ``imatrix`` is an importance matrix from llama-imatrix
    (fourbit.llamacpp.imatrix), which every type but Q8_0 weighs its rounding by.
    """
    f16_gguf, out_path = Path(f16_gguf), Path(out_path)
    if qtype not in QTYPES:
        raise ValueError(f"qtype={qtype!r} is not one of {QTYPES}")
    if not f16_gguf.is_file():
        raise FileNotFoundError(f"GGUF to quantize {f16_gguf} does not exist")
    if threads < 1:
        raise ValueError(f"threads={threads} must be at least 1")
    options = []
    if output_tensor_type:
        options += ["--output-tensor-type", output_tensor_type]
    if token_embedding_type:
        options += ["--token-embedding-type", token_embedding_type]
    if imatrix:
        if not Path(imatrix).is_file():
            raise FileNotFoundError(f"importance matrix {imatrix} does not exist")
        options += ["--imatrix", imatrix]
    return _run_quantize(tools, options, f16_gguf, out_path, qtype, threads,
                         f"quantizing {f16_gguf.name} to {qtype}")


def dequantize_gguf(quantized_gguf: Path, out_path: Path, *, tools: LlamaCpp, threads: int) -> Path:
    """Expand every tensor of a quantized GGUF to F32, atomically to ``out_path``: the
    llama.cpp arm's dense control.

    llama-quantize with ``--allow-requantize`` and type F32 runs each tensor through
    ggml's own dequantization (the same block decoding the kernels use) and writes
    the float32 values, so scoring the result with the same engine separates what
    the 4-bit weights cost from what the quantized kernels add (Q4_K matmuls, for
    one, round the activations to 8 bits).
    """
    quantized_gguf, out_path = Path(quantized_gguf), Path(out_path)
    if not quantized_gguf.is_file():
        raise FileNotFoundError(f"GGUF to dequantize {quantized_gguf} does not exist")
    return _run_quantize(tools, ["--allow-requantize"], quantized_gguf, out_path, "F32", threads,
                         f"expanding {quantized_gguf.name} to F32")


def _run_quantize(tools: LlamaCpp, options: list, source: Path, out_path: Path, qtype: str,
                  threads: int, what: str) -> Path:
    progress = _TensorProgress(what)
    with atomic_path(out_path) as temp:
        run_tool(
            [tools.quantize, *options, source, temp, qtype, threads],
            f"llama-quantize to {qtype}",
            on_stdout_line=progress.line,
            merge_stderr=True,
        )
    log.info("wrote %s (%.1f MB)", out_path, out_path.stat().st_size / 1e6)
    return out_path


class _TensorProgress:
    def __init__(self, what: str):
        self.what, self.progress = what, None

    def line(self, text: str) -> None:
        match = _TENSOR_LINE.match(text)
        if match:
            self.progress = self.progress or Progress(
                self.what, total=int(match.group(2)), unit="tensors"
            )
            self.progress.update()


def gguf_bits_per_weight(path: Path, gguf_py_dir: Path) -> dict:
    """The storage a GGUF file spends per weight, from its tensor table.

    Returns ``all`` (every tensor), ``matrices`` (every 2-D tensor: the weights
    matrix multiplications read and the token embedding) and ``matmul_2d`` (those
    but the token embedding, which is counted as the head when the file has no
    separate output.weight), each as {"tensors", "weights", "bytes", "bits_per_weight"}; ``by_type``, the
    same per ggml type over all tensors; ``tensor_types``, each tensor's type;
    and ``file_bytes`` (tensors plus metadata and alignment).
    """
    gguf = _import_gguf(Path(gguf_py_dir))
    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    head_is_embedding = OUTPUT_HEAD not in names
    totals = {"all": _Tally(), "matrices": _Tally(), "matmul_2d": _Tally()}
    by_type: dict[str, _Tally] = defaultdict(_Tally)
    tensor_types = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        tensor_types[tensor.name] = type_name
        by_type[type_name].add(tensor.n_elements, tensor.n_bytes)
        totals["all"].add(tensor.n_elements, tensor.n_bytes)
        is_2d = sum(int(d) > 1 for d in tensor.shape) == 2
        if is_2d:
            totals["matrices"].add(tensor.n_elements, tensor.n_bytes)
        if is_2d and (tensor.name != TOKEN_EMBEDDING or head_is_embedding):
            totals["matmul_2d"].add(tensor.n_elements, tensor.n_bytes)
    return {
        **{k: v.summary() for k, v in totals.items()},
        "by_type": {k: by_type[k].summary() for k in sorted(by_type)},
        "tensor_types": tensor_types,
        "file_bytes": Path(path).stat().st_size,
    }


class _Tally:
    def __init__(self):
        self.tensors = self.weights = self.bytes = 0

    def add(self, weights: int, n_bytes: int) -> None:
        self.tensors += 1
        self.weights += int(weights)
        self.bytes += int(n_bytes)

    def summary(self) -> dict:
        bits = 8 * self.bytes / self.weights if self.weights else None
        return {
            "tensors": self.tensors,
            "weights": self.weights,
            "bytes": self.bytes,
            "bits_per_weight": bits,
        }


def _import_gguf(gguf_py_dir: Path):
    """The ``gguf`` package of ``gguf_py_dir`` (the built tree's), never an installed one."""
    expected = (gguf_py_dir / "gguf" / "__init__.py").resolve()
    if not expected.is_file():
        raise FileNotFoundError(
            f"{gguf_py_dir} is not a gguf-py folder: it has no gguf/__init__.py"
        )
    loaded = sys.modules.get("gguf")
    if loaded is None:
        sys.path.insert(0, str(gguf_py_dir))
        loaded = importlib.import_module("gguf")
    if Path(loaded.__file__).resolve() != expected:
        raise ImportError(
            f"the gguf package loaded in this process is {loaded.__file__}, not {expected}: the "
            f"GGUF layout must be read with the gguf-py of the llama.cpp tree that wrote the file"
        )
    return loaded
