"""One build of llama.cpp's tools with CMake: the vendored tree and the project that adds
fourbit-score and fourbit-imatrix written into a folder, configured and built there as :mod:`fourbit.llamacpp.recipe` says,
the binaries kept, the objects dropped, and what was built recorded in build-info.json.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

from fourbit.atomic import write_json
from fourbit.llamacpp import tail
from fourbit.llamacpp.recipe import (
    CMAKE_OPTIONS,
    IMATRIX_SOURCE,
    IMATRIX_TARGET,
    LLAMA_CPP_COMMIT,
    LLAMA_CPP_PYTHON_VERSION,
    SCORER_CMAKELISTS,
    SCORER_SOURCE,
    SCORER_TARGET,
    TOOL_TARGETS,
    imatrix_source,
)
from fourbit.llamacpp.sdist import SDIST_SHA256, extract_tree
from fourbit.progress import Progress
from fourbit.usercache import cpu_isa_flags

log = logging.getLogger("fourbit")


def compile_tools(sdist: Path, out: Path, jobs: int) -> None:
    """Build the tools from ``sdist`` into ``out`` (bin/, llama.cpp/, scorer/,
    build-info.json, build.log) with ``jobs`` parallel compile jobs."""
    started, cpu_before = time.monotonic(), _children_cpu_seconds()
    extract_tree(sdist, out / "llama.cpp")
    scorer = out / "scorer"
    scorer.mkdir()
    (scorer / "CMakeLists.txt").write_text(SCORER_CMAKELISTS)
    (scorer / f"{SCORER_TARGET}.cpp").write_text(SCORER_SOURCE)
    imatrix = (out / "llama.cpp" / IMATRIX_SOURCE).read_text(encoding="utf-8")
    (scorer / f"{IMATRIX_TARGET}.cpp").write_text(imatrix_source(imatrix), encoding="utf-8")
    build_dir = out / "build"
    targets = [*TOOL_TARGETS, SCORER_TARGET, IMATRIX_TARGET]
    with open(out / "build.log", "w") as build_log:
        _run_cmake(
            ["cmake", "-S", str(scorer), "-B", str(build_dir), "-G", "Unix Makefiles",
             *(f"-D{k}={v}" for k, v in CMAKE_OPTIONS.items())],
            build_log,
            "configuring llama.cpp",
        )
        _run_cmake(
            ["cmake", "--build", str(build_dir), "--target", *targets, "-j", str(jobs)],
            build_log,
            f"building llama.cpp ({', '.join(targets)}) with {jobs} jobs",
        )
    (out / "bin").mkdir()
    for target in targets:
        shutil.copy2(build_dir / "bin" / target, out / "bin" / target)
    shutil.rmtree(build_dir)  # objects and static libraries: hundreds of MB nobody reads again
    version = subprocess.run(
        [str(out / "bin" / "llama-bench"), "--version"], capture_output=True, text=True
    )
    if version.returncode != 0:
        raise RuntimeError(
            f"the freshly built llama-bench does not run:\n{tail(version.stdout + version.stderr)}"
        )
    info = {
        "llama_cpp_python_version": LLAMA_CPP_PYTHON_VERSION,
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "sdist_sha256": SDIST_SHA256,
        "cmake_options": CMAKE_OPTIONS,
        "targets": targets,
        "jobs": jobs,
        "cpu_isa_flags_sha256": hashlib.sha256(cpu_isa_flags().encode()).hexdigest(),
        "llama_bench_version": (version.stdout + version.stderr).strip(),
        "wall_seconds": round(time.monotonic() - started, 1),
        "cpu_seconds": round(_children_cpu_seconds() - cpu_before, 1),
        "binary_bytes": {t: (out / "bin" / t).stat().st_size for t in targets},
    }
    write_json(out / "build-info.json", info)
    log.info(
        "llama.cpp built in %.0f s wall, %.0f CPU-s; binaries %.1f MB",
        info["wall_seconds"],
        info["cpu_seconds"],
        sum(info["binary_bytes"].values()) / 1e6,
    )


_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def _run_cmake(command: list[str], build_log, what: str) -> None:
    """Run one CMake step, its output into build_log, "[ NN%]" lines into progress."""
    log.info("%s: %s", what, " ".join(command))
    build_log.write(f"$ {' '.join(command)}\n")
    progress, percent = Progress(what, total=100, unit="%", every_s=30), 0
    last_lines: deque[str] = deque(maxlen=40)
    # In its own process group, so that stopping this job stops make and every compiler under it.
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as process:
        try:
            for line in process.stdout:
                build_log.write(line)
                last_lines.append(line)
                reached = _PERCENT.match(line)
                if reached and int(reached.group(1)) > percent:
                    progress.update(int(reached.group(1)) - percent)
                    percent = int(reached.group(1))
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    build_log.flush()
    if process.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {process.returncode}); the end of its output:\n"
            f"{''.join(last_lines)}"
        )


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
