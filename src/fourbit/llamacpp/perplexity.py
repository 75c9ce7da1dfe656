"""Teacher-forced scoring and fidelity with llama.cpp, on exactly the study's token ids.

fourbit scores every engine on the same token ids: each window is fed as is (no
BOS added), and positions 1..W-1 are scored, each predicted from the tokens
before it (position 0 is context only). llama-perplexity cannot do that:

- it tokenizes text itself (``-f``/``-bf`` give text or raw bytes, not ids), and
  puts BOS first in every chunk when the vocabulary asks for it;
- it scores only the second half of each chunk (``--ppl-stride`` scores the last
  ``stride`` positions of overlapping chunks, still from its own tokens);
- ``--kl-divergence`` does read token ids, from the logits file written by
  ``--kl-divergence-base``, but again scores the second half of each chunk and
  replaces each chunk's first token by BOS when the vocabulary asks for it.

So its KL would cover other positions than the other engines' (vLLM's and the reference
engine's cover positions 1..W-1 of the same windows), and a KL is only comparable across
engines on the same positions. The build adds one small program, ``fourbit-score``
(``scorer.cpp``, beside this module), compiled in the same CMake build against the same
static libllama as the tools. It reads windows of token ids, decodes each window in one
batch (one ubatch, so the kernels do not depend on how a window would be split) on a
cleared KV cache, and either sums -log softmax(logits[j])[ids[j+1]] in double for
j = 0..W-2 (``score_windows``), or decodes each window with the base model too and
computes KL(P_base || P_arm) in double from both full log-softmaxes at the same positions
(``compare_windows``, fourbit.metrics.kl's definition). It uses only the public llama.h
API (load, decode, logits), so it computes exactly what the tools compute for the same
settings, which it takes as the same flags (:func:`fourbit.llamacpp.common_arithmetic_flags`).
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

from fourbit.llamacpp import ToolError, common_arithmetic_flags, run_tool, tail
from fourbit.llamacpp.installed import LlamaCpp
from fourbit.progress import Progress


_WINDOW_LINE = re.compile(r"^window (\d+) tokens (\d+) nll_sum (\S+)$")
_COMPARE_LINE = re.compile(r"^compare (\d+) positions (\d+) kl((?: \S+)*) top1((?: [01])*)$")


def score_windows(
    gguf: Path, windows: list[list[int]], *, tools: LlamaCpp, threads: int
) -> list[dict]:
    """-log p of positions 1..W-1 of each window given the tokens before it, with llama.cpp.

    Returns one {"nll_sum", "tokens"} per window, in order, like every fourbit engine.
    """
    if not windows:
        raise ValueError("no windows to score")
    short = [i for i, w in enumerate(windows) if len(w) < 2]
    if short:
        raise ValueError(
            f"windows {short[:5]} have fewer than 2 tokens; "
            f"each needs one of context and one scored"
        )
    progress = Progress(f"scoring {Path(gguf).name} with llama.cpp", len(windows), "windows")
    stdout = _run_scorer(
        gguf, windows, [], f"scoring {gguf}", tools=tools, threads=threads,
        on_stdout_line=lambda line: progress.update() if line.startswith("window ") else None,
    )
    return parse_scorer_output(stdout, [len(w) - 1 for w in windows])


def compare_windows(base_gguf: Path, arm_gguf: Path, windows: list[list[int]], *, tools: LlamaCpp,
                    threads: int) -> dict:
    """KL(P_base || P_arm) and top-1 agreement at positions 1..W-1 of each window, both
    models run by llama.cpp with the same settings: {"window_kl": [[float]],
    "window_top1": [[bool]]}, one list per window, as every engine that compares positions."""
    if not windows or any(len(w) < 2 for w in windows):
        raise ValueError("comparing needs at least one window, each of at least 2 tokens")
    progress = Progress(f"comparing {Path(arm_gguf).name} with {Path(base_gguf).name}",
                        len(windows), "windows")
    stdout = _run_scorer(
        arm_gguf, windows, ["--base", base_gguf], f"comparing {arm_gguf} with {base_gguf}",
        tools=tools, threads=threads,
        on_stdout_line=lambda line: progress.update() if line.startswith("compare ") else None,
    )
    return parse_compare_output(stdout, [len(w) - 1 for w in windows])


def _run_scorer(gguf: Path, rows: list[list[int]], options: list, what: str, *, tools: LlamaCpp,
                threads: int, on_stdout_line=None) -> str:
    """fourbit-score over ``rows`` of token ids (one line each in a temporary file); its stdout."""
    with tempfile.TemporaryDirectory(prefix="fourbit-score-") as temp:
        rows_file = Path(temp) / "rows.txt"
        rows_file.write_text("".join(" ".join(map(str, row)) + "\n" for row in rows))
        run = run_tool(
            [tools.scorer, "-m", gguf, "-f", rows_file, "-t", threads, *options,
             *common_arithmetic_flags()],
            what,
            on_stdout_line=on_stdout_line,
        )
    return run.stdout


def greedy_continuations(
    gguf: Path, prompts: list[list[int]], new_tokens: int, *, tools: LlamaCpp, threads: int
) -> list[list[int]]:
    """Each prompt (fed as is, no BOS added) continued greedily by exactly ``new_tokens``
    tokens (argmax, lowest id on ties; end-of-generation tokens do not stop it)."""
    if not prompts or any(len(p) < 2 for p in prompts):  # the scorer reads lines of 2+ ids
        raise ValueError("greedy decoding needs at least one prompt, each of at least 2 tokens")
    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens}; it must be at least 1")
    stdout = _run_scorer(gguf, prompts, ["--greedy", new_tokens], f"greedy decoding with {gguf}",
                         tools=tools, threads=threads)
    return parse_greedy_output(stdout, len(prompts), new_tokens)


def _lines_before_done(stdout: str, count: int, unit: str) -> list[str]:
    """fourbit-score's stdout lines before its last, which must say it finished all
    ``count`` rows (a run cut short prints no "done")."""
    lines = stdout.strip().splitlines()
    if not lines or lines[-1] != f"done {count}":
        raise ToolError(f"fourbit-score did not finish all {count} {unit}; its output ends:\n"
                        f"{tail(stdout)}")
    return lines[:-1]


_GREEDY_LINE = re.compile(r"^greedy (\d+) ids((?: -?\d+)*)$")


def parse_greedy_output(stdout: str, prompts: int, new_tokens: int) -> list[list[int]]:
    """fourbit-score --greedy's stdout → one list of ``new_tokens`` ids per prompt."""
    continuations = []
    for line in _lines_before_done(stdout, prompts, "prompts"):
        match = _GREEDY_LINE.match(line)
        ids = [int(i) for i in match.group(2).split()] if match else []
        if not match or int(match.group(1)) != len(continuations) or len(ids) != new_tokens:
            raise ToolError(f"unexpected line from fourbit-score --greedy (prompt "
                            f"{len(continuations)}, {new_tokens} ids expected): {line!r}")
        continuations.append(ids)
    if len(continuations) != prompts:
        raise ToolError(f"fourbit-score reported {len(continuations)} prompts, expected {prompts}")
    return continuations


