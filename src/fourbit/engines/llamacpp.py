"""llama.cpp as an engine: scores GGUF checkpoints on exactly the study's token ids.

Its unquantized baseline is the f16 GGUF of the untied model, so every llama.cpp
arm is compared with llama.cpp, not with another engine.
"""

from __future__ import annotations

from pathlib import Path

from fourbit.engines.base import ComparesPositions, Numerics, TimesPasses
from fourbit.llamacpp import ARITHMETIC
from fourbit.llamacpp.installed import find_llamacpp
from fourbit.llamacpp.perplexity import compare_windows
from fourbit.llamacpp.perplexity import greedy_continuations as llamacpp_greedy
from fourbit.llamacpp.perplexity import score_windows as llamacpp_score
from fourbit.llamacpp.quantize import gguf_bits_per_weight
from fourbit.llamacpp.throughput import llama_bench
from fourbit.metrics.kl import FULL


def _tools():
    tools = find_llamacpp()
    if tools is None:
        raise FileNotFoundError("llama.cpp is not built; the build_llamacpp rule builds it")
    return tools.check_complete()


def score_windows(checkpoint: Path, windows: list[list[int]], settings: dict, threads: int) -> list[dict]:
    return llamacpp_score(Path(checkpoint), windows, tools=_tools(), threads=settings["threads"])


def compare_with_baseline(arm_checkpoint: Path, baseline_checkpoint: Path, windows: list[list[int]],
                          settings: dict, threads: int, *, prompts: list[list[int]],
                          new_tokens: int) -> dict:
    """KL(P_base || P_arm) from full logits and top-1 agreement at positions 1..W-1 of each
    window (fourbit-score with the f16 baseline beside the arm: the positions and the
    definition of every other engine), and both models' greedy continuations."""
    tools, threads = _tools(), settings["threads"]
    arm, baseline = Path(arm_checkpoint), Path(baseline_checkpoint)
    compared = compare_windows(baseline, arm, windows, tools=tools, threads=threads)
    return {
        "method": FULL,
        **compared,
        "greedy_baseline": llamacpp_greedy(baseline, prompts, new_tokens, tools=tools, threads=threads),
        "greedy_arm": llamacpp_greedy(arm, prompts, new_tokens, tools=tools, threads=threads),
        "runtime": runtime(arm, settings),
        "baseline_runtime": runtime(baseline, settings),
    }


def runtime(checkpoint: Path, settings: dict) -> str:
    pinned = ", ".join(f"{k}={v}" for k, v in ARITHMETIC.items())
    return f"llama.cpp {_tools().commit[:7]} CPU ({Path(checkpoint).name}; {pinned})"


def numerics(checkpoint: Path, settings: dict, rows: int) -> Numerics:
    """ggml's CPU dot products of a quantized tensor round the activations to 8 bits
    (Q8_K for the K-quants, Q8_0 for the 32-blocks), at every batch size; F32 tensors
    (the dense expansion) run in float32. F16 and BF16 ones round activations to
    their 16-bit type, which the study's F32 controls never are."""
    types = set(gguf_bits_per_weight(Path(checkpoint), _tools().gguf_py)["tensor_types"].values())
    if types - {"F32", "F16", "BF16"}:
        return "int8_activations"
    return "exact" if types == {"F32"} else "bf16_activations"


def throughput(checkpoint: Path, settings: dict, threads: int, *, prompt_tokens: int,
               decode_tokens: int) -> dict:
    """One timed pass: llama-bench's pp512 and tg128 (the median of its repetitions).

    llama-bench measures exactly what fourbit's bench defines (a 512-token prompt;
    128 tokens after a one-token prompt), so only those sizes are accepted.
    """
    if (prompt_tokens, decode_tokens) != (512, 128):
        raise ValueError(
            f"llama-bench here runs pp512/tg128; bench asks pp{prompt_tokens}/tg{decode_tokens}"
        )
    result = llama_bench(Path(checkpoint), tools=_tools(), threads=threads, repetitions=2)
    return {"pp512_tok_s": result["pp512"]["median"], "tg128_tok_s": result["tg128"]["median"]}


class LlamaCppEngine(TimesPasses, ComparesPositions):
    """The engine table's "llamacpp" (fourbit.engines.ENGINES): the functions above."""

    score_windows = staticmethod(score_windows)
    runtime = staticmethod(runtime)
    numerics = staticmethod(numerics)
    throughput = staticmethod(throughput)
    compare_with_baseline = staticmethod(compare_with_baseline)
