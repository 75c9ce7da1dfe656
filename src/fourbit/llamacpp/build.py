"""Build llama.cpp's CPU tools from the source llama-cpp-python's sdist vendors,
once per machine kind.

``ensure_llamacpp()`` returns the cached build, or makes it: fetch the sdist
with pip (checked against a pinned sha256), extract its ``vendor/llama.cpp``,
configure with CMake (CPU only, Release, static, no network) and build
llama-quantize, llama-perplexity, llama-bench and fourbit-score (``scorer.cpp``;
:mod:`fourbit.llamacpp.perplexity` says why). About 10 CPU-minutes (15 minutes on 2 busy cores);
37 MB of binaries, as each of the four links libllama and ggml statically.

The code is compiled for this CPU (``GGML_NATIVE=ON``, i.e. ``-march=native``):
llama.cpp is here to be compared at its best on the host being measured. Such
binaries may crash (illegal instruction) or run slower on another CPU, so the
cache folder is keyed by a hash of the CPU's ISA flags as well as by version,
commit and a hash of the recipe (CMake options, targets, scorer source):

    ~/.cache/fourbit/llama.cpp/<llama-cpp-python version>-<commit>-isa<hash>-recipe<hash>/
        bin/         the four programs (static: the folder can move)
        llama.cpp/   the source tree (convert_hf_to_gguf.py, gguf-py/, conversion/ ...)
        scorer/      the CMake project that adds fourbit-score to llama.cpp's build
        build-info.json, build.log

The folder is built under a temporary name and renamed when complete, so an
interrupted build never looks finished; a file lock makes concurrent jobs wait
for one build instead of building twice.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path
from typing import Iterator

from fourbit.atomic import atomic_dir, write_json
from fourbit.llamacpp import tail
from fourbit.progress import Progress, setup_logging
from fourbit.usercache import cache_home, cpu_isa_flags, cpu_key, short_hash

log = logging.getLogger("fourbit")

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
# Recorded from the first fetch from PyPI.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
_SDIST_TOP = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
_VENDORED_TREE = _SDIST_TOP + "vendor/llama.cpp/"
_VENDORED_COMMIT_FILE = _SDIST_TOP + ".git/modules/vendor/llama.cpp/HEAD"
# Neither the build nor the converter reads these (113 MB of test vocabularies and
# documentation); the .git file points into the sdist's own git folder, absent here.
_UNUSED_TOP_LEVEL = {"models", "docs", ".git"}

TOOL_TARGETS = ("llama-quantize", "llama-perplexity", "llama-bench")
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    # Static binaries keep working after the folder is renamed into place.
    "BUILD_SHARED_LIBS": "OFF",
    "GGML_NATIVE": "ON",
    "GGML_CPU": "ON",
    "GGML_CUDA": "OFF",
    "GGML_METAL": "OFF",
    "GGML_VULKAN": "OFF",
    "GGML_BLAS": "OFF",  # a system BLAS would change the matmul arithmetic
    "GGML_OPENMP": "ON",
    "GGML_CCACHE": "OFF",  # the same compile wherever it runs
    # This commit has no libcurl any more (LLAMA_CURL only warns that it is
    # deprecated); downloads go through cpp-httplib, without TLS when this is OFF.
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_BUILD_COMMON": "ON",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "FETCHCONTENT_FULLY_DISCONNECTED": "ON",  # never fetch anything at configure time
    "LLAMA_BUILD_COMMIT": LLAMA_CPP_COMMIT[
        :7
    ],  # the extracted tree has no git history to read it from
    "LLAMA_BUILD_NUMBER": "0",
}
# ggml's AMX matmul (compiled in wherever -march=native implies AMX: Intel Xeon since
# Sapphire Rapids) crashed here: scoring the default study's Q4_K_M on a 2-core Intel Xeon
# with amx_int8 died with SIGSEGV in ggml_backend_amx_mul_mat, as upstream reports
# (ggml-org/llama.cpp#20824, open; #16315: wrong results for Q4_0/Q4_1). GCC lets an
# explicit -mno-* outrank -march=native in either order (checked with GCC 12), so such a
# host builds the AVX-512 VNNI kernels every other AVX-512 host runs.
if platform.machine().lower() in ("x86_64", "amd64"):
    NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_OPTIONS |= {"CMAKE_C_FLAGS": NO_AMX, "CMAKE_CXX_FLAGS": NO_AMX}
# fourbit-score (fourbit.llamacpp.perplexity says why it exists) is C++ shipped beside this
# module. Its text is part of the recipe hash, so these bytes name the cached build: edit the
# file and the next ensure_llamacpp() builds afresh.
SCORER_TARGET = "fourbit-score"
SCORER_SOURCE = files("fourbit.llamacpp").joinpath("scorer.cpp").read_text(encoding="utf-8")
# Adds fourbit-score to llama.cpp's own build, against the same static libllama.
SCORER_CMAKELISTS = f"""cmake_minimum_required(VERSION 3.14)
project(fourbit_llamacpp C CXX)
add_subdirectory(${{CMAKE_CURRENT_SOURCE_DIR}}/../llama.cpp llama.cpp)
add_executable({SCORER_TARGET} {SCORER_TARGET}.cpp)
target_link_libraries({SCORER_TARGET} PRIVATE llama)
target_compile_features({SCORER_TARGET} PRIVATE cxx_std_17)
set_target_properties({SCORER_TARGET} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${{CMAKE_BINARY_DIR}}/bin)
"""


@dataclass(frozen=True)
class LlamaCpp:
    """One built llama.cpp tree: its programs, its converter and the gguf-py that goes with it."""

    root: Path
    quantize: Path
    perplexity: Path
    bench: Path
    scorer: Path
    convert_script: Path
    gguf_py: Path
    commit: str
    llama_cpp_python_version: str

    @classmethod
    def at(cls, root: Path) -> LlamaCpp:
        bin_dir, tree = root / "bin", root / "llama.cpp"
        return cls(
            root=root,
            quantize=bin_dir / "llama-quantize",
            perplexity=bin_dir / "llama-perplexity",
            bench=bin_dir / "llama-bench",
            scorer=bin_dir / SCORER_TARGET,
            convert_script=tree / "convert_hf_to_gguf.py",
            gguf_py=tree / "gguf-py",
            commit=LLAMA_CPP_COMMIT,
            llama_cpp_python_version=LLAMA_CPP_PYTHON_VERSION,
        )

    def check_complete(self) -> LlamaCpp:
        missing = [
            str(p)
            for p in (
                self.quantize,
                self.perplexity,
                self.bench,
                self.scorer,
                self.convert_script,
                self.gguf_py,
            )
            if not p.exists()
        ]
        if missing:
            raise FileNotFoundError(
                f"the llama.cpp build in {self.root} lacks {missing}; delete that folder "
                f"so the next ensure_llamacpp() builds it again"
            )
        return self


def default_cache_root() -> Path:
    return cache_home() / "llama.cpp"


def build_key() -> str:
    recipe = json.dumps(
        {
            "cmake": CMAKE_OPTIONS,
            "targets": TOOL_TARGETS,
            "scorer_cmake": SCORER_CMAKELISTS,
            "scorer": SCORER_SOURCE,
        },
        sort_keys=True,
    )
    return (
        f"{LLAMA_CPP_PYTHON_VERSION}-{LLAMA_CPP_COMMIT[:7]}"
        f"-{cpu_key()}-recipe{short_hash(recipe)}"
    )


def find_llamacpp(cache_root: Path | None = None) -> LlamaCpp | None:
    """The cached build for this machine and recipe, or None if there is none yet."""
    root = Path(cache_root or default_cache_root()) / build_key()
    return LlamaCpp.at(root).check_complete() if root.is_dir() else None


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


def ensure_llamacpp(cache_root: Path | None = None, jobs: int | None = None) -> LlamaCpp:
    """The cached build for this machine and recipe, built first if there is none
    (about 10 CPU-minutes)."""
    cache_root = Path(cache_root or default_cache_root())
    key = build_key()
    found = find_llamacpp(cache_root)
    if found:
        log.info("using the llama.cpp build in %s", found.root)
        return found
    require_build_tools()  # before the download and the build, not in the middle of it
    cache_root.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_root / f"{key}.lock"):
        found = find_llamacpp(cache_root)  # another job may have finished it while this one waited
        if found:
            return found
        _remove_interrupted_builds(cache_root, key)
        sdist = _fetch_sdist(cache_root / "sdist")
        with atomic_dir(cache_root / key) as temp:
            _build(sdist, temp, jobs or len(os.sched_getaffinity(0)))
        return LlamaCpp.at(cache_root / key).check_complete()


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another job holds %s and is building llama.cpp; waiting for it", lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # the lock goes with the file handle


def _remove_interrupted_builds(cache_root: Path, key: str) -> None:
    """Delete temporaries of killed builds (atomic_dir names them .<key>.tmp-<pid>); only
    called under the lock, so none of them belongs to a running build."""
    for stale in cache_root.glob(f".{key}.tmp-*"):
        log.info("removing %s, left by an interrupted build", stale)
        shutil.rmtree(stale)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_sdist(folder: Path) -> Path:
    """llama-cpp-python's sdist from PyPI (kept in ``folder``), checked against SDIST_SHA256."""
    sdist = folder / SDIST_NAME
    if sdist.is_file() and _sha256(sdist) == SDIST_SHA256:
        return sdist
    folder.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s from PyPI with pip", SDIST_NAME)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as download:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", download,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        fetched = Path(download) / SDIST_NAME
        if result.returncode != 0 or not fetched.is_file():
            raise RuntimeError(
                f"`{' '.join(command)}` failed (exit {result.returncode}) "
                f"or wrote no {SDIST_NAME}:\n"
                f"{tail(result.stdout + result.stderr)}"
            )
        actual = _sha256(fetched)
        if actual != SDIST_SHA256:
            raise RuntimeError(
                f"{SDIST_NAME} from PyPI has sha256 {actual}, expected {SDIST_SHA256}: the release "
                f"was replaced or the download is corrupt; do not build from it"
            )
        os.replace(fetched, sdist)
    return sdist


