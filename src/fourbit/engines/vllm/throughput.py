"""Timing the vllm engine as llama-bench times llama.cpp: pp512 and tg128 at batch 1.

bench_engine opens one engine and times passes in it; throughput is one pass in an
engine of its own; throughput_session keeps one engine open for a whole bench job in
a worker process (fourbit.engines.vllm.throughput_worker). fourbit.steps.bench runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fourbit.engines.limits import prompt_exceeds_positions
from fourbit.engines.vllm.lifecycle import dtype_name, llm_options, open_llm
from fourbit.engines.vllm.settings import VllmSettings, resolve
from fourbit.threads import torch_threads

log = logging.getLogger(__name__)


def synthetic_prompt(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """``length`` token ids drawn uniformly from the vocabulary: timing needs no real text."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def _check_prompt_fits(checkpoint: str | os.PathLike, prompt_tokens: int) -> None:
    """Refuse a prompt longer than the model's positions; one that fills them all is fine
    (_engine_env allows the extra slot vLLM asks for the sampled token, never fed back)."""
    refusal = prompt_exceeds_positions(json.loads((Path(checkpoint) / "config.json").read_text()),
                                       prompt_tokens)
    if refusal:
        raise ValueError(f"{checkpoint}: {refusal}")


# The KV cache a bench engine gets: room for its one sequence four times over (vLLM
# rounds up to whole blocks), and at least this much.
BENCH_KV_CACHE_MIN_BYTES = 16 << 20


def bench_kv_cache_bytes(config: Mapping[str, Any], tokens: int, dtype: str) -> int:
    """A KV cache for one ``tokens``-long sequence of the model ``config`` describes.

    A bench runs batch 1, and the bench job holds every arm's engine open at once: the
    engines' scoring cache (kv_cache_gib, allocated and touched at start) would cost each
    one a gigabyte it never uses.
    """
    import torch

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = (2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads)
                 * head_dim * getattr(torch, dtype_name(dtype)).itemsize)  # K and V
    return max(4 * tokens * per_token, BENCH_KV_CACHE_MIN_BYTES)


@contextlib.contextmanager
def bench_engine(
    checkpoint: str | os.PathLike,
    settings: Mapping[str, Any] | VllmSettings,
    threads: int,
    *,
    prompt_tokens: int,
    decode_tokens: int,
    start: dict[str, float] | None = None,
) -> Iterator[Callable[[], tuple[dict[str, float], dict[str, float]]]]:
    """An engine opened for timing; yields a function that times one pass in it.
    Long because what a pass times and what it leaves untimed is said here, once.

    A pass measures pp and tg as llama-bench does: batch 1, synthetic ids, one untimed
    run first, then each test repeated.

        pp   a ``prompt_tokens`` prompt -> 1 output token; rate = prompt_tokens / time
        tg   a 1-token prompt -> 1 token, and -> decode_tokens + 1 tokens; the first run
             subtracted leaves exactly decode_tokens decode steps (bench.passes.tg_from_runs)

    The untimed run (one pp) is there because the engine idled while the other engines of
    the job were timed: the first run after that pays for cold caches and waking cores
    (measured here: a 512-token prefill 10-50% slower than the next). Each test then
    repeats until it has run bench.passes.MIN_TIMED_SECONDS, and the pass reports its
    tokens over its total time. The engine's start (weight loading, KV cache
    allocation) is not timed, nor is one short untimed generation right after it that
    pays for first-call costs (allocator growth, kernel selection). Greedy, EOS ignored
    (every run produces all its tokens, checked), no detokenization, no prefix cache.
    Each call returns
    ({"pp<prompt_tokens>_tok_s": .., "tg<decode_tokens>_tok_s": ..} over the wall clock,
    the same over this process's CPU time). On a shared host other jobs' turns on the
    cores stretch wall time but not CPU time (threads spinning while they wait still
    count, so the CPU clock is clean only with one thread).

    ``start``, if given, is filled with what the untimed start cost (start_record).
    """
    from fourbit.bench.passes import repeat_for

    settings = resolve(settings)
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    prompt = synthetic_prompt(prompt_tokens, config["vocab_size"])
    max_model_len = max(prompt_tokens, 1 + decode_tokens) + 1
    _check_prompt_fits(checkpoint, prompt_tokens)
    options = {**llm_options(settings, checkpoint),
               "kv_cache_bytes": bench_kv_cache_bytes(config, max_model_len, settings.dtype),
               "max_num_seqs": 1}

    # The whole prompt in one forward step, as llama-bench's pp512 evaluates it.
    opened: dict[str, float] = {}
    compiled_before = compile_seconds()
    with (torch_threads(threads),
          open_llm(checkpoint, max_model_len=max_model_len, max_num_batched_tokens=prompt_tokens,
                   stats=opened, **options) as llm):
        timed = functools.partial(_timed, llm, checkpoint)
        first_run_s, _ = timed(prompt[:-1], 2)  # untimed: a prefill and a decode step, in range
        if start is not None:
            start |= start_record(settings, opened["engine_init_s"],
                                  compile_seconds() - compiled_before, first_run_s)

        def one_pass() -> tuple[dict[str, float], dict[str, float]]:
            timed(prompt, 1)  # untimed: wakes the cores and caches after idling
            prefills = repeat_for(lambda: timed(prompt, 1), lambda run: run[0])
            decodes = repeat_for(  # tg's two runs, repeated as a pair
                lambda: (timed(prompt[:1], 1), timed(prompt[:1], decode_tokens + 1)),
                lambda pair: pair[1][0])
            return (_rates(prompt_tokens, decode_tokens, prefills, decodes, clock=0),
                    _rates(prompt_tokens, decode_tokens, prefills, decodes, clock=1))

        yield one_pass


