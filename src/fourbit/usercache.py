"""fourbit's caches outside the results tree, one per user: what a key rebuilds exactly
and costs minutes to rebuild (llama.cpp's tools, inductor's compiled kernels). They live
under $XDG_CACHE_HOME/fourbit (default ~/.cache/fourbit). Where what is cached is machine
code for this CPU, its key names the CPU's instruction sets, so the nodes of a cluster
that share a home folder but differ in CPU never load each other's code."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from fourbit.cpuinfo import isa_flags


def cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fourbit"


def cpu_isa_flags() -> str:
    """The CPU's instruction-set flags, sorted, as one string (what a native build's
    cache key names)."""
    return " ".join(sorted(isa_flags()))


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def cpu_key() -> str:
    """"isa<hash of the CPU's flags>": the part of a cache key that names this CPU."""
    return f"isa{short_hash(cpu_isa_flags())}"
