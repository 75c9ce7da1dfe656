"""Throughput of a GGUF model with llama-bench: prefill of 512 tokens (pp512) and
decode of 128 (tg128).

llama-bench times each test ``repetitions`` times after a warm-up run and
reports every repetition's tokens per second ("samples_ts"); a shared machine
makes some of them slow, so the summary is the median with the min and max.
Threads can be pinned to given cores with taskset, so that runs with the same
thread count use the same cores.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
from pathlib import Path

from fourbit.llamacpp import ARITHMETIC, ToolError, bench_arithmetic_flags, run_tool
from fourbit.llamacpp.installed import LlamaCpp

log = logging.getLogger("fourbit")

PROMPT_TOKENS, GENERATED_TOKENS = 512, 128
# llama-bench's defaults, pinned because the ubatch size decides how the prompt is cut into matmuls.
BATCH, UBATCH = 2048, 512


def llama_bench(
    gguf: Path,
    *,
    tools: LlamaCpp,
    threads: int,
    cores: list[int] | None = None,
    repetitions: int = 5,
) -> dict:
    """pp512 and tg128 in tokens/s as {"median", "min", "max", "samples"}, plus
    llama-bench's JSON and the command line."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF to benchmark {gguf} does not exist")
    if threads < 1 or repetitions < 1:
        raise ValueError(f"threads={threads} and repetitions={repetitions} must both be at least 1")
    pinning = []
    if cores:
        if threads > len(cores):
            raise ValueError(
                f"threads={threads} on {len(cores)} pinned cores {cores} would oversubscribe them; "
                f"give at least as many cores as threads"
            )
        taskset = shutil.which("taskset")
        if taskset is None:
            raise FileNotFoundError(
                "taskset (util-linux) is needed to pin llama-bench to cores but is not on PATH"
            )
        pinning = [taskset, "--cpu-list", ",".join(map(str, cores))]
    command = [str(part) for part in [
        *pinning, tools.bench, "-m", gguf,
        "-p", PROMPT_TOKENS, "-n", GENERATED_TOKENS, "-t", threads, "-r", repetitions,
        "-b", BATCH, "-ub", UBATCH, *bench_arithmetic_flags(), "-o", "json",
    ]]
    log.info(
        "benchmarking %s: %d threads%s, %d repetitions",
        gguf.name,
        threads,
        f" on cores {cores}" if cores else "",
        repetitions,
    )
    run = run_tool(command, f"llama-bench on {gguf}")
    results = parse_bench_json(run.stdout)
    log.info(
        "%s: pp512 %.1f t/s, tg128 %.1f t/s (medians)",
        gguf.name,
        results["pp512"]["median"],
        results["tg128"]["median"],
    )
    return {
        **results,
        "threads": threads,
        "cores": cores,
        "repetitions": repetitions,
        "arithmetic": ARITHMETIC,
        "command": command,
    }


def parse_bench_json(stdout: str) -> dict:
    """llama-bench's ``-o json`` output → {"pp512", "tg128", "raw"}, the first two as
    {"median", "min", "max", "samples"}."""
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as error:
        raise ToolError(
            f"llama-bench printed no valid JSON ({error}); it printed:\n{stdout[-2000:]}"
        ) from None
    summaries = {}
    for name, n_prompt, n_gen in (("pp512", PROMPT_TOKENS, 0), ("tg128", 0, GENERATED_TOKENS)):
        matching = [t for t in tests if t.get("n_prompt") == n_prompt and t.get("n_gen") == n_gen]
        if len(matching) != 1 or not matching[0].get("samples_ts"):
            raise ToolError(
                f"llama-bench's JSON has {len(matching)} {name} tests (n_prompt={n_prompt}, "
                f"n_gen={n_gen}) with samples; expected exactly one"
            )
        _check_arithmetic(matching[0], name)
        samples = [float(s) for s in matching[0]["samples_ts"]]
        summaries[name] = {
            "median": statistics.median(samples),
            "min": min(samples),
            "max": max(samples),
            "samples": samples,
        }
    return {**summaries, "raw": tests}


def _check_arithmetic(test: dict, name: str) -> None:
    """The settings llama-bench reports using must be the pinned ones."""
    expected = {
        "flash_attn": int(ARITHMETIC["flash_attn"]),
        "repack": ARITHMETIC["repack"],
        "type_k": ARITHMETIC["cache_type_k"],
        "type_v": ARITHMETIC["cache_type_v"],
    }
    differing = {k: test.get(k) for k, v in expected.items() if test.get(k) != v}
    if differing:
        raise ToolError(f"llama-bench ran {name} with {differing}, not the pinned {expected}")
