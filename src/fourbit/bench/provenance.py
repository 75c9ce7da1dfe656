"""What a throughput number was measured on: host, ISA, cores, load, versions, settings.

A tokens/s figure without these cannot be compared or reproduced: the same
build differs by ISA (AVX2 vs AVX-512 vs AMX), by thread placement, by what
else ran, and by library versions and their environment switches.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from fourbit.bench.hostprobe import vllm_runtimes
from fourbit.cpuinfo import first_processor, isa_flags
from fourbit.versions import VLLM_DISTRIBUTIONS, installed_version

ISA_FLAGS_OF_INTEREST = (
    "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8",
)
# Runtime switches that change speed. ATEN_CPU_CAPABILITY picks torch's kernel
# build (it changes even tinygemm's packed layout); LD_PRELOAD is how vLLM CPU
# brings in tcmalloc and Intel OpenMP.
ENV_PREFIXES = ("OMP_", "VLLM_", "KMP_", "MKL_", "TORCH", "ATEN_CPU_CAPABILITY", "LD_PRELOAD")
# Names ending so hold credentials (e.g. VLLM_API_KEY); their values are never recorded.
SECRET_SUFFIXES = ("KEY", "TOKEN", "SECRET", "PASSWORD")
# Distribution names, looked up without importing (importing vllm starts its
# platform detection and plugin loading).
PACKAGES = {
    "torch": ("torch",), "transformers": ("transformers",), "vllm": VLLM_DISTRIBUTIONS,
    "numpy": ("numpy",), "safetensors": ("safetensors",), "sentencepiece": ("sentencepiece",),
    "snakemake": ("snakemake",),
}


def provenance(threads: int, cores: list[int]) -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = isa_flags(cpuinfo)
    return {
        "cpu_model": _cpu_model(cpuinfo),
        "isa": {flag: flag in flags for flag in ISA_FLAGS_OF_INTEREST},
        # Every way vLLM can run a 4-bit arm, and whether this CPU can (the report's list).
        "vllm_runtimes": vllm_runtimes(flags),
        "cores": sorted(cores),
        "threads": threads,
        "affinity": sorted(os.sched_getaffinity(0)),
        "load_average": list(os.getloadavg()),
        "kernel": platform.release(),
        "versions": {"python": platform.python_version(), **_package_versions()},
        "env": _speed_env(os.environ),
    }


def _cpu_model(cpuinfo: str) -> str:
    name = first_processor(cpuinfo).get("model name")
    return name or f"unknown ({platform.machine()}: /proc/cpuinfo has no 'model name')"


def _package_versions() -> dict:
    """{distribution: version}; a package not installed appears as {name: None}."""
    versions = {}
    for name, distributions in PACKAGES.items():
        found = {d: version for d in distributions if (version := installed_version(d))}
        versions.update(found or {name: None})
    return versions


def _speed_env(environ: dict) -> dict:
    return {
        name: "<redacted>" if name.endswith(SECRET_SUFFIXES) else value
        for name, value in sorted(environ.items())
        if name.startswith(ENV_PREFIXES)
    }