def start_record(settings: VllmSettings, engine_init_s: float, compile_s: float,
                 first_run_s: float) -> dict[str, Any]:
    """What an engine's untimed start cost: its mode, the seconds vLLM's constructor took
    (loading, the KV cache, and in compiled mode compiling, in its warm-up run), the seconds
    of it spent compiling (compile_seconds), and the untimed first generation's."""
    return {"mode": "eager" if settings.enforce_eager else "compiled",
            "engine_init_s": round(engine_init_s, 3), "compile_s": round(compile_s, 3),
            "first_run_s": round(first_run_s, 3)}


# torch._dynamo's timers of a whole compile, capture and backend: vLLM's DYNAMO_TRACE_ONCE
# compiles ahead of time (fullgraph_capture), a torch.compile'd function on first call
# (entire_frame_compile). Neither runs inside the other.
WHOLE_COMPILE_TIMERS = ("fullgraph_capture", "entire_frame_compile")


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far, by torch._dynamo's own
    timers. vLLM's count (CompilationConfig.compilation_time) stays 0 on the CPU: it counts
    VLLM_COMPILE only, and the CPU platform compiles with DYNAMO_TRACE_ONCE (lifecycle's
    docstring)."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(sum(compilation_time_metrics.get(timer, ())) for timer in WHOLE_COMPILE_TIMERS))


def _rates(prompt_tokens: int, decode_tokens: int, prefills: list, decodes: list, *,
           clock: int) -> dict[str, float]:
    """One pass's rates on one clock (0 wall, 1 CPU): ``prefills`` [(wall, cpu)],
    ``decodes`` [((wall, cpu) of the 1-token run, of the n-token run)]."""
    from fourbit.bench.passes import pass_rates

    return pass_rates(prompt_tokens, decode_tokens, [run[clock] for run in prefills],
                      [(one[clock], n[clock]) for one, n in decodes])


def _timed(llm: Any, checkpoint: str | os.PathLike, ids: list[int],
           outputs: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one greedy generation of ``outputs`` tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=outputs, temperature=0.0, ignore_eos=True, detokenize=False)
    start, start_cpu = time.perf_counter(), time.process_time()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    produced = len(out[0].outputs[0].token_ids)
    if produced != outputs:
        raise RuntimeError(
            f"{checkpoint}: asked for {outputs} output tokens, got {produced}; a timed run "
            "must produce every token it is credited with (ignore_eos=True)"
        )
    return seconds, cpu_seconds


def throughput(
    checkpoint: str | os.PathLike,
    settings: Mapping[str, Any] | VllmSettings,
    threads: int,
    *,
    prompt_tokens: int,
    decode_tokens: int,
    cpu_rates: dict[str, float] | None = None,
) -> dict[str, float]:
    """One timed pass in an engine of its own (see bench_engine), in a worker process of its
    own (throughput_session's); wall-clock rates. Not in this process: engines opened one
    after another in one process decode more slowly each time (docs/measurement.md).

    ``cpu_rates``, if given, is filled with the same rates over the worker's CPU time.
    """
    with throughput_session(checkpoint, settings, threads, prompt_tokens=prompt_tokens,
                            decode_tokens=decode_tokens) as one_pass:
        wall = one_pass()
    if cpu_rates is not None:
        cpu_rates.update(one_pass.cpu_rates)
    return wall


def _wait_until_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Return once ``pid`` is stopped (or gone): kill() only queues SIGSTOP, and on a
    loaded host the worker may run on for a while before it takes it, during the next
    engine's timed pass."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.001)
    log.warning("bench worker %d did not stop within %.0f s of SIGSTOP", pid, timeout_s)


