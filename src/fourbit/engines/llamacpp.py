"""llama.cpp as an engine: scores GGUF checkpoints on exactly the study's token ids.

Its unquantized baseline is the f16 GGUF of the untied model, so every llama.cpp
arm is compared with llama.cpp, not with another engine.
"""

from __future__ import annotations

from pathlib import Path

from fourbit.engines.base import HasOwnKlMode, Numerics, TimesPasses
from fourbit.llamacpp import ARITHMETIC
from fourbit.llamacpp.installed import find_llamacpp
from fourbit.llamacpp.perplexity import greedy_continuations as llamacpp_greedy
from fourbit.llamacpp.perplexity import kl_divergence
from fourbit.llamacpp.perplexity import score_windows as llamacpp_score
from fourbit.llamacpp.quantize import gguf_bits_per_weight
from fourbit.llamacpp.throughput import llama_bench


def _tools():
    tools = find_llamacpp()
    if tools is None:
        raise FileNotFoundError("llama.cpp is not built; the build_llamacpp rule builds it")
    return tools.check_complete()


def score_windows(checkpoint: Path, windows: list[list[int]], settings: dict, threads: int) -> list[dict]:
    return llamacpp_score(Path(checkpoint), windows, tools=_tools(), threads=settings["threads"])


def divergence_from_baseline(arm_checkpoint: Path, baseline_checkpoint: Path, text_file: Path,
                             settings: dict, *, ctx: int, chunks: int) -> dict:
    """llama-perplexity's own KL mode (fourbit.llamacpp.perplexity.kl_divergence): the
    arm's next-token distributions against the f16 baseline's, from full logits, over
    the second half of each of the first ``chunks`` chunks of ``ctx`` tokens of the text."""
    return kl_divergence(Path(baseline_checkpoint), Path(arm_checkpoint), Path(text_file),
                         tools=_tools(), threads=settings["threads"], ctx=ctx, chunks=chunks)


def greedy_continuations(checkpoint: Path, prompts: list[list[int]], new_tokens: int,
                         settings: dict) -> list[list[int]]:
    return llamacpp_greedy(Path(checkpoint), prompts, new_tokens, tools=_tools(),
                           threads=settings["threads"])


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


class LlamaCppEngine(TimesPasses, HasOwnKlMode):
    """The engine table's "llamacpp" (fourbit.engines.ENGINES): the functions above."""

    score_windows = staticmethod(score_windows)
    runtime = staticmethod(runtime)
    numerics = staticmethod(numerics)
    throughput = staticmethod(throughput)
    divergence_from_baseline = staticmethod(divergence_from_baseline)
    greedy_continuations = staticmethod(greedy_continuations)