def _extract_tree(sdist: Path, destination: Path, only: tuple[str, ...] | None = None) -> None:
    """Extract vendor/llama.cpp (without its unused parts, or only the top-level entries
    ``only`` names) and check its commit."""
    with tarfile.open(sdist) as tar:
        commit = tar.extractfile(_VENDORED_COMMIT_FILE).read().decode().strip()
        if commit != LLAMA_CPP_COMMIT:
            raise RuntimeError(f"{sdist} vendors llama.cpp {commit}, expected {LLAMA_CPP_COMMIT}")
        members = []
        for member in tar.getmembers():
            relative = member.name.removeprefix(_VENDORED_TREE)
            top = relative.split("/")[0]
            wanted = top in only if only is not None else top not in _UNUSED_TOP_LEVEL
            if relative != member.name and wanted:
                member.name = relative
                members.append(member)
        tar.extractall(destination, members=members, filter="data")


# What fourbit.inputs.supported reads of the converter: its architectures and its
# tokenizer probe (convert_hf_to_gguf.py, and the conversion/ package where a version has one).
CONVERTER_SOURCES = ("convert_hf_to_gguf.py", "conversion")


def converter_source(cache_root: Path | None = None) -> Path:
    """The pinned llama.cpp's converter sources, without building it: what the config check
    reads before any job on a machine whose first job will build llama.cpp. Extracted
    once from the same checked sdist the build uses (fetched now, so the build reuses it)."""
    cache_root = Path(cache_root or default_cache_root())
    tree = cache_root / f"converter-{LLAMA_CPP_COMMIT[:7]}"
    if (tree / CONVERTER_SOURCES[0]).is_file():
        return tree
    cache_root.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_root / f"{tree.name}.lock"):
        if not (tree / CONVERTER_SOURCES[0]).is_file():
            sdist = _fetch_sdist(cache_root / "sdist")
            with atomic_dir(tree) as temp:
                _extract_tree(sdist, temp, only=CONVERTER_SOURCES)
    return tree


