"""llama.cpp as a comparison engine, built here from the llama.cpp source that
llama-cpp-python's sdist vendors.

- :mod:`.build`: find or build the cached tools (``ensure_llamacpp``); the command line.
  - :mod:`.recipe`: the pinned version and commit, CMake options, targets, fourbit-score.
  - :mod:`.installed`: a finished build in the cache (``LlamaCpp``, ``find_llamacpp``).
  - :mod:`.toolchain`: whether this machine has what the build runs.
  - :mod:`.sdist`: fetch and verify llama-cpp-python's sdist; extract its llama.cpp.
  - :mod:`.cmake`: one build with CMake, recorded in build-info.json.
- :mod:`.convert`: Hugging Face folder → GGUF with the same tree's converter.
- :mod:`.imatrix`: an importance matrix from given token windows (fourbit-imatrix).
- :mod:`.quantize`: GGUF → a llama-quantize type (Q4_K_M, IQ4_XS ...), and the bits per
  weight a file really stores.
- :mod:`.perplexity`: teacher-forced scoring of exact token windows, an arm's
  per-position KL divergence from its baseline on them, greedy continuations.
- :mod:`.throughput`: llama-bench pp512 / tg128.

Every command that computes with a model pins the settings that change its
arithmetic (:data:`ARITHMETIC`), so scores and speeds are always measured on
the same kernels, whatever the tools' defaults or ``LLAMA_ARG_*`` variables say.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable

# Flash attention off: ggml's CPU flash attention accumulates softmax·V in an f16
# buffer when V is f16, the plain path in f32. Weight repacking on: llama.cpp's
# default and its fastest CPU path (e.g. Q4_0 into interleaved rows), which users
# get. KV cache f16: llama.cpp's default.
ARITHMETIC = {"flash_attn": False, "repack": True, "cache_type_k": "f16", "cache_type_v": "f16"}


def common_arithmetic_flags() -> list[str]:
    """ARITHMETIC in the syntax of the tools built on llama.cpp's common arguments
    (fourbit-score, fourbit-imatrix)."""
    return [
        "--flash-attn", "on" if ARITHMETIC["flash_attn"] else "off",
        "--repack" if ARITHMETIC["repack"] else "--no-repack",
        "--cache-type-k", ARITHMETIC["cache_type_k"],
        "--cache-type-v", ARITHMETIC["cache_type_v"],
    ]


def bench_arithmetic_flags() -> list[str]:
    """ARITHMETIC in llama-bench's own syntax."""
    return [
        "--flash-attn", "on" if ARITHMETIC["flash_attn"] else "off",
        "--repack", "1" if ARITHMETIC["repack"] else "0",
        "--cache-type-k", ARITHMETIC["cache_type_k"],
        "--cache-type-v", ARITHMETIC["cache_type_v"],
    ]


def tool_environment() -> dict[str, str]:
    """The environment for llama.cpp tools: without LLAMA_ARG_* overrides."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}


@dataclass(frozen=True)
class ToolRun:
    command: list[str]
    stdout: str
    stderr: str


class ToolError(RuntimeError):
    pass


def run_tool(
    command: list,
    what: str,
    on_stdout_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
    merge_stderr: bool = False,
    cwd: str | os.PathLike | None = None,
) -> ToolRun:
    """Run one llama.cpp program to completion and return what it printed.

    stdout is read as it comes (``on_stdout_line`` sees each line, e.g. to report
    progress); stderr, where the tools log, goes to a temporary file so neither
    stream can block the other, or into stdout with ``merge_stderr`` (for tools
    whose progress is in their log); ``cwd``, the folder it runs in. A non-zero exit
    raises ToolError with the command and the end of both streams.
    """
    command = [str(part) for part in command]
    lines = []
    with tempfile.TemporaryFile(mode="w+", errors="replace") as stderr:
        with subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else stderr,
            text=True,
            errors="replace",
            env=env or tool_environment(),
            cwd=cwd,
        ) as process:
            try:
                for line in process.stdout:
                    lines.append(line)
                    if on_stdout_line:
                        on_stdout_line(line)
            except BaseException:
                process.kill()  # an interrupted job leaves no tool running
                raise
        stderr.seek(0)
        run = ToolRun(command, "".join(lines), stderr.read())
    if process.returncode != 0:
        raise ToolError(
            f"{what} failed (exit {process.returncode}): {shlex.join(command)}\n"
            f"--- end of stderr ---\n{tail(run.stderr)}\n--- end of stdout ---\n{tail(run.stdout)}"
        )
    return run


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])
