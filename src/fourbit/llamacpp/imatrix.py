"""An importance matrix for llama-quantize, computed by llama.cpp on given token windows.

llama-imatrix runs a GGUF model over calibration text cut into chunks of ``-c`` tokens and
keeps, for every matrix a decoder layer multiplies, the sum over tokens of each input
column's squared activation (``<tensor>.in_sum2`` [K]) and how many tokens it summed
(``<tensor>.counts``); llama-quantize ``--imatrix`` weighs each weight's rounding error by
them. llama-imatrix tokenizes its text itself: the windows' text, joined, comes back in
chunks that drift off the windows (each chunk's first id goes under the BOS it writes),
and a tokenizer may merge across the joins (benchmarks/imatrix_tokens.py measures it). So
the windows go to fourbit-imatrix: llama-imatrix's own source reading ids instead of text
(:mod:`fourbit.llamacpp.recipe`, ``imatrix_ids.cpp``). Each window is one chunk, written
as llama-imatrix evaluates a chunk: where the vocabulary adds BOS, llama-imatrix writes
BOS over the chunk's first token, so the chunk is BOS followed by the whole window (-c one
more than the window); elsewhere the chunk is the window.

The output is read back and checked: as many chunks as windows, each of the chunk's
length, every matrix fed every token.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile
import time
from pathlib import Path

from fourbit.atomic import atomic_path
from fourbit.llamacpp import ToolError, common_arithmetic_flags, run_tool
from fourbit.llamacpp.installed import LlamaCpp
from fourbit.llamacpp.quantize import _import_gguf

log = logging.getLogger("fourbit")

IDS_FILE = "calibration-ids.txt"  # the name the imatrix records as its dataset (-f)
# llama-imatrix skips every ubatch of fewer rows than this (collect_imatrix: "why are small
# batches ignored (<16 tokens)?"). With its default batch (2048) and ubatch (512), chunks of
# 513 (BOS + 512) go 3 to a batch and are split 170 + 170 + 170 + 3 rows per chunk, so 3 of
# every 513 tokens were never counted (380 of 65,664 on the default study). One chunk per
# batch and per ubatch counts them all (seq_len is at least 16).
UBATCH_ROWS = 16
# fourbit-imatrix's report of what it read (imatrix_ids.cpp)
_READ = re.compile(r"fourbit-imatrix: read (\d+) chunks of (\d+) token ids \(add_bos (\d)\)")


def compute_imatrix(f16_gguf: Path, out_path: Path, windows: list[list[int]], *,
                    tools: LlamaCpp, threads: int) -> dict:
    """The importance matrix of ``f16_gguf`` on ``windows`` (token ids, all of one length),
    written atomically to ``out_path``; returns what was computed on (the record's facts)."""
    f16_gguf, out_path = Path(f16_gguf), Path(out_path)
    if not f16_gguf.is_file():
        raise FileNotFoundError(f"GGUF to compute the importance matrix on {f16_gguf} does not exist")
    if len(windows) < 2 or len({len(w) for w in windows}) != 1 or len(windows[0]) < UBATCH_ROWS:
        lengths = sorted({len(w) for w in windows})
        raise ValueError(f"need 2 or more windows of one length, at least {UBATCH_ROWS} (llama-imatrix "
                         f"refuses fewer than two chunks, and counts no shorter one); got "
                         f"{len(windows)} windows of lengths {lengths}")
    add_bos, bos = vocabulary_bos(f16_gguf, tools.gguf_py)
    chunks = [[bos, *w] if add_bos else list(w) for w in windows]
    text = "".join(" ".join(map(str, chunk)) + "\n" for chunk in chunks)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fourbit-imatrix-") as scratch, \
            atomic_path(out_path) as temp:
        (Path(scratch) / IDS_FILE).write_text(text)
        width = len(chunks[0])  # one chunk per batch and per ubatch: UBATCH_ROWS says why
        options = ["-c", width, "-b", width, "-ub", width, "-t", threads, "--no-ppl",
                   *common_arithmetic_flags()]
        # as run (in the scratch folder, so the matrix names its dataset IDS_FILE) and as recorded
        run_as = [tools.imatrix_ids, "-m", f16_gguf.resolve(), "-f", IDS_FILE, "-o", temp.resolve(), *options]
        command = [str(part) for part in (tools.imatrix_ids, "-m", f16_gguf, "-f", IDS_FILE, "-o",
                                          out_path, *options)]
        log.info("importance matrix of %s over %d chunks of %d tokens", f16_gguf.name,
                 len(chunks), len(chunks[0]))
        run = run_tool(run_as, "fourbit-imatrix", merge_stderr=True, cwd=scratch)
        stored = _check(run.stdout, read_imatrix(temp, tools.gguf_py), chunks, add_bos, command)
    return {
        "program": f"{tools.imatrix_ids.name} (llama-imatrix reading token ids), llama.cpp {tools.commit[:7]}",
        "command": command,
        "windows": len(windows),
        "window_tokens": len(windows[0]),
        "bos_prepended": add_bos,
        **{k: stored[k] for k in ("chunks", "chunk_size", "matrices")},
        "tokens": len(chunks) * len(chunks[0]),
        "window_tokens_in_chunks": len(windows) * len(windows[0]),
        "ids_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "seconds": round(time.monotonic() - started, 1),
    }


def _check(stdout: str, stored: dict, chunks: list[list[int]], add_bos: bool, command: list) -> dict:
    """``stored`` (read_imatrix) if fourbit-imatrix read the chunks as written and summed
    every matrix over each of their tokens; else ToolError, and nothing is published."""
    read = _READ.search(stdout)
    said = (int(read[1]), int(read[2]), bool(int(read[3]))) if read else None
    if said != (len(chunks), len(chunks[0]), add_bos):
        raise ToolError(f"fourbit-imatrix read {read[0] if read else 'nothing it reported'}, not "
                        f"{len(chunks)} chunks of {len(chunks[0])} ids (add_bos {int(add_bos)}, from "
                        f"the GGUF's tokenizer.ggml keys): {' '.join(map(str, command))}")
    expected = {"chunks": len(chunks), "chunk_size": len(chunks[0]),
                "tokens_per_matrix": [len(chunks) * len(chunks[0])]}
    got = {k: stored[k] for k in expected}
    if got != expected:
        raise ToolError(f"the importance matrix holds {got}, not {expected}: the chunks did not "
                        f"fall on the windows ({' '.join(map(str, command))})")
    return stored


def vocabulary_bos(gguf_path: Path, gguf_py_dir: Path) -> tuple[bool, int | None]:
    """(whether llama.cpp adds BOS to this GGUF's text, the BOS id): the file's
    tokenizer.ggml.add_bos_token, else llama.cpp's default for its tokenizer model
    (SentencePiece "llama" and WordPiece "bert" add one; the BPE ones do not)."""
    gguf = _import_gguf(Path(gguf_py_dir))
    fields = gguf.GGUFReader(str(gguf_path)).fields
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    if add_bos is not None:
        adds = bool(add_bos.contents())
    else:
        adds = fields["tokenizer.ggml.model"].contents() in ("llama", "bert")
    if adds and bos is None:
        raise ValueError(f"{gguf_path} adds BOS but names no tokenizer.ggml.bos_token_id")
    return adds, int(bos.contents()) if bos is not None else None


def read_imatrix(path: Path, gguf_py_dir: Path) -> dict:
    """What an importance-matrix GGUF holds: chunks and chunk_size (llama-imatrix's
    imatrix.chunk_count and imatrix.chunk_size), its datasets, the matrices it covers, and
    the distinct token counts they were summed over (``tokens_per_matrix``); ``in_sum2``, by
    tensor name, each column's sum of squared activations."""
    gguf = _import_gguf(Path(gguf_py_dir))
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    counts = {name.removesuffix(".counts"): float(t.data.sum())
              for name, t in tensors.items() if name.endswith(".counts")}
    return {
        "chunks": int(reader.fields["imatrix.chunk_count"].contents()),
        "chunk_size": int(reader.fields["imatrix.chunk_size"].contents()),
        "datasets": reader.fields["imatrix.datasets"].contents(),
        "matrices": len(counts),
        "tokens_per_matrix": sorted({int(c) for c in counts.values()}),
        "in_sum2": {name: tensors[f"{name}.in_sum2"].data for name in counts},
    }