def _build(sdist: Path, out: Path, jobs: int) -> None:
    started, cpu_before = time.monotonic(), _children_cpu_seconds()
    _extract_tree(sdist, out / "llama.cpp")
    scorer = out / "scorer"
    scorer.mkdir()
    (scorer / "CMakeLists.txt").write_text(SCORER_CMAKELISTS)
    (scorer / f"{SCORER_TARGET}.cpp").write_text(SCORER_SOURCE)
    build_dir = out / "build"
    targets = [*TOOL_TARGETS, SCORER_TARGET]
    with open(out / "build.log", "w") as build_log:
        _run_cmake(
            [
                "cmake",
                "-S",
                str(scorer),
                "-B",
                str(build_dir),
                "-G",
                "Unix Makefiles",
                *(f"-D{k}={v}" for k, v in CMAKE_OPTIONS.items()),
            ],
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Build (or find) the cached llama.cpp tools; print their paths."
    )
    parser.add_argument("--cache-root", type=Path, help=f"default: {default_cache_root()}")
    parser.add_argument(
        "--jobs", type=int, help="parallel compile jobs (default: the usable cores)"
    )
    args = parser.parse_args()
    setup_logging()
    # `kill` (Snakemake cancelling a job) then unwinds like Ctrl-C: the compilers are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    tools = ensure_llamacpp(args.cache_root, args.jobs)
    print(json.dumps({k: str(v) for k, v in asdict(tools).items()}, indent=2))


if __name__ == "__main__":
    main()
