"""A finished llama.cpp build in the cache: where it lies, the key that names it, and what
it holds.

Binaries built with ``-march=native`` may crash (illegal instruction) or run slower on
another CPU, so the key hashes the CPU's ISA flags as well as the version, the commit and
the recipe (:mod:`fourbit.llamacpp.recipe`)::

    ~/.cache/fourbit/llama.cpp/<llama-cpp-python version>-<commit>-isa<hash>-recipe<hash>/
        bin/         the programs (static: the folder can move): llama-quantize,
                     llama-bench, llama-imatrix, llama-server, fourbit-score, fourbit-imatrix
        llama.cpp/   the source tree (convert_hf_to_gguf.py, gguf-py/, conversion/ ...)
        scorer/      the CMake project that adds fourbit-score and fourbit-imatrix to
                     llama.cpp's build
        build-info.json, build.log
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fourbit.llamacpp import recipe
from fourbit.usercache import cache_home, cpu_key, short_hash


@dataclass(frozen=True)
class LlamaCpp:
    """One built llama.cpp tree: its programs, its converter and the gguf-py that goes with it."""

    root: Path
    quantize: Path
    bench: Path
    imatrix: Path  # llama-imatrix, as users run it (on text)
    server: Path  # llama-server, the OpenAI-compatible server (fourbit.serving.llamacpp)
    scorer: Path
    imatrix_ids: Path  # fourbit-imatrix: llama-imatrix on given token ids
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
            bench=bin_dir / "llama-bench",
            imatrix=bin_dir / "llama-imatrix",
            server=bin_dir / "llama-server",
            scorer=bin_dir / recipe.SCORER_TARGET,
            imatrix_ids=bin_dir / recipe.IMATRIX_TARGET,
            convert_script=tree / "convert_hf_to_gguf.py",
            gguf_py=tree / "gguf-py",
            commit=recipe.LLAMA_CPP_COMMIT,
            llama_cpp_python_version=recipe.LLAMA_CPP_PYTHON_VERSION,
        )

    @property
    def programs(self) -> tuple[Path, ...]:
        return (self.quantize, self.bench, self.imatrix, self.server,
                self.scorer, self.imatrix_ids)

    def check_complete(self) -> LlamaCpp:
        missing = [str(p) for p in (*self.programs, self.convert_script, self.gguf_py)
                   if not p.exists()]
        if missing:
            raise FileNotFoundError(
                f"the llama.cpp build in {self.root} lacks {missing}; delete that folder "
                f"so the next ensure_llamacpp() builds it again"
            )
        return self


def default_cache_root() -> Path:
    return cache_home() / "llama.cpp"


def build_key() -> str:
    recipe_json = json.dumps(
        {
            "cmake": recipe.CMAKE_OPTIONS,
            "targets": recipe.TOOL_TARGETS,
            "scorer_cmake": recipe.SCORER_CMAKELISTS,
            "scorer": recipe.SCORER_SOURCE,
            "imatrix_edits": recipe.IMATRIX_EDITS,
        },
        sort_keys=True,
    )
    return (
        f"{recipe.LLAMA_CPP_PYTHON_VERSION}-{recipe.LLAMA_CPP_COMMIT[:7]}"
        f"-{cpu_key()}-recipe{short_hash(recipe_json)}"
    )


def find_llamacpp(cache_root: Path | None = None) -> LlamaCpp | None:
    """The cached build for this machine and recipe, or None if there is none yet."""
    root = Path(cache_root or default_cache_root()) / build_key()
    return LlamaCpp.at(root).check_complete() if root.is_dir() else None
