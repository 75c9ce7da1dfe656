"""One concurrency level, timed by vLLM's own serving benchmark (vllm.benchmarks.serve).

The same client drives both servers, so their numbers are comparable: vLLM's
``benchmark()`` coroutine (what ``vllm bench serve`` runs) with its "openai" backend,
streamed OpenAI completions. It works with llama-server as it is: llama-server accepts a
prompt of token ids, ``ignore_eos`` and ``stream_options.include_usage``, and its last
streamed chunk carries ``usage.completion_tokens``, which is what the benchmark counts
output tokens by. Each level checks that every request really produced ``output_tokens``
tokens (an early stop would inflate tok/s), and refuses the level otherwise.

Each request is greedy (temperature 0), its prompt given as token ids, so both servers
see the same tokens with no tokenizer of theirs in between. The benchmark's own
"initial single prompt test run" and ``warmup`` requests run before the timed ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging

import numpy

from fourbit.versions import vllm_version

log = logging.getLogger("fourbit")

PERCENTILES = (50.0, 99.0)


class LoadError(RuntimeError):
    """A level's requests failed or did not produce their tokens."""


def load_generator() -> str:
    return f"vllm.benchmarks.serve (vllm {vllm_version()})"


def run_level(base_url: str, served_name: str, prompts: list[list[int]], *, output_tokens: int,
              concurrency: int, warmup: int, extra_body: dict | None = None) -> dict:
    """Send ``prompts`` (one request each) at ``concurrency`` at a time, after ``warmup``
    untimed requests; the level's figures as serve.json's ``passes`` entries hold them."""
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import benchmark

    requests = [SampleRequest(prompt=list(p), prompt_len=len(p), expected_output_len=output_tokens)
                for p in prompts]
    printed = io.StringIO()  # its tables go to the job's log, below, not to stdout
    with contextlib.redirect_stdout(printed):
        result = asyncio.run(benchmark(
            task_type=_task_type(), endpoint_type="openai",
            api_url=f"{base_url}/v1/completions", base_url=base_url,
            model_id=served_name, model_name=served_name, tokenizer=None,
            input_requests=requests, logprobs=None, request_rate=float("inf"), burstiness=1.0,
            disable_tqdm=True, num_warmups=warmup, profile=False,
            selected_percentile_metrics=[], selected_percentiles=list(PERCENTILES),
            ignore_eos=True, goodput_config_dict={}, max_concurrency=concurrency,
            lora_modules=None, extra_headers=None,
            extra_body={"temperature": 0.0, **(extra_body or {})},
        ))
    log.info("%s at concurrency %d:\n%s", served_name, concurrency, printed.getvalue())
    return level_figures(result, requests=len(prompts), output_tokens=output_tokens)


def _task_type():
    from vllm.benchmarks.serve import TaskType

    return TaskType.GENERATION


def level_figures(result: dict, *, requests: int, output_tokens: int) -> dict:
    """serve.json's figures of one timed level from ``benchmark()``'s result."""
    failed = result.get("failed", requests - result["completed"])
    if result["completed"] != requests or failed:
        errors = sorted({e for e in result.get("errors", []) if e})[:3]
        raise LoadError(f"{failed} of {requests} requests failed: {errors}")
    short = [n for n in result["output_lens"] if n != output_tokens]
    if short:
        raise LoadError(f"{len(short)} of {requests} requests produced {sorted(set(short))} "
                        f"tokens, not {output_tokens}: the server stopped early (does it "
                        "honour ignore_eos?), so tok/s would be inflated")
    # benchmark() computes its latency percentiles only when given a tokenizer, which it
    # would use only to count tokens the usage field already counts; they are computed
    # here from its per-request timings, as it computes them (serve.py calculate_metrics:
    # TPOT = (latency - TTFT) / (output tokens - 1), numpy's percentiles).
    ttft = result["ttfts"]
    per_request = {
        "ttft_ms": ttft,
        "tpot_ms": [(e2e - first) / (n - 1) for e2e, first, n
                    in zip(result["latencies"], ttft, result["output_lens"])],
        "itl_ms": [gap for gaps in result["itls"] for gap in gaps],
        "e2e_ms": result["latencies"],
    }
    figures = {"output_tok_s": result["output_throughput"],
               "requests_per_s": result["request_throughput"],
               "completed": result["completed"], "failed": failed,
               "duration_s": result["duration"]}
    for name, seconds in per_request.items():
        figures[name] = {f"p{p:g}": float(numpy.percentile(seconds, p)) * 1000 for p in PERCENTILES}
    return figures
