"""Each checkpoint format's vLLM engine peak against the bench's estimate of it; not a test.

    .venv/bin/python benchmarks/engine_memory.py --workdir /tmp/fourbit-engine-memory

The bench holds one vLLM worker per checkpoint open and plans its groups from an
estimate of each worker's peak (fourbit.bench.memory_groups.held_open_bytes): engines
whose estimates add up beyond the available memory are timed in separate groups, so an
estimate below the real peak lets the OOM killer end the job. This starts the bench's
own worker (fourbit.engines.vllm.throughput_worker, the bench's settings, one pass of
pp512 and tg128) on each checkpoint in turn, alone on the host, and prints its
estimate beside the worker's measured peak (VmHWM) and its resident set once open.

Random weights at a real architecture's shapes (memory does not depend on the
values), head untied; the arms are plain min/max rounding in each format the plugin
loads: cpu_int4 with the embedding dense and in 4 bits, GPTQ (symmetric RTN),
compressed-tensors (asymmetric RTN), and the 8-bit head and embedding. --workdir
keeps the checkpoints for the next run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ARMS = {
    "cpu_int4 g128": {"method": "cpu_int4", "group_size": 128, "search": "minmax"},
    "cpu_int4 g128 emb4": {"method": "cpu_int4", "group_size": 128, "search": "minmax",
                           "quantize_embedding": True},
    "gptq (rtn sym g128)": {"method": "rtn", "group_size": 128, "sym": True},
    "compressed-tensors (rtn asym g128)": {"method": "rtn", "group_size": 128, "sym": False},
    "gptq head8 emb8": {"method": "rtn", "group_size": 128, "sym": True, "quantize_head": 8,
                        "quantize_embedding": 8},
}


def build(workdir: Path, architecture: str) -> dict[str, Path]:
    """{"dense": untied float32 at the architecture's shapes, arm name: its checkpoint}."""
    from vllm_speed import quantized_checkpoint, untied_dense  # the same folder

    dense = untied_dense(workdir, architecture)
    return {"dense": dense, **{
        name: quantized_checkpoint(dense, workdir, quant["method"], quant["method"], quant,
                                   threads=torch.get_num_threads())
        for name, quant in ARMS.items()}}


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


def measure(checkpoint: Path, settings: dict, threads: int, sizes: dict) -> dict:
    """One bench worker on ``checkpoint``: its peak (VmHWM) and resident set after
    opening and one pass."""
    from fourbit.engines.vllm.throughput import throughput_session

    started = time.monotonic()
    with throughput_session(checkpoint, settings, threads, **sizes) as one_pass:
        one_pass()  # the first call waits for the engine to open
        peak, resident = one_pass.peak_rss_bytes, rss_bytes(one_pass.process.pid)
    return {"peak": peak, "resident": resident, "seconds": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fourbit-engine-memory"))
    parser.add_argument("--architecture", default="qwen2.5-0.5b")
    parser.add_argument("--arms", nargs="*", default=None, help=f"a subset of {list(ARMS)}")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from vllm_speed import llama_bench_sizes, vllm_settings  # the same folder

    from fourbit.bench.memory_groups import held_open_bytes

    args.workdir.mkdir(parents=True, exist_ok=True)
    paths = build(args.workdir, args.architecture)
    names = ["dense", *(args.arms if args.arms is not None else ARMS)]
    sizes = llama_bench_sizes()
    # the study's engine block, as config.yaml sets it (the bench sizes its KV cache itself)
    settings = vllm_settings({"dtype": "float32", "kv_cache_gib": 1},
                             args.workdir / "cache")
    print(f"model: random weights at {args.architecture}'s shapes, head untied; "
          f"engine float32 eager, {args.threads} threads")
    print("| checkpoint | files MiB | estimate GiB | peak GiB | peak / estimate | resident GiB | s |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        path = paths[name]
        files = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        estimate = held_open_bytes(path, settings["dtype"])
        got = measure(path, settings, args.threads, sizes)
        print(f"| {name} | {files / 2**20:.0f} | {estimate / 2**30:.2f} | {got['peak'] / 2**30:.2f} "
              f"| {got['peak'] / estimate:.2f} | {got['resident'] / 2**30:.2f} "
              f"| {got['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
