"""llama.cpp as an engine: scores GGUF checkpoints on exactly the study's token ids.

Its unquantized baseline is the f16 GGUF of the untied model, so every llama.cpp
arm is compared with llama.cpp, not with another engine.
"""

from __future__ import annotations

from pathlib import Path

from fourbit.llamacpp import ARITHMETIC
from fourbit.llamacpp.build import find_llamacpp
from fourbit.llamacpp.perplexity import score_windows as llamacpp_score


def _tools():
    tools = find_llamacpp()
    if tools is None:
        raise FileNotFoundError("llama.cpp is not built; the build_llamacpp rule builds it")
    return tools.check_complete()


def score_windows(checkpoint: Path, windows: list[list[int]], settings: dict, threads: int) -> list[dict]:
    return llamacpp_score(Path(checkpoint), windows, tools=_tools(), threads=settings["threads"])


def runtime(checkpoint: Path, settings: dict) -> str:
    pinned = ", ".join(f"{k}={v}" for k, v in ARITHMETIC.items())
    return f"llama.cpp {_tools().commit[:7]} CPU ({Path(checkpoint).name}; {pinned})"
