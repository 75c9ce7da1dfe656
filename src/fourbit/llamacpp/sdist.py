"""llama-cpp-python's sdist, the source of the llama.cpp fourbit builds: fetched with pip,
checked against a pinned sha256, and its ``vendor/llama.cpp`` extracted after checking the
commit it vendors.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from fourbit.llamacpp import tail
from fourbit.llamacpp.recipe import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION

log = logging.getLogger("fourbit")

SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
# The file PyPI serves for this release; any other is refused.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_SDIST_TOP = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
_VENDORED_TREE = _SDIST_TOP + "vendor/llama.cpp/"
_VENDORED_COMMIT_FILE = _SDIST_TOP + ".git/modules/vendor/llama.cpp/HEAD"
# Neither the build nor the converter reads these (113 MB of test vocabularies and
# documentation); the .git file points into the sdist's own git folder, absent here.
_UNUSED_TOP_LEVEL = {"models", "docs", ".git"}

# What fourbit.inputs.supported reads of the converter: its architectures and its
# tokenizer probe (convert_hf_to_gguf.py, and the conversion/ package where a version has one).
CONVERTER_SOURCES = ("convert_hf_to_gguf.py", "conversion")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_sdist(folder: Path) -> Path:
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


def extract_tree(sdist: Path, destination: Path, only: tuple[str, ...] | None = None) -> None:
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
