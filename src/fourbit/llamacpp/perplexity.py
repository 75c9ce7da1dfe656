"""Teacher-forced scoring with llama.cpp, and llama-perplexity's KL divergence.

Scoring exact token windows (``score_windows``)
-----------------------------------------------
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

So the build adds one small program, ``fourbit-score`` (``scorer.cpp``, beside this
module), compiled in the same CMake build against the same static libllama as the tools.
It reads windows of token ids, decodes each window in one batch (one ubatch, so
the kernels do not depend on how a window would be split) on a cleared KV cache,
and sums -log softmax(logits[j])[ids[j+1]] in double for j = 0..W-2. It uses only
the public llama.h API (load, decode, logits), so it computes exactly what the
tools compute for the same settings, which it takes as the same flags
(:func:`fourbit.llamacpp.common_arithmetic_flags`).
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path

from fourbit.llamacpp import ARITHMETIC, ToolError, common_arithmetic_flags, run_tool, tail
from fourbit.llamacpp.installed import LlamaCpp
from fourbit.progress import Progress

log = logging.getLogger("fourbit")

_WINDOW_LINE = re.compile(r"^window (\d+) tokens (\d+) nll_sum (\S+)$")


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


_GREEDY_LINE = re.compile(r"^greedy (\d+) ids((?: -?\d+)*)$")


def parse_greedy_output(stdout: str, prompts: int, new_tokens: int) -> list[list[int]]:
    """fourbit-score --greedy's stdout → one list of ``new_tokens`` ids per prompt."""
    lines = stdout.strip().splitlines()
    if not lines or lines[-1] != f"done {prompts}":
        raise ToolError(f"fourbit-score did not finish all {prompts} prompts; its output ends:\n"
                        f"{tail(stdout)}")
    continuations = []
    for line in lines[:-1]:
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
    lines = stdout.strip().splitlines()
    if not lines or lines[-1] != f"done {len(scored_per_window)}":
        raise ToolError(
            f"fourbit-score did not finish all {len(scored_per_window)} windows; its output ends:\n"
            f"{tail(stdout)}"
        )
    results = []
    for line in lines[:-1]:
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


# The last lines llama-perplexity prints; a run without them did not finish, whatever its
# exit status (its KL mode returns 0 after most errors). Its log lines may start with a
# time and a level ("0.01.712.775 I ").
_LOG_PREFIX = r"^(?:[\d.]+ [DIWE] )?"
_BASE_DONE = re.compile(_LOG_PREFIX + r"Final estimate: PPL = (\S+) \+/- (\S+)", re.MULTILINE)
_KL_STATISTICS = {
    "ppl_quant": re.compile(_LOG_PREFIX + r"Mean PPL\(Q\)\s*:\s*(\S+)\s*±\s*(\S+)", re.MULTILINE),
    "ppl_base": re.compile(_LOG_PREFIX + r"Mean PPL\(base\)\s*:\s*(\S+)\s*±\s*(\S+)", re.MULTILINE),
    "mean_kld": re.compile(_LOG_PREFIX + r"Mean\s+KLD:\s*(\S+)\s*±\s*(\S+)", re.MULTILINE),
    "kld_p99": re.compile(_LOG_PREFIX + r"99\.0%\s+KLD:\s*(\S+)", re.MULTILINE),
    "same_top_p_percent": re.compile(
        _LOG_PREFIX + r"Same top p:\s*(\S+)\s*±\s*(\S+)\s*%", re.MULTILINE
    ),
}
_KL_CHUNKS = re.compile(r"computing over (\d+) chunks")
# Runs of llama-perplexity before giving up: its logger can lose its last lines
# (kl_divergence's docstring), more often on a loaded machine, and then sometimes twice
# in a row (docs/llamacpp-build.md has the measurements).
ATTEMPTS = 3
_KL_CHUNK_ROW = re.compile(_LOG_PREFIX + r"\s*\d+\s+\S+\s+±")


