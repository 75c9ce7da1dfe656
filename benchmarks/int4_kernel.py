"""Batch-1 times of every CPU linear kernel fourbit can run, side by side, at a real model's shapes.

    .venv/bin/python benchmarks/int4_kernel.py [--threads 2] [--group-size 128] [--json out.json]
    .venv/bin/python benchmarks/int4_kernel.py --instructions   # callgrind counts instead
    .venv/bin/python benchmarks/int4_kernel.py --activation-error  # W4A8's roundings vs ggml's
    .venv/bin/python benchmarks/int4_kernel.py --rows 4 8 16  # steps of several rows
    .venv/bin/python benchmarks/int4_kernel.py --model smollm2-135m ...  # its shapes instead

For each linear shape of Qwen2.5-0.5B as vLLM runs it (q/k/v merged: 1152 x 896, o: 896 x
896, gate/up merged: 9728 x 896, down: 896 x 4864, the untied lm_head: 151936 x 896; or
SmolLM2-135M's: 960 x 576, 576 x 576, 3072 x 576, 576 x 1536, 49152 x 576) it
times one row x [1, K] through

    dense fp32 / dense bf16    F.linear on W_hat (what the unquantized baselines run)
    tinygemm bf16 / fp32       aten._weight_int4pack_mm_for_cpu (bf16 is vectorized on x86)
    fourbit W4A16 / W4A8 / W4A8_GROUP   kernels/int4_cpu.py
    fourbit W8A16              the same weights on the 8-bit grid (int4_cpu.linear_int8)

on random 4-bit weights (asymmetric, float16 scales). Decode streams every weight from
memory once per token, so each measurement cycles through enough copies of the weights
that they cannot stay in the last-level cache; otherwise a 0.5 MB layer would be timed
from L2. It then prints a whole token's linears (every layer + head), the effective weight
bandwidth (resident bytes / time) against the triad bandwidth of fourbit.bench.bandwidth
measured in the same run and threads, and the resident bytes of each layout against bf16.

With ``--rows M ...``, steps of M activation rows instead (a batched decode step: one row
per running sequence): per shape and for fourbit's W4A16, W4A8_GROUP and W8A16, the
multi-row kernels against the one-row kernels on the same step (FOURBIT_INT4_MULTIROW_MIN
raised past M), the two alternated in one process, and a whole step's linears; then, at
groups of 64 * n, the 8-bit matrices' W8A16 against W8A8 on the same steps.

Wall-clock numbers mean something only on idle cores: the load average is printed before
and after, and the run says when it was above a quarter of the threads. On a busy host,
``--instructions`` counts instructions per weight instead (valgrind's callgrind, one
thread, repeatable under load), at down_proj's shape (896 x 4864: K is a multiple of
Q4_K's 256), for fourbit's two numerics and for ggml's own AVX2 row dots, Q4_0 x Q8_0,
Q4_1 x Q8_1 (asymmetric, like fourbit's grids) and Q4_K x Q8_K (Q4_K_M's main type),
and the repacked 8-row GEMVs llama.cpp's CPU backend runs Q4_0 and Q4_K weights with on
AVX2 (arch/x86/repack.cpp), all compiled unchanged from the llama.cpp tree `make
llamacpp` built (src/fourbit/kernels/csrc/ggml_count/harness.c).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fourbit.bench.bandwidth import last_level_cache_bytes, measure_bandwidth
from fourbit.kernels import int4_cpu, tinygemm
from fourbit.quant.int8 import quantize_int8
from fourbit.quant.qweight import QuantizedWeight


# (name, N, K, per token) of each linear as vLLM runs it (q/k/v and gate/up merged), head untied
def model_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 layers: int, vocab: int) -> list[tuple[str, int, int, int]]:
    return [
        ("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden, layers),
        ("o_proj", hidden, heads * head_dim, layers),
        ("gate_up_proj", 2 * intermediate, hidden, layers),
        ("down_proj", hidden, intermediate, layers),
        ("lm_head", vocab, hidden, 1),
    ]


MODELS = {
    "qwen2.5-0.5b": model_shapes(896, 4864, 14, 2, 64, 24, 151936),
    "smollm2-135m": model_shapes(576, 1536, 9, 3, 64, 30, 49152),
}
METHODS = ("dense fp32", "dense bf16", "tinygemm bf16", "tinygemm fp32", "fourbit W4A16",
           "fourbit W4A16 (avx2)",
           "fourbit W4A8", "fourbit W4A8_GROUP", "fourbit W4A8 (avx2)",
           "fourbit W4A8_GROUP (avx2)", "fourbit W8A16")


def random_qweight(n: int, k: int, g: int, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.uint8)
    scales = (0.002 + 0.03 * torch.rand(n, k // g, generator=gen)).half()
    return QuantizedWeight(codes, scales, zeros, g)


def build(method: str, qw: QuantizedWeight):
    """(call(x) -> y, resident tensors) for one copy of the weight in ``method``'s layout."""
    g = qw.group_size
    n = qw.shape[0]
    if method.startswith("dense"):
        w = qw.dequantize(torch.float32 if "fp32" in method else torch.bfloat16)
        return (lambda x: F.linear(x, w)), [w]
    if method.startswith("tinygemm"):
        dtype = torch.bfloat16 if "bf16" in method else torch.float32
        packed, sz = tinygemm.to_tinygemm(qw, dtype)
        return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)), [
            packed, sz]
    if method in ("fourbit W8A16", "fourbit W8A8"):  # the matrix on the 8-bit grid (quantize_head: 8, mixed_precision)
        eight = quantize_int8(qw.dequantize(), g)
        codes, scales = eight.codes, eight.scales.float()
        int8_activations = method.endswith("W8A8")
        return (lambda x: int4_cpu.linear_int8(x, codes, scales, g, int8_activations)), [codes, scales]
    packed = int4_cpu.repack(qw)
    numerics, _, forced = method.removeprefix("fourbit ").lower().partition(" (")
    on = forced.rstrip(")")  # "(avx2)": the AVX2 code on a host whose own path is wider
    assert packed.shape[0] == n
    return (lambda x: int4_cpu.linear(x, packed, numerics, on)), [
        packed.packed, packed.scales, packed.zeros]