def parse_scorer_output(stdout: str, scored_per_window: list[int]) -> list[dict]:
    """fourbit-score's stdout → [{"nll_sum", "tokens"}], checked against what was asked."""
    results = []
    for line in _lines_before_done(stdout, len(scored_per_window), "windows"):
        match = _WINDOW_LINE.match(line)
        if not match:
            raise ToolError(f"unexpected line from fourbit-score: {line!r}")
        index, tokens, nll_sum = int(match.group(1)), int(match.group(2)), float(match.group(3))
        if index != len(results) or tokens != scored_per_window[index]:
            raise ToolError(
                f"fourbit-score reported window {index} with {tokens} scored tokens; "
                f"expected window "
                f"{len(results)} with {scored_per_window[len(results)]}"
            )
        results.append({"nll_sum": nll_sum, "tokens": tokens})
    if len(results) != len(scored_per_window):
        raise ToolError(
            f"fourbit-score reported {len(results)} windows, expected {len(scored_per_window)}"
        )
    return results


def parse_compare_output(stdout: str, scored_per_window: list[int]) -> dict:
    """fourbit-score --base's stdout → {"window_kl", "window_top1"}, checked against what
    was asked (a window's line holds as many KLs and top-1 flags as it has scored positions)."""
    window_kl, window_top1 = [], []
    for line in _lines_before_done(stdout, len(scored_per_window), "windows"):
        match = _COMPARE_LINE.match(line)
        expected = scored_per_window[len(window_kl)] if len(window_kl) < len(scored_per_window) else None
        kl = match.group(3).split() if match else []
        top1 = match.group(4).split() if match else []
        if (not match or int(match.group(1)) != len(window_kl) or int(match.group(2)) != expected
                or len(kl) != expected or len(top1) != expected):
            raise ToolError(f"unexpected line from fourbit-score --base (window {len(window_kl)}, "
                            f"{expected} positions expected): {line[:200]!r}")
        values = [float(x) for x in kl]
        if not all(math.isfinite(x) for x in values):
            raise ToolError(f"fourbit-score --base gave a KL that is not a finite number in window "
                            f"{len(window_kl)}: {line[:200]!r}")
        window_kl.append(values)
        window_top1.append([x == "1" for x in top1])
    if len(window_kl) != len(scored_per_window):
        raise ToolError(f"fourbit-score reported {len(window_kl)} windows, expected "
                        f"{len(scored_per_window)}")
    return {"window_kl": window_kl, "window_top1": window_top1}
