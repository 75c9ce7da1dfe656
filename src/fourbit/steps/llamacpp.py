"""workflow/rules/llamacpp.smk: the workflow's llama.cpp steps, one function per rule:
build_llamacpp (build_tools), convert_gguf (convert_base), imatrix (importance_matrix),
quantize_gguf (quantize_arm) and dequantize_gguf (dequantize_arm, the F32 expansion: the
control).

llama.cpp arms are arms like any other (an id from the hash of their settings),
but their checkpoint is one GGUF file quantized by llama-quantize from an f16
GGUF of the same untied model (quantizing from bf16 changes the results).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from fourbit import records
from fourbit.atomic import write_json
from fourbit.llamacpp.build import ensure_llamacpp
from fourbit.llamacpp.convert import convert_to_gguf
from fourbit.llamacpp.imatrix import compute_imatrix
from fourbit.llamacpp.installed import LlamaCpp
from fourbit.llamacpp.quantize import dequantize_gguf, gguf_bits_per_weight, quantize_gguf

log = logging.getLogger("fourbit")


def build_tools(out_json: str | os.PathLike, jobs: int) -> None:
    """Build (or find in the cache outside the work tree) llama.cpp; record where."""
    tools = ensure_llamacpp(jobs=jobs)
    write_json(out_json, {"root": str(tools.root), "commit": tools.commit,
                          "llama_cpp_python": tools.llama_cpp_python_version})


def load_tools(tools_json: str | os.PathLike) -> LlamaCpp:
    return LlamaCpp.at(Path(json.loads(Path(tools_json).read_text())["root"])).check_complete()


def gguf_storage(gguf: Path, tools: LlamaCpp) -> dict:
    """The same storage keys as fourbit.checkpoints.quantized.storage_stats, from a GGUF."""
    bits = gguf_bits_per_weight(gguf, tools.gguf_py)
    return {
        "quantized_bits_per_weight": bits["matmul_2d"]["bits_per_weight"],
        "matrix_weights": bits["matrices"]["weights"],
        "matrix_bits_per_weight": bits["matrices"]["bits_per_weight"],
        "file_bits_per_param": bits["all"]["bits_per_weight"],
        "parameters": bits["all"]["weights"],
        "size_bytes": bits["file_bytes"],
        "size_mib": bits["file_bytes"] / 2**20,
        "by_type": bits["by_type"],
    }


def convert_base(untied: str | os.PathLike, out_gguf: str | os.PathLike,
                 storage_json: str | os.PathLike, tools_json: str | os.PathLike) -> None:
    tools = load_tools(tools_json)
    convert_to_gguf(Path(untied), Path(out_gguf), "f16", tools=tools)
    write_json(storage_json, gguf_storage(Path(out_gguf), tools))


def importance_matrix(f16_gguf: str | os.PathLike, untied: str | os.PathLike,
                      calibration_text: str | os.PathLike, out_imatrix: str | os.PathLike,
                      record_json: str | os.PathLike, calibration: dict,
                      tools_json: str | os.PathLike, threads: int) -> dict:
    """llama.cpp's importance matrix of the f16 GGUF on the windows a gptq arm with the same
    calibration block fits: the untied model's tokenizer on the calibration split, the
    block's draw of samples + heldout windows, the held-out ones left out (as GPTQ leaves
    them out of its Hessians when its grid search is checked on them, the default)."""
    from fourbit.quantizers.calibration import calibration_ids, draw_windows

    ids = calibration_ids(untied, calibration_text)
    windows = draw_windows(ids, calibration, calibration["heldout"])[: calibration["samples"]]
    facts = compute_imatrix(Path(f16_gguf), Path(out_imatrix), windows.tolist(),
                            tools=load_tools(tools_json), threads=threads)
    gptq = {"windows": len(windows), "seq_len": windows.shape[1], "tokens": windows.numel()}
    record = {"calibration": calibration, "gptq_windows": gptq, "llama_cpp": facts,
              "same_ids": facts["window_tokens_in_chunks"] == gptq["tokens"]}
    write_json(record_json, record)
    log.info("importance matrix: %d windows of %d ids, each one chunk of %d (%s) in %.0f s",
             gptq["windows"], gptq["seq_len"], facts["chunk_size"],
             "BOS + the window" if facts["bos_prepended"] else "the window", facts["seconds"])
    return record


def quantize_arm(f16_gguf: str | os.PathLike, out_gguf: str | os.PathLike, arm_path: str | os.PathLike,
                 arm: dict, tools_json: str | os.PathLike, threads: int,
                 imatrix: str | os.PathLike | None = None,
                 imatrix_record: str | os.PathLike | None = None) -> dict:
    """``imatrix`` (with its ``imatrix_record``) for an arm of ``imatrix: calibration``."""
    tools, quant = load_tools(tools_json), arm["quant"]
    if bool(imatrix) != (quant["imatrix"] == "calibration"):
        raise ValueError(f"arm {arm['id']} has imatrix: {quant['imatrix']!r} but was given "
                         f"{'an' if imatrix else 'no'} importance matrix")
    quantize_gguf(
        Path(f16_gguf), Path(out_gguf), quant["type"], tools=tools, threads=threads,
        output_tensor_type=quant["output_tensor_type"], token_embedding_type=quant["token_embedding_type"],
        imatrix=Path(imatrix) if imatrix else None,
    )
    manifest = {**arm, "format": "gguf", "storage": gguf_storage(Path(out_gguf), tools),
                "llama_cpp": {"commit": tools.commit, "from": "f16 GGUF of the untied model"}}
    if imatrix:
        manifest["imatrix"] = {"path": str(imatrix), **json.loads(Path(imatrix_record).read_text())}
    records.write("arm", arm_path, manifest)
    log.info("%s: %s, %.3f bits/weight in matmul weights", arm["id"], quant["type"],
             manifest["storage"]["quantized_bits_per_weight"])
    return manifest


def dequantize_arm(quantized_gguf: str | os.PathLike, out_gguf: str | os.PathLike,
                   tools_json: str | os.PathLike, threads: int) -> None:
    dequantize_gguf(Path(quantized_gguf), Path(out_gguf), tools=load_tools(tools_json), threads=threads)