def input_dtype(method: str) -> torch.dtype:
    return torch.bfloat16 if "bf16" in method else torch.float32


def resident_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def time_method(method: str, qw: QuantizedWeight, x: torch.Tensor, llc: int, min_time: float,
                max_time: float) -> dict:
    """Median seconds per call, each call on the next of enough copies to defeat the LLC."""
    first, tensors = build(method, qw)
    one = resident_bytes(tensors)
    copies = max(1, math.ceil(2 * llc / one))
    calls = [first] + [build(method, qw)[0] for _ in range(copies - 1)]
    xi = x.to(input_dtype(method))
    for call in calls:  # warm: page faults, thread pool, first-call dispatch
        call(xi)
    times: list[float] = []
    started = time.perf_counter()
    while True:
        for call in calls:
            t0 = time.perf_counter()
            call(xi)
            times.append(time.perf_counter() - t0)
        spent = time.perf_counter() - started
        if (spent >= min_time and len(times) >= 5) or spent >= max_time:
            break
    return {"seconds": statistics.median(times), "calls": len(times), "copies": copies,
            "resident_bytes": one}


def load_average() -> float:
    return os.getloadavg()[0]


COUNT_SHAPE = (896, 4864)  # down_proj: K a multiple of 256 (Q4_K) and of every group size
HARNESS = Path(__file__).resolve().parents[1] / "src/fourbit/kernels/csrc/ggml_count"
_ONE_CALL = """
import sys, torch
from fourbit.kernels import int4_cpu
from fourbit.quant.qweight import QuantizedWeight
torch.set_num_threads(1)
numerics, n, k, g = sys.argv[1], *map(int, sys.argv[2:])
qw = QuantizedWeight(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // g).half(),
                     torch.randint(0, 16, (n, k // g), dtype=torch.uint8), g)
int4_cpu.linear(torch.randn(1, k), int4_cpu.repack(qw), numerics, "avx2")  # valgrind runs no AVX-512
"""


def _callgrind(command: list[str], function: str, out: Path) -> int:
    """Instructions executed inside ``function`` (callees included) by ``command``."""
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                    f"--toggle-collect={function}", *command], check=True, capture_output=True)
    totals = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.M)
    return int(totals.group(1))


