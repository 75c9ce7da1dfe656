"""Hugging Face model folder → GGUF, with the converter of the same llama.cpp tree as the tools.

The converter runs under this project's Python (``sys.executable``) with
PYTHONPATH set to that tree's gguf-py: the converter and gguf-py change
together, and the gguf on PyPI (0.19.0) does not fit this commit's converter, so
a pip-installed gguf is never used. Besides gguf-py it imports torch, numpy,
safetensors, sentencepiece and transformers, and gguf-py imports numpy, tqdm,
PyYAML and requests (mistral_common only for Mistral-format models).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

from fourbit.atomic import atomic_path
from fourbit.llamacpp import run_tool, tool_environment
from fourbit.llamacpp.installed import LlamaCpp
from fourbit.progress import Progress

log = logging.getLogger("fourbit")

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# The converter's tqdm bar while it writes the tensors: "Writing:  45%|████▌     | 1.2G/2.7G [...]".
_WRITING = re.compile(r"^Writing:\s+(\d+)%")


def convert_to_gguf(
    model_dir: Path, out_path: Path, outtype: str = "f16", *, tools: LlamaCpp
) -> Path:
    """Write ``model_dir`` (config.json, safetensors, tokenizer files) as one GGUF
    file at ``out_path``."""
    model_dir, out_path = Path(model_dir), Path(out_path)
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype={outtype!r} is not one of {OUTTYPES}")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir} is not a Hugging Face model folder: it has no config.json"
        )
    env = tool_environment()
    env.pop("NO_LOCAL_GGUF", None)  # would make the converter prefer an installed gguf
    env["PYTHONPATH"] = str(tools.gguf_py)
    env["HF_HUB_OFFLINE"] = "1"  # the model is local; nothing is fetched
    started = time.monotonic()
    log.info(
        "converting %s to %s GGUF with llama.cpp %s's converter",
        model_dir,
        outtype,
        tools.commit[:7],
    )
    progress = _WritingProgress(f"writing {out_path.name}")
    with atomic_path(out_path) as temp:
        run_tool(
            [sys.executable, tools.convert_script, model_dir,
             "--outfile", temp, "--outtype", outtype],
            f"converting {model_dir} to GGUF",
            on_stdout_line=progress.line,
            env=env,
            merge_stderr=True,
        )
        if not temp.is_file():
            raise RuntimeError(f"the converter exited cleanly but wrote no {temp}")
    log.info(
        "wrote %s (%.1f MB) in %.0f s",
        out_path,
        out_path.stat().st_size / 1e6,
        time.monotonic() - started,
    )
    return out_path


class _WritingProgress:
    def __init__(self, what: str):
        self.progress, self.percent = Progress(what, total=100, unit="%"), 0

    def line(self, text: str) -> None:
        match = _WRITING.match(text)
        if match and int(match.group(1)) > self.percent:
            self.progress.update(int(match.group(1)) - self.percent)
            self.percent = int(match.group(1))
