"""Whether this machine can build llama.cpp's tools: the programs the build runs, on PATH."""

from __future__ import annotations

import shutil

# What building from source needs on PATH (Debian: apt-get install cmake build-essential).
BUILD_TOOLS = ("cmake", "make", "cc", "c++")


def missing_build_tools() -> list[str]:
    return [tool for tool in BUILD_TOOLS if shutil.which(tool) is None]


def require_build_tools() -> None:
    """Stop, naming what is missing, on a machine that cannot build the tools: checked by
    the build and, before any job, by the config check, since the workflow's first jobs
    (the model's training) run before its build job."""
    missing = missing_build_tools()
    if missing:
        raise FileNotFoundError(
            f"building llama.cpp's tools needs {', '.join(BUILD_TOOLS)} on PATH; missing: "
            f"{', '.join(missing)} (Debian: apt-get install cmake build-essential)"
        )