def count_instructions(group_size: int) -> dict[str, float]:
    """Instructions per weight of one batch-1 linear at COUNT_SHAPE, one thread."""
    from fourbit.llamacpp.installed import find_llamacpp

    n, k = COUNT_SHAPE
    per_weight: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        script = tmp / "one_call.py"
        script.write_text(_ONE_CALL)
        for numerics in int4_cpu.NUMERICS:
            count = _callgrind([sys.executable, str(script), numerics, str(n), str(k),
                                str(group_size)], f"*::rows_{numerics}(*)", tmp / numerics)
            per_weight[f"fourbit {numerics.upper()} (G={group_size})"] = count / (n * k)
        built = find_llamacpp()
        if built is None:
            print("no llama.cpp build (make llamacpp): ggml's counts left out")
            return per_weight
        ggml = built.root / "llama.cpp" / "ggml"
        includes = [f"-I{ggml / d}" for d in ("include", "src", "src/ggml-cpu")]
        flags = ["-O3", "-mavx2", "-mfma", "-mf16c", *includes]
        objects = []
        for compiler, source in (("gcc", ggml / "src/ggml-cpu/arch/x86/quants.c"),
                                 ("g++", ggml / "src/ggml-cpu/arch/x86/repack.cpp"),
                                 ("gcc", HARNESS / "harness.c"), ("gcc", HARNESS / "stubs.c")):
            objects.append(str(tmp / f"{source.stem}.o"))
            std = ["-std=c++17"] if compiler == "g++" else []
            subprocess.run([compiler, *std, *flags, "-c", str(source), "-o", objects[-1]],
                           check=True)
        harness = tmp / "harness"
        subprocess.run(["g++", *objects, "-o", str(harness), "-lm"], check=True)
        for kind, label in (("q4_0", "ggml Q4_0 x Q8_0"), ("q4_1", "ggml Q4_1 x Q8_1"),
                            ("q4_K", "ggml Q4_K x Q8_K"), ("q4_0x8", "ggml Q4_0 8x8 GEMV"),
                            ("q4_Kx8", "ggml Q4_K 8x8 GEMV")):
            count = _callgrind([str(harness), kind, str(n), str(k)], f"run_{kind}", tmp / kind)
            per_weight[label] = count / (n * k)
    return per_weight


