"""The environment the builtin model trains in: its threads fixed and, on x86-64, the
instruction set its kernels dispatch on pinned to AVX2.

torch and oneMKL read these variables once, when they load, so the process that trains
must have them from its start: :func:`training_environment` builds the environment of the
training process (:mod:`fourbit.inputs.builtin_training`), which checks that the pin took.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from fourbit import cpuinfo

# Waiting threads sleep instead of spinning: no effect on the numbers, but on a
# host where another job holds a core, two spinning threads train slower than one
# (each parallel op waits for its descheduled second thread; docs/running.md has
# the measurements).
WAIT_POLICY = "PASSIVE"

# The environment the training process runs in, on x86-64: what each library
# dispatches on, pinned to what every x86 host here has (AVX2), so an AVX-512
# host trains the same weights as an AVX2-only one. Written for torch 2.13.0+cpu
# (torch.__config__.show(): BLAS_INFO=mkl, oneMKL 2024.2, oneDNN v3.12.0).
PINNED_KERNELS = {
    # ATen's own vectorised kernels (elementwise ops, softmax, RMSNorm, the loss,
    # AdamW): torch picks default, avx2 or avx512 once, at import.
    "ATEN_CPU_CAPABILITY": "avx2",
    # oneMKL's SGEMM runs every float32 matmul of the training (MKL_VERBOSE=1
    # lists only SGEMM calls). On a non-Intel CPU oneMKL honours only the AUTO and
    # COMPATIBLE branches: MKL_CBWR=AVX2 runs as AUTO there (MKL_VERBOSE prints
    # CNR:AUTO on an AMD EPYC), and AUTO dispatches on the host's instruction set.
    # COMPATIBLE is SSE2 without the approximate rcpps/rsqrtps, whose results
    # differ between Intel and other vendors: the one branch that is the same on
    # every x86 CPU. With it CNR's "fixed cache sizes, deterministic reductions,
    # static scheduling" hold for the fixed thread count. Its cost: SSE2 GEMMs,
    # about 2.5x the training's CPU time (docs/running.md).
    "MKL_CBWR": "COMPATIBLE",
    # Exactly the threads asked for: MKL and OpenMP may otherwise use fewer than
    # requested on a host with fewer cores, which changes how sums are split.
    "MKL_DYNAMIC": "FALSE",
    "OMP_DYNAMIC": "FALSE",
    # oneDNN: float32 training in torch 2.13 does not call it (ONEDNN_VERBOSE=1
    # prints nothing), capped anyway in case another torch routes matmuls there.
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
# The pin is not the whole story: with it, AMD and Intel hosts still train different
# weights from the same corpus and library versions (docs/running.md). Which step
# (tokenizer or model) or library follows the vendor was not found, so the vendor is
# part of the model id.

# ATen's AVX2 kernels are compiled for AVX2 with FMA: a CPU without both would
# stop on an illegal instruction, so such a host is refused up front.
PINNED_CPU_FLAGS = ("avx2", "fma")
PINNED_ATEN_CAPABILITY = "AVX2"  # what torch.backends.cpu.get_cpu_capability() then reports
X86_64 = ("x86_64", "amd64")


def training_environment(outer: dict, threads: int, *, pin_kernels: bool = True) -> dict:
    """The training process's environment: ``outer`` with the thread count fixed and,
    on x86-64, PINNED_KERNELS over whatever ``outer`` sets for them."""
    env = {**outer, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "OMP_WAIT_POLICY": WAIT_POLICY}
    if pin_kernels and _is_x86_64():
        _require_cpu_flags(PINNED_CPU_FLAGS)
        env.update(PINNED_KERNELS)
    # The child imports this package from where the parent found it.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, outer.get("PYTHONPATH")]))
    return env


def _is_x86_64() -> bool:
    return platform.machine().lower() in X86_64


def _require_cpu_flags(flags: tuple[str, ...], cpuinfo_text: str | None = None) -> None:
    if cpuinfo_text is None and not cpuinfo.CPUINFO.is_file():
        return  # not Linux: torch itself then says whether it could run AVX2 kernels
    present = cpuinfo.isa_flags(cpuinfo_text)
    missing = [flag for flag in flags if flag not in present]
    if missing:
        raise RuntimeError(
            f"this CPU lacks {', '.join(missing)}: the builtin model trains on AVX2 kernels "
            "on every x86 host, so that every host trains the same weights under one id; "
            "use a host with AVX2 and FMA (any x86 CPU since 2013-2015), or model.source: "
            "hf or path"
        )


def cpu_vendor() -> str:
    """The x86 CPU's vendor string (vendor_id: "AuthenticAMD", "GenuineIntel"), or the
    machine's name where there is none (another architecture, or not Linux)."""
    return (_is_x86_64() and cpuinfo.vendor()) or platform.machine().lower()