def kl_divergence(
    base_f16_gguf: Path,
    quant_gguf: Path,
    text_file: Path,
    *,
    tools: LlamaCpp,
    threads: int,
    ctx: int,
    chunks: int | None = None,
) -> dict:
    """llama-perplexity's KL divergence of ``quant_gguf`` from ``base_f16_gguf`` on ``text_file``
    (its first ``chunks`` chunks when given, else all of it).

    Its own definition, not fourbit's windows: llama-perplexity tokenizes the
    text, cuts it into chunks of ``ctx`` tokens (BOS first if the vocabulary
    asks for it) and compares the two models' next-token distributions over the
    second half of each chunk. The base model's log-probabilities (a file of
    about vocab × ctx/2 × chunks × 2 bytes) are kept in a temporary folder next
    to ``quant_gguf`` for the duration of the call.

    Returns mean KLD (± its uncertainty), its 99th percentile, the "same top"
    percentage (± uncertainty), both perplexities, the command lines and the
    pinned arithmetic settings.

    Each llama-perplexity run counts only if it exits 0 *and* prints its final
    lines: its KL mode returns 0 after most errors, and this commit's logger
    can lose the lines still queued when the program exits
    (ggml-org/llama.cpp#22142: the output is cut after the last chunk's number).
    A run lacking them is retried (ATTEMPTS runs in all).

    Long because of this docstring and the two command lines written out: the code is
    two llama-perplexity runs sharing one temporary folder, and the record they make.
    """
    base_f16_gguf, quant_gguf, text_file = Path(base_f16_gguf), Path(quant_gguf), Path(text_file)
    for path in (base_f16_gguf, quant_gguf, text_file):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
    common = ["-c", ctx, "-b", ctx, "-ub", ctx, "-t", threads, *common_arithmetic_flags()]
    if chunks is not None:
        common += ["--chunks", chunks]
    with tempfile.TemporaryDirectory(prefix=".kld-", dir=quant_gguf.parent) as temp:
        logits = Path(temp) / "base.logits"
        base_command = [
            tools.perplexity, "-m", base_f16_gguf, "-f", text_file, "--kl-divergence-base", logits,
            *common,
        ]
        log.info(
            "KL divergence: saving the log-probabilities of %s on %s",
            base_f16_gguf.name,
            text_file.name,
        )
        _run_perplexity(
            base_command,
            f"llama-perplexity saving base log-probabilities of {base_f16_gguf}",
            [_BASE_DONE],
        )
        kl_command = [
            tools.perplexity, "-m", quant_gguf, "--kl-divergence-base", logits, "--kl-divergence",
            *common,
        ]
        log.info("KL divergence: comparing %s with them", quant_gguf.name)
        output = _run_perplexity(
            kl_command,
            f"llama-perplexity KL divergence of {quant_gguf}",
            list(_KL_STATISTICS.values()),
            progress_what=f"KL divergence of {quant_gguf.name}",
        )
    return {
        **parse_kl_statistics(output),
        "ctx": ctx,
        "chunks": _count_chunks(output),
        "arithmetic": ARITHMETIC,
        "commands": {
            "base": [str(p) for p in base_command],
            "kl_divergence": [str(p) for p in kl_command],
        },
    }


def _count_chunks(output: str) -> int | None:
    found = _KL_CHUNKS.search(output)
    return int(found.group(1)) if found else None


def parse_kl_statistics(output: str) -> dict:
    """The final statistics of ``llama-perplexity --kl-divergence``, from its
    output (stdout and stderr together)."""
    found = {name: pattern.search(output) for name, pattern in _KL_STATISTICS.items()}
    missing = [name for name, match in found.items() if match is None]
    if missing:
        raise ToolError(f"llama-perplexity's KL output lacks {missing}; it ends:\n{tail(output)}")
    statistics = {}
    for name, match in found.items():
        statistics[name] = float(match.group(1))
        if match.re.groups == 2:
            statistics[f"{name}_uncertainty"] = float(match.group(2))
    return statistics


def _run_perplexity(
    command: list, what: str, required: list[re.Pattern], progress_what: str | None = None
) -> str:
    """Run llama-perplexity; retry (up to ATTEMPTS runs in all) while it fails or its output
    lacks a ``required`` line."""
    for attempt in range(1, ATTEMPTS + 1):
        chunks = _ChunkProgress(progress_what)
        try:
            output = run_tool(command, what, on_stdout_line=chunks.line, merge_stderr=True).stdout
        except ToolError as error:
            failure = str(error)
        else:
            missing = [p.pattern for p in required if not p.search(output)]
            if not missing:
                return output
            failure = f"{what} exited 0 but printed no {missing}; its output ends:\n{tail(output)}"
        if attempt < ATTEMPTS:
            log.warning("%s; retrying (attempt %d of %d)", failure.splitlines()[0], attempt + 1,
                        ATTEMPTS)
    raise ToolError(failure)


class _ChunkProgress:
    """Progress over llama-perplexity's KL chunk rows ("   3   12.3 ± 0.4 ...")."""

    def __init__(self, what: str | None):
        self.what, self.progress = what, None

    def line(self, text: str) -> None:
        if self.what is None:
            return
        total = _KL_CHUNKS.search(text)
        if total:
            self.progress = Progress(self.what, int(total.group(1)), "chunks")
        elif self.progress and _KL_CHUNK_ROW.match(text):
            self.progress.update()