def activation_error() -> None:
    """Relative output error ||W x_rounded - W x|| / ||W x|| at down_proj's shape for the
    kernel's activation roundings (run by the kernel itself, float32 d: W4A8 per 32
    columns, W4A8_GROUP per group of 128) and for the ones llama.cpp applies (Q8_0 with a
    float16 d; Q8_K per 256 columns, which Q4_K_M's dot products use), on Gaussian and
    heavy-tailed (Student t, 3 dof) activations."""

    def q8(x: torch.Tensor, block: int, fp16_d: bool) -> torch.Tensor:
        m, k = x.shape
        b = x.reshape(m, k // block, block)  # [M, K] -> [M, K/block, block]
        amax = b.abs().amax(-1, keepdim=True)
        d = (amax / 127).half().float() if fp16_d else amax / 127
        q = torch.round(b * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
        return (q * d).reshape(m, k)

    n, k = COUNT_SHAPE
    gen = torch.Generator().manual_seed(0)
    qw = random_qweight(n, k, 128, seed=0)
    w = qw.dequantize().double()
    packed = int4_cpu.repack(qw)
    torch.manual_seed(0)
    inputs = {"gaussian": torch.randn(64, k, generator=gen),
              "student t (3 dof)": torch.distributions.StudentT(3.0).sample((64, k))}
    for name, x in inputs.items():
        exact = x.double() @ w.T
        rows = {"fourbit W4A8 (kernel)": int4_cpu.linear(x, packed, "w4a8").double(),
                "fourbit W4A8_GROUP (kernel)": int4_cpu.linear(x, packed, "w4a8_group").double(),
                "Q8_0, fp16 d (ggml)": q8(x, 32, True).double() @ w.T,
                "Q8_K, per 256 (ggml)": q8(x, 256, False).double() @ w.T}
        for label, y in rows.items():
            err = ((y - exact).norm() / exact.norm()).item()
            print(f"  {name:<18} {label:<28} relative output error {err:.2e}")


ROW_METHODS = ("fourbit W4A16", "fourbit W4A8_GROUP", "fourbit W8A16")
ONE_ROW_ONLY = str(1 << 30)  # FOURBIT_INT4_MULTIROW_MIN past any step: the one-row kernels


def time_steps(shapes: list, rows: list[int], group_size: int, llc: int, min_time: float,
               max_time: float, passes: int = 3) -> dict:
    """Seconds per call of each ROW_METHODS kernel at each shape and step of M rows, with
    the multi-row kernels and with the one-row kernels, alternated pass by pass (min over
    passes of each measurement's median)."""
    results: dict = {}
    for i, (name, n, k, _) in enumerate(shapes):
        qw = random_qweight(n, k, group_size, seed=i)
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            for method in ROW_METHODS:
                times = {"multi-row": [], "one-row": []}
                for number in range(passes):
                    order = ("multi-row", "one-row") if number % 2 == 0 else ("one-row", "multi-row")
                    for kind in order:
                        if kind == "one-row":
                            os.environ["FOURBIT_INT4_MULTIROW_MIN"] = ONE_ROW_ONLY
                        try:
                            times[kind].append(
                                time_method(method, qw, x, llc, min_time, max_time)["seconds"])
                        finally:
                            os.environ.pop("FOURBIT_INT4_MULTIROW_MIN", None)
                results[(name, m, method)] = {kind: min(t) for kind, t in times.items()}
        del qw
    return results


EIGHT_BIT_METHODS = ("fourbit W8A16", "fourbit W8A8")


def time_eight_bit(shapes: list, rows: list[int], group_size: int, llc: int, min_time: float,
                   max_time: float, passes: int = 3) -> dict:
    """Seconds per call of the 8-bit matrices' two numerics at each shape and step of M rows,
    alternated pass by pass (min over passes of each measurement's median)."""
    results: dict = {}
    for i, (name, n, k, _) in enumerate(shapes):
        qw = random_qweight(n, k, group_size, seed=i)
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            times: dict = {method: [] for method in EIGHT_BIT_METHODS}
            for number in range(passes):
                for method in EIGHT_BIT_METHODS[:: 1 if number % 2 == 0 else -1]:
                    times[method].append(time_method(method, qw, x, llc, min_time, max_time)["seconds"])
            results[(name, m)] = {method: min(t) for method, t in times.items()}
        del qw
    return results


def print_eight_bit(shapes: list, results: dict, rows: list[int]) -> None:
    print("\n8-bit weights, ms per call (min over passes of the median), W8A16 / W8A8 "
          f"(below {int4_cpu.W8A8_MIN_ROWS} rows both run W8A16):")
    for name, n, k, _ in shapes:
        for m in rows:
            r = results[(name, m)]
            a, b = r["fourbit W8A16"], r["fourbit W8A8"]
            print(f"{name + f' {n}x{k}':<26}{m:>4}{a * 1e3:>12.3f} / {b * 1e3:.3f} ({a / b:.2f}x)")


def print_steps(shapes: list, results: dict, rows: list[int]) -> None:
    print("\nsteps of M rows, ms per call (min over passes of the median), one-row / multi-row:")
    print(f"{'shape':<26}{'M':>4}" + "".join(f"{m:>36}" for m in ROW_METHODS))
    for name, n, k, _ in shapes:
        for m in rows:
            cells = []
            for method in ROW_METHODS:
                r = results[(name, m, method)]
                cells.append(f"{r['one-row'] * 1e3:.3f} / {r['multi-row'] * 1e3:.3f} "
                             f"({r['one-row'] / r['multi-row']:.2f}x)")
            print(f"{name + f' {n}x{k}':<26}{m:>4}" + "".join(f"{c:>36}" for c in cells))
    for m in rows:
        cells = []
        for method in ROW_METHODS:
            step = {kind: sum(results[(name, m, method)][kind] * per for name, _, _, per in shapes)
                    for kind in ("one-row", "multi-row")}
            cells.append(f"{step['one-row'] * 1e3:.1f} / {step['multi-row'] * 1e3:.1f} "
                         f"({step['one-row'] / step['multi-row']:.2f}x)")
        print(f"{f'one step ({shapes[0][3]} layers+head)':<26}{m:>4}" + "".join(f"{c:>36}" for c in cells))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b",
                        help="whose linear shapes to time")
    parser.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128))
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--max-time", type=float, default=3.0,
                        help="stop a slow measurement (tinygemm fp32 on the head) after this")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the triad")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per weight under callgrind instead of timing")
    parser.add_argument("--activation-error", action="store_true",
                        help="the int8 activation roundings' error against llama.cpp's Q8_0/Q8_K")
    parser.add_argument("--rows", type=int, nargs="+", metavar="M",
                        help="time steps of M rows: the multi-row kernels against the one-row ones")
    args = parser.parse_args(argv)
    if args.activation_error:
        n, k = COUNT_SHAPE
        print(f"activation rounding, one {n} x {k} linear, 64 rows of activations:")
        activation_error()
        return
    if args.instructions:
        n, k = COUNT_SHAPE
        print(f"instructions per weight, one {n} x {k} linear at batch 1, one thread, "
              "callgrind (fourbit's AVX2 path; ggml compiled -mavx2 -mfma):")
        for label, value in count_instructions(args.group_size).items():
            print(f"  {label:<28} {value:.3f}")
        return

    torch.set_num_threads(args.threads)
    shapes = MODELS[args.model]
    llc = last_level_cache_bytes()
    load_before = load_average()
    flags = open("/proc/cpuinfo").read().split("flags", 2)[1].split("\n", 1)[0].split()
    host = {
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "fourbit_kernel_isa": int4_cpu.isa(),
        "model": args.model,
        "avx512f": "avx512f" in flags,
        "threads": args.threads,
        "group_size": args.group_size,
        "load_average_before": load_before,
    }
    print(f"host: torch {host['torch']} capability {host['torch_cpu_capability']}, fourbit "
          f"kernel ISA {host['fourbit_kernel_isa']}, avx512f {'yes' if host['avx512f'] else 'no'}, "
          f"{args.threads} threads, {args.model}'s shapes, group {args.group_size}, LLC {llc >> 20} MiB, "
          f"load average {load_before:.2f}")
    if int4_cpu.isa() == "none":
        args.methods = [m for m in args.methods if not m.startswith("fourbit")]
        print("fourbit's kernel does not run here (no AVX2+FMA): its columns are left out")

    if args.rows:
        if int4_cpu.isa() == "none":
            raise SystemExit("fourbit's kernel does not run here (no AVX2+FMA): nothing to time")
        print_steps(shapes, time_steps(shapes, args.rows, args.group_size, llc, args.min_time,
                                       args.max_time), args.rows)
        if args.group_size % 64 == 0:  # W8A8's groups
            print_eight_bit(shapes, time_eight_bit(shapes, args.rows, args.group_size, llc,
                                                   args.min_time, args.max_time), args.rows)
        load_after = load_average()
        print(f"load average after: {load_after:.2f}"
              + (" (busy cores: not a measurement of the kernels alone)"
                 if max(load_before, load_after) > 0.25 * args.threads else ""))
        return

    x = torch.randn(1, max(k for _, _, k, _ in shapes), generator=torch.Generator().manual_seed(0))
    results: dict[str, dict[str, dict]] = {}
    for i, (name, n, k, _) in enumerate(shapes):
        qw = random_qweight(n, k, args.group_size, seed=i)
        results[name] = {}
        for method in args.methods:
            results[name][method] = time_method(method, qw, x[:, :k], llc, args.min_time,
                                                args.max_time)
        del qw

    width = 15
    print(f"\nbatch 1, ms per call (median), {args.threads} threads:")
    print(f"{'shape':<26}" + "".join(f"{m:>{width}}" for m in args.methods))
    for name, n, k, _ in shapes:
        row = results[name]
        print(f"{name + f' {n}x{k}':<26}"
              + "".join(f"{row[m]['seconds'] * 1e3:>{width}.3f}" for m in args.methods))
    token = {m: sum(results[name][m]["seconds"] * per for name, _, _, per in shapes)
             for m in args.methods}
    token_bytes = {m: sum(results[name][m]["resident_bytes"] * per for name, _, _, per in shapes)
                   for m in args.methods}
    print(f"{f'one token ({shapes[0][3]} layers+head)':<26}" + "".join(f"{token[m] * 1e3:>{width}.2f}"
                                                         for m in args.methods))
    bf16_bytes = sum(n * k * 2 * per for _, n, k, per in shapes)
    print(f"{'resident / bf16':<26}" + "".join(f"{token_bytes[m] / bf16_bytes:>{width}.3f}"
                                               for m in args.methods))
    print(f"{'effective GB/s':<26}" + "".join(f"{token_bytes[m] / token[m] / 1e9:>{width}.1f}"
                                              for m in args.methods))

    triad = None
    if not args.no_bandwidth:
        triad = measure_bandwidth(threads=args.threads)["gbs"]
        print(f"{'of triad':<26}" + "".join(
            f"{token_bytes[m] / token[m] / 1e9 / triad:>{width}.0%}" for m in args.methods))
        print(f"triad bandwidth (fourbit.bench.bandwidth, {args.threads} threads): "
              f"{triad:.1f} GB/s")
    load_after = load_average()
    print(f"load average after: {load_after:.2f}")
    if max(load_before, load_after) > 0.25 * args.threads:
        print("WARNING: the cores were busy; these wall-clock times are not a measurement of "
              "the kernels alone")
    if args.json:
        out = {"host": {**host, "load_average_after": load_after, "llc_bytes": llc},
               "triad_gbs": triad, "per_shape": results,
               "token_seconds": token, "token_resident_bytes": token_bytes,
               "bf16_bytes": bf16_bytes}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
