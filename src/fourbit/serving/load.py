"""One concurrency level: the load generator both servers get, so their numbers compare.

Why not vLLM's own serving benchmark (vllm.benchmarks.serve, ``vllm bench serve``). It
speaks the same streamed OpenAI completions API, but it counts a request's output tokens
from the ``usage`` field only in a chunk that has no ``choices``
(benchmarks/lib/endpoint_request_func.py: ``if choices := ...: ... elif usage := ...``).
vLLM sends usage in a chunk of its own; llama-server puts it in its last chunk, beside an
empty choice carrying the finish reason. vLLM's client then never sees llama-server's
count and, without a tokenizer, counts every llama-server request as 1 token (with one,
it re-tokenizes the text, which the benchmark itself says may miscount). This module is
the smallest client that reads usage wherever it comes, and otherwise measures as vLLM's
does: TTFT from sending to the first token's chunk, ITL between token chunks, end to end
to the last token's chunk, TPOT = (end to end - TTFT) / (output tokens - 1), numpy's
percentiles, output tok/s = all output tokens / the level's wall time.

A token's chunk is one with a choice whose text is not empty or which does not finish the
request: llama-server's final chunk (empty text, finish reason, usage) carries no token.
Every request must produce exactly ``output_tokens`` tokens by the server's own count
(EOS is ignored): an early stop would inflate tok/s, so the level is refused instead.
Requests are greedy (temperature 0) with prompts of token ids, so both servers see the
same tokens with no tokenizer in between. ``warmup`` untimed requests, at the same
concurrency, come first.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy

PERCENTILES = (50.0, 99.0)
TIMEOUT_S = 3600.0


class LoadError(RuntimeError):
    """A level's requests failed or did not produce their tokens."""


def load_generator() -> str:
    return ("fourbit.serving.load: streamed OpenAI completions over aiohttp "
            f"{aiohttp.__version__}, measured as vllm.benchmarks.serve measures")


@dataclass
class Request:
    """One request's timings (seconds from its sending) and the server's token count."""

    arrivals: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    error: str | None = None


def run_level(base_url: str, served_name: str, prompts: list[list[int]], *, output_tokens: int,
              concurrency: int, warmup: int, extra_body: dict | None = None) -> dict:
    """Send ``prompts`` (one request each) at most ``concurrency`` at a time, after
    ``warmup`` untimed requests; the level's figures as serve.json's passes hold them."""
    payload = {"model": served_name, "max_tokens": output_tokens, "ignore_eos": True,
               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
               **(extra_body or {})}
    done, seconds = asyncio.run(_level(f"{base_url}/v1/completions", payload, prompts,
                                       concurrency, warmup))
    return level_figures(done, seconds, output_tokens=output_tokens)


async def _level(url: str, payload: dict, prompts: list[list[int]], concurrency: int,
                 warmup: int) -> tuple[list[Request], float]:
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    # A new connection per request: llama-server closes a streamed response's connection,
    # and a pooled one then fails the next request's write ("Can not write request body").
    connector = aiohttp.TCPConnector(force_close=True, limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def limited(prompt: list[int]) -> Request:
            async with limit:
                return await _request(session, url, {**payload, "prompt": prompt})

        await asyncio.gather(*(limited(prompts[i % len(prompts)]) for i in range(warmup)))
        started = time.perf_counter()
        done = await asyncio.gather(*(limited(p) for p in prompts))
        return done, time.perf_counter() - started


async def _request(session: aiohttp.ClientSession, url: str, payload: dict) -> Request:
    request = Request()
    sent = time.perf_counter()
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                request.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return request
            async for line in response.content:  # server-sent events, one per line
                text = line.decode().strip()
                if not text.startswith("data:") or text == "data: [DONE]":
                    continue
                chunk = json.loads(text.removeprefix("data:"))
                if _carries_token(chunk):
                    request.arrivals.append(time.perf_counter() - sent)
                if chunk.get("usage"):
                    request.output_tokens = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
        request.error = f"{type(e).__name__}: {e}"
    return request


def _carries_token(chunk: dict) -> bool:
    return any(c.get("text") or c.get("finish_reason") is None for c in chunk.get("choices") or [])


def level_figures(done: list[Request], seconds: float, *, output_tokens: int) -> dict:
    """serve.json's figures of one timed level from its requests and its wall time."""
    failed = [r for r in done if r.error or not r.arrivals]
    if failed:
        errors = sorted({r.error or "no token received" for r in failed})[:3]
        raise LoadError(f"{len(failed)} of {len(done)} requests failed: {errors}")
    counts = [r.output_tokens for r in done]
    if any(n != output_tokens for n in counts):
        raise LoadError(
            f"requests produced {sorted(set(counts), key=str)} tokens by the server's count, not "
            f"{output_tokens}: the server stopped early or sent no usage (does it honour "
            "ignore_eos and stream_options.include_usage?), so tok/s would be wrong")
    per_request = {
        "ttft_ms": [r.arrivals[0] for r in done],
        "tpot_ms": [(r.arrivals[-1] - r.arrivals[0]) / (output_tokens - 1) for r in done],
        "itl_ms": [b - a for r in done for a, b in zip(r.arrivals, r.arrivals[1:])],
        "e2e_ms": [r.arrivals[-1] for r in done],
    }
    figures = {"output_tok_s": sum(counts) / seconds, "requests_per_s": len(done) / seconds,
               "completed": len(done), "failed": 0, "duration_s": seconds}
    for name, values in per_request.items():
        figures[name] = {f"p{p:g}": float(numpy.percentile(values, p)) * 1000 for p in PERCENTILES}
    return figures
