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

So the build adds one small program, ``fourbit-score`` (:data:`SCORER_SOURCE`),
compiled in the same CMake build against the same static libllama as the tools.
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
from typing import TYPE_CHECKING

from fourbit.llamacpp import ARITHMETIC, ToolError, common_arithmetic_flags, run_tool, tail
from fourbit.progress import Progress

if TYPE_CHECKING:  # build.py imports this module for SCORER_SOURCE
    from fourbit.llamacpp.build import LlamaCpp

log = logging.getLogger("fourbit")

SCORER_TARGET = "fourbit-score"

SCORER_SOURCE = r"""// fourbit-score: teacher-forced negative log-likelihood of given token windows.
//
// usage: fourbit-score -m MODEL.gguf -f WINDOWS.txt -t THREADS [--greedy N]
//            --flash-attn on|off --repack|--no-repack --cache-type-k T --cache-type-v T
// WINDOWS.txt: one window per line, token ids separated by spaces, at least 2 per window.
// Each window is decoded as is (no BOS added) in one batch on an empty KV cache;
// positions 1..W-1 are scored, each from the logits at the position before it.
// stdout: "window <i> tokens <W-1> nll_sum <sum>" per window, then "done <n_windows>".
// With --greedy N, each window is a prompt instead, continued by exactly N tokens, each
// the argmax (lowest id on ties) of the last position's logits, end-of-generation tokens
// included: "greedy <i> ids <id> ... <id>" per window, then "done <n_windows>".
// Errors: a message on stderr naming the problem, exit status 2.
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

[[noreturn]] static void fail(const std::string & message) {
    fprintf(stderr, "fourbit-score: %s\n", message.c_str());
    exit(2);
}

static ggml_log_level last_level = GGML_LOG_LEVEL_NONE;

static void log_warnings_and_errors(ggml_log_level level, const char * text, void *) {
    if (level != GGML_LOG_LEVEL_CONT) {
        last_level = level;
    }
    if (last_level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

static ggml_type cache_type(const std::string & name) {
    static const std::map<std::string, ggml_type> types = {
        {"f32", GGML_TYPE_F32}, {"f16", GGML_TYPE_F16}, {"bf16", GGML_TYPE_BF16}, {"q8_0", GGML_TYPE_Q8_0},
    };
    auto found = types.find(name);
    if (found == types.end()) {
        fail("unknown KV cache type '" + name + "'; expected one of f32, f16, bf16, q8_0");
    }
    return found->second;
}

static std::vector<std::vector<llama_token>> read_windows(const std::string & path) {
    std::ifstream in(path);
    if (!in) {
        fail("cannot open windows file " + path);
    }
    std::vector<std::vector<llama_token>> windows;
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream ids(line);
        std::vector<llama_token> window;
        long long id;
        while (ids >> id) {
            window.push_back((llama_token) id);
        }
        if (!ids.eof()) {
            fail("line " + std::to_string(windows.size() + 1) + " of " + path + " holds something other than token ids");
        }
        if (window.size() < 2) {
            fail("window " + std::to_string(windows.size()) + " has " + std::to_string(window.size()) +
                 " tokens; at least 2 are needed (one of context, one scored)");
        }
        windows.push_back(window);
    }
    if (windows.empty()) {
        fail("no windows in " + path);
    }
    return windows;
}

int main(int argc, char ** argv) {
    std::string model_path, windows_path, flash_attn, type_k, type_v;
    int threads = 0;
    int repack = -1;
    int greedy_tokens = 0;
    for (int i = 1; i < argc; i++) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) {
                fail("missing value after " + arg);
            }
            return argv[++i];
        };
        if (arg == "-m") {
            model_path = value();
        } else if (arg == "-f") {
            windows_path = value();
        } else if (arg == "-t") {
            threads = std::atoi(value().c_str());
        } else if (arg == "--flash-attn") {
            flash_attn = value();
        } else if (arg == "--repack") {
            repack = 1;
        } else if (arg == "--greedy") {
            greedy_tokens = std::atoi(value().c_str());
            if (greedy_tokens <= 0) {
                fail("--greedy needs a number of tokens > 0");
            }
        } else if (arg == "--no-repack") {
            repack = 0;
        } else if (arg == "--cache-type-k") {
            type_k = value();
        } else if (arg == "--cache-type-v") {
            type_v = value();
        } else {
            fail("unknown argument " + arg);
        }
    }
    // Every setting that changes the arithmetic must be given: no silent defaults.
    if (model_path.empty() || windows_path.empty() || threads <= 0 || repack < 0 || type_k.empty() ||
        type_v.empty() || (flash_attn != "on" && flash_attn != "off")) {
        fail("all of -m, -f, -t N>0, --flash-attn on|off, --repack|--no-repack, --cache-type-k, --cache-type-v are required");
    }
    const auto windows = read_windows(windows_path);
    size_t longest = 0;
    for (const auto & window : windows) {
        longest = std::max(longest, window.size());
    }

    llama_log_set(log_warnings_and_errors, nullptr);
    llama_backend_init();

    llama_model_params model_params = llama_model_default_params();
    model_params.n_gpu_layers = 0;
    model_params.use_extra_bufts = repack == 1;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), model_params);
    if (model == nullptr) {
        fail("cannot load model " + model_path);
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    llama_context_params context_params = llama_context_default_params();
    context_params.n_ctx = (uint32_t) (longest + greedy_tokens);
    context_params.n_batch = (uint32_t) longest;
    context_params.n_ubatch = (uint32_t) longest;
    context_params.n_seq_max = 1;
    context_params.n_threads = threads;
    context_params.n_threads_batch = threads;
    context_params.flash_attn_type = flash_attn == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    context_params.type_k = cache_type(type_k);
    context_params.type_v = cache_type(type_v);
    context_params.no_perf = true;
    llama_context * context = llama_init_from_model(model, context_params);
    if (context == nullptr) {
        fail("cannot create a context of " + std::to_string(longest) + " tokens for " + model_path);
    }

    llama_batch batch = llama_batch_init((int32_t) longest, 0, 1);
    for (size_t w = 0; w < windows.size(); w++) {
        const auto & window = windows[w];
        const int n = (int) window.size();
        for (int j = 0; j < n; j++) {
            if (window[j] < 0 || window[j] >= n_vocab) {
                fail("window " + std::to_string(w) + " position " + std::to_string(j) + ": token id " +
                     std::to_string(window[j]) + " is outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
            }
            batch.token[j] = window[j];
            batch.pos[j] = j;
            batch.n_seq_id[j] = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j] = j < n - 1;
        }
        batch.n_tokens = n;
        llama_memory_clear(llama_get_memory(context), true);
        if (greedy_tokens > 0) {
            for (int j = 0; j < n; j++) {
                batch.logits[j] = j == n - 1;
            }
            printf("greedy %zu ids", w);
            for (int k = 0; k < greedy_tokens; k++) {
                if (llama_decode(context, batch) != 0) {
                    fail("llama_decode failed on prompt " + std::to_string(w) + " at token " + std::to_string(k));
                }
                const float * logits = llama_get_logits_ith(context, -1);
                llama_token next = (llama_token) (std::max_element(logits, logits + n_vocab) - logits);
                printf(" %d", next);
                batch.token[0] = next;
                batch.pos[0] = n + k;
                batch.n_seq_id[0] = 1;
                batch.seq_id[0][0] = 0;
                batch.logits[0] = 1;
                batch.n_tokens = 1;
            }
            printf("\n");
            fflush(stdout);
            continue;
        }
        if (llama_decode(context, batch) != 0) {
            fail("llama_decode failed on window " + std::to_string(w));
        }
        double nll_sum = 0.0;
        for (int j = 0; j < n - 1; j++) {
            const float * logits = llama_get_logits_ith(context, j);
            double top = logits[0];
            for (int v = 1; v < n_vocab; v++) {
                top = std::max(top, (double) logits[v]);
            }
            double sum = 0.0;
            for (int v = 0; v < n_vocab; v++) {
                sum += std::exp((double) logits[v] - top);
            }
            nll_sum += top + std::log(sum) - (double) logits[window[j + 1]];
        }
        printf("window %zu tokens %d nll_sum %.17g\n", w, n - 1, nll_sum);
        fflush(stdout);
    }
    printf("done %zu\n", windows.size());

    llama_batch_free(batch);
    llama_free(context);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
"""


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
# Runs of llama-perplexity before giving up: its logger loses its last lines about once in
# ten runs here, more often on a loaded machine (seen twice in a row under load).
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
    (ggml-org/llama.cpp#22142; seen here once in ten runs, output cut after the
    last chunk's number). A run lacking them is retried (ATTEMPTS runs in all).
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
