"""What fourbit builds of llama.cpp: the pinned source, the CMake options, the targets and
the CMake project that adds fourbit-score and fourbit-imatrix. All of it is hashed into the cached build's name
(:func:`fourbit.llamacpp.installed.build_key`), so a change here builds afresh.

The code is compiled for this CPU (``GGML_NATIVE=ON``, i.e. ``-march=native``):
llama.cpp is here to be compared at its best on the host being measured.
"""

from __future__ import annotations

import platform
from importlib.resources import files

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"

TOOL_TARGETS = (
    "llama-quantize", "llama-bench", "llama-imatrix", "llama-server",
)
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
    # llama-server: the serve step's OpenAI-compatible server (fourbit.serving.llamacpp).
    "LLAMA_BUILD_SERVER": "ON",
    # Its web UI is not needed to serve the API, and the only ways this commit gets one are
    # npm (LLAMA_BUILD_UI) or a download from a Hugging Face bucket (LLAMA_USE_PREBUILT_UI;
    # scripts/ui-assets.cmake). With both off the script embeds an empty asset table: the
    # server runs without its UI page, offline.
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "FETCHCONTENT_FULLY_DISCONNECTED": "ON",  # never fetch anything at configure time
    "LLAMA_BUILD_COMMIT": LLAMA_CPP_COMMIT[
        :7
    ],  # the extracted tree has no git history to read it from
    "LLAMA_BUILD_NUMBER": "0",
}
# ggml's AMX matmul (compiled in wherever -march=native implies AMX: Intel Xeon since
# Sapphire Rapids) crashes with SIGSEGV in ggml_backend_amx_mul_mat on Q4_K_M
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
# fourbit-imatrix: llama-imatrix reading token ids instead of text, so an importance matrix
# is computed on exactly the windows a gptq arm calibrates on (imatrix_ids.cpp says how).
# It is llama.cpp's own tools/imatrix/imatrix.cpp with IMATRIX_EDITS made, each (old, new)
# found exactly once or the build stops (edited); the edits are part of the recipe.
IMATRIX_TARGET = "fourbit-imatrix"
IMATRIX_SOURCE = "tools/imatrix/imatrix.cpp"
IMATRIX_EDITS = (
    ("std::vector<llama_token> tokens = common_tokenize(ctx, params.prompt, true, params.parse_special);",
     "std::vector<llama_token> tokens = fourbit_token_ids(ctx, params.prompt);"),
    ("static bool compute_imatrix(",
     files("fourbit.llamacpp").joinpath("imatrix_ids.cpp").read_text(encoding="utf-8")
     + "\nstatic bool compute_imatrix("),
)


def edited(path: str, original: str, edits: tuple[tuple[str, str], ...]) -> str:
    """``original`` (the text of ``path`` in the vendored tree) with ``edits`` made, each
    (old, new) found exactly once, or RuntimeError naming the file and the text."""
    for old, new in edits:
        if original.count(old) != 1:
            raise RuntimeError(
                f"{path} holds {original.count(old)} copies of {old.splitlines()[0]!r}, not one: "
                f"this llama.cpp is not the one fourbit's edits were written for")
        original = original.replace(old, new)
    return original


def imatrix_source(original: str) -> str:
    """fourbit-imatrix's source: llama-imatrix's ``original`` with IMATRIX_EDITS made."""
    return edited(IMATRIX_SOURCE, original, IMATRIX_EDITS)


# Adds fourbit-score and fourbit-imatrix to llama.cpp's own build, against the same static
# libraries (fourbit-imatrix links what tools/imatrix/CMakeLists.txt links).
SCORER_CMAKELISTS = f"""cmake_minimum_required(VERSION 3.14)
project(fourbit_llamacpp C CXX)
add_subdirectory(${{CMAKE_CURRENT_SOURCE_DIR}}/../llama.cpp llama.cpp)
add_executable({SCORER_TARGET} {SCORER_TARGET}.cpp)
target_link_libraries({SCORER_TARGET} PRIVATE llama)
target_compile_features({SCORER_TARGET} PRIVATE cxx_std_17)
set_target_properties({SCORER_TARGET} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${{CMAKE_BINARY_DIR}}/bin)
add_executable({IMATRIX_TARGET} {IMATRIX_TARGET}.cpp)
target_link_libraries({IMATRIX_TARGET} PRIVATE llama-common llama ${{CMAKE_THREAD_LIBS_INIT}})
target_compile_features({IMATRIX_TARGET} PRIVATE cxx_std_17)
set_target_properties({IMATRIX_TARGET} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${{CMAKE_BINARY_DIR}}/bin)
"""
