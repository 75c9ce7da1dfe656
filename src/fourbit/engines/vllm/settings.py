"""The vllm engine's settings, one frozen object built at each public entry.

The workflow passes an engine's settings as a mapping: the study config's
``engines.vllm`` (or ``engines.vllm_native``) block, which config validation has
already filled from the schema (src/fourbit/schemas/config.schema.yaml), plus its
name and the cache folder the step chose. The schema is the only source of
defaults: a key it fills that is missing here is an error naming the key, never a
fallback value of this module's own (which could contradict the schema, as a
"bfloat16" fallback once did when the schema said float32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# Keys of the engine's config block (engines.vllm, engines.vllm_native); the schema gives
# each a default. Only the plugin has knobs: engines.vllm_native has no ``quant``.
CONFIG_KEYS = ("dtype", "enforce_eager", "kv_cache_gib", "max_num_seqs")
PLUGIN_KEYS = ("quant",)
# Keys the step that runs the engine adds: its name, and where compile caches go.
STEP_KEYS = ("name", "cache_root")


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    """What a vllm engine run is configured by. No field has a default (see the module
    docstring); ``from_engine`` builds it from the workflow's mapping."""

    dtype: str  # activations and dense weights (vLLM's dtype=)
    enforce_eager: bool  # eager (starts in seconds) or vLLM's compiled mode
    kv_cache_gib: float  # the KV cache vLLM allocates; unset, it would take most of the RAM
    max_num_seqs: int  # sequences per engine step (1: a window's score never depends on batching)
    quant: dict[str, Any]  # the plugin's quantization_config overrides (schema: engines.vllm.quant)
    # True: fourbit's plugin runs every checkpoint it reads; False: vLLM's own method for
    # the checkpoint (fourbit.engines.vllm_native)
    plugin: bool
    # vLLM's own method only: True lets it take its W4A8 AMX kernel (int4_scaled_mm_cpu) for
    # bfloat16 layers on an AMX host (fourbit.engines.vllm_native_w4a8); False keeps it on
    # W4A16 (cpu_gemm_wna16) everywhere (lifecycle's VLLM_CPU_INT4_W4A8)
    w4a8_amx: bool
    cache_root: str | None  # this checkpoint's compile caches; None: vLLM's default folders

    @classmethod
    def from_engine(cls, settings: Mapping[str, Any], *, plugin: bool,
                    w4a8_amx: bool = False) -> VllmSettings:
        """From the workflow's mapping; ``plugin`` is the engine's (True for vllm, False
        for vllm_native and vllm_native_w4a8), ``w4a8_amx`` True for vllm_native_w4a8."""
        keys = CONFIG_KEYS + PLUGIN_KEYS if plugin else CONFIG_KEYS
        block = "engines.vllm" if plugin else "engines.vllm_native"
        missing = [key for key in keys if key not in settings]
        if missing:
            raise ValueError(
                f"{block} settings lack {missing} (given: {sorted(settings)}); the study "
                "config's validation fills them from the schema, and a direct call gets them "
                f"from fourbit.schema.block({block!r}, given)"
            )
        unknown = sorted(set(settings) - set(keys) - set(STEP_KEYS))
        if unknown:
            raise ValueError(f"{block} settings: unknown key(s) {unknown}; "
                             f"allowed: {sorted(keys + STEP_KEYS)}")
        return cls(
            dtype=str(settings["dtype"]),
            enforce_eager=bool(settings["enforce_eager"]),
            kv_cache_gib=float(settings["kv_cache_gib"]),
            max_num_seqs=int(settings["max_num_seqs"]),
            quant=dict(settings["quant"]) if plugin else {},
            plugin=plugin,
            w4a8_amx=w4a8_amx and not plugin,
            # Optional: only the steps choose a cache folder; a direct call may leave it out.
            cache_root=_optional_path(settings.get("cache_root")),
        )

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_gib * (1 << 30))

    @property
    def quantization(self) -> str | None:
        """open_llm's quantization: "auto" (fourbit's plugin for every checkpoint it reads)
        with the plugin; None with vLLM's kernel, so that vLLM picks its own method from
        the checkpoint's quantization_config."""
        return "auto" if self.plugin else None


def _optional_path(value: Any) -> str | None:
    return None if value is None else str(value)


def resolve(settings: Mapping[str, Any] | VllmSettings) -> VllmSettings:
    """The settings object of a public entry: built from the workflow's mapping (the vllm
    engine's, so fourbit's plugin), or passed through when the caller built it already
    (fourbit.engines.vllm_native builds its own with vLLM's kernel; the bench worker
    receives one)."""
    if isinstance(settings, VllmSettings):
        return settings
    return VllmSettings.from_engine(settings, plugin=True)