@contextlib.contextmanager
def throughput_session(
    checkpoint: str | os.PathLike,
    settings: Mapping[str, Any] | VllmSettings,
    threads: int,
    *,
    prompt_tokens: int,
    decode_tokens: int,
) -> Iterator[Callable[[], dict[str, float]]]:
    """One engine held open for a whole bench job; each call times one pass in it.

    The engine lives in a worker process (fourbit.engines.vllm.throughput_worker, which says
    why), started here with this process's CPU affinity and stopped on exit. Entering
    returns as soon as the worker is launched, so all the engines of a job start side by
    side; ``wait_ready`` (or the first call) waits until its engine is open.

    Between its passes the worker is stopped (SIGSTOP; SIGCONT before the next pass). An
    idle vLLM engine is not idle: its gloo threads wake up, 0.8-1.2% of a core per
    engine here, and each wake-up can preempt a thread of the engine being timed, whose
    step then waits for it at the next barrier. With the default study's nine engines
    open and running, the busiest core before a pass reached 8-14% (2-4% stopped), and
    the side timed second came out faster (tg128 ratio medians 0.418 and 0.455 with the
    arm first, 0.466 and 0.488 with the baseline first, in two runs; 0.431 and 0.430
    stopped). Stopped, the idle engines take no turn at all.
    """
    # The worker gets the settings object whole, so it runs exactly these (vllm_native's too).
    request = {"checkpoint": str(checkpoint), "settings": dataclasses.asdict(resolve(settings)),
               "threads": int(threads),
               "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens}
    worker = _BenchWorker(checkpoint, request)
    try:
        yield worker
    finally:
        worker.close()


class _BenchWorker:
    """One fourbit.engines.vllm.throughput_worker process and its side of the protocol; called,
    it times one pass. ``peak_rss_bytes``: the worker's largest resident set so far (None
    until its engine is open); ``start``: what its engine's untimed start cost
    (bench_engine's ``start``; None until it is open); ``cpu_rates``: the last pass's rates
    over the worker's CPU time."""

    def __init__(self, checkpoint: str | os.PathLike, request: dict[str, Any]):
        self.checkpoint = checkpoint
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fourbit.engines.vllm.throughput_worker", json.dumps(request)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.waiting_for_ready = True
        self.peak_rss_bytes: int | None = None
        self.start: dict[str, Any] | None = None
        self.cpu_rates: dict[str, float] | None = None

    def _gone(self) -> RuntimeError:
        return RuntimeError(f"the bench worker for {self.checkpoint} exited with "
                            f"{self.process.wait()} without answering (killed for memory?); its "
                            "output is above in this job's log")

    def _reply(self, key: str) -> Any:
        line = self.process.stdout.readline()
        if not line:
            raise self._gone()
        message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"the bench worker for {self.checkpoint} failed:\n{message['error']}")
        self.peak_rss_bytes = message["peak_rss_bytes"]
        self.cpu_rates = message.get("cpu_rates")
        return message[key]

    def wait_ready(self) -> None:
        """Return once the engine is open (loaded, compiled, warmed up), the worker stopped
        until its first pass as it is between passes (fourbit.bench.starts says why)."""
        if self.waiting_for_ready:
            self.start = self._reply("ready")
            self.waiting_for_ready = False
            self.process.send_signal(signal.SIGSTOP)
            _wait_until_stopped(self.process.pid)

    def __call__(self) -> dict[str, float]:
        self.wait_ready()
        self.process.send_signal(signal.SIGCONT)
        try:
            self.process.stdin.write("pass\n")
            self.process.stdin.flush()
        except OSError as e:  # the worker died between passes
            raise self._gone() from e
        rates = self._reply("rates")
        self.process.send_signal(signal.SIGSTOP)  # it has answered: it waits for the next line
        _wait_until_stopped(self.process.pid)
        return rates

    def close(self) -> None:
        """Let the worker run on to the end of its input and exit (killed after 120 s); one
        whose engine is still starting (the job failed meanwhile) is killed at once, rather
        than left to compile for nothing."""
        worker = self.process
        if self.waiting_for_ready and worker.poll() is None:
            worker.kill()
            worker.wait()
            return
        with contextlib.suppress(ProcessLookupError):
            worker.send_signal(signal.SIGCONT)
        with contextlib.suppress(OSError):
            worker.stdin.close()
        try:
            worker.wait(timeout=120)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        if worker.returncode and not self.waiting_for_ready:
            log.warning("the bench worker for %s exited with %d on close", self.checkpoint,
                        worker.returncode)
