"""Wall time and peak RSS of GPTQ over a synthetic model at a real architecture's shapes.

    .venv/bin/python benchmarks/gptq_synthetic.py --architecture qwen2.5-0.5b --samples 16 --seq-len 512

Random weights and random calibration token ids: this measures the cost of the
algorithm and the layer walk, not quality. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import tempfile
import time
from pathlib import Path

import torch


def build_model(architecture: str, tmp: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from fourbit.inputs.sources import ARCHITECTURES
    from fourbit.steps.prepare import untie_head

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(ARCHITECTURES / f"{architecture}.json")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(f"{tmp}/tied")
    untie_head(f"{tmp}/tied", f"{tmp}/model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", default="qwen2.5-0.5b")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoConfig

    from fourbit.quant.gptq import gptq_quantize
    from fourbit.quant.grid import Grid
    from fourbit.quantizers.walk import quantize_sequential
    from fourbit.inputs.sources import ARCHITECTURES

    config = AutoConfig.from_pretrained(ARCHITECTURES / f"{args.architecture}.json")
    with tempfile.TemporaryDirectory() as tmp:
        # Built in a child process, so this process's peak RSS is the walk's alone.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            pool.apply(build_model, (args.architecture, tmp))
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        grid = Grid(group_size=args.group_size, sym=True)
        samples = torch.randint(0, config.vocab_size, (args.samples, args.seq_len),
                                generator=torch.Generator().manual_seed(0))
        gptq_seconds = 0.0

        def quantize_linear(name, weight, hessian):
            nonlocal gptq_seconds
            started = time.monotonic()
            qweight, _ = gptq_quantize(weight, hessian, grid, layer_name=name)
            gptq_seconds += time.monotonic() - started
            return qweight.dequantize()

        started = time.monotonic()
        info = quantize_sequential(Path(f"{tmp}/model"), samples, quantize_linear)
        wall = time.monotonic() - started
    print(json.dumps({
        "architecture": args.architecture,
        "calibration_tokens": args.samples * args.seq_len,
        "threads": args.threads,
        "wall_s": round(wall, 1),
        "gptq_s": round(gptq_seconds, 1),
        "walk_forward_s": round(wall - gptq_seconds, 1),
        "peak_rss_mib": round(info["peak_rss_mb"], 1),
        "peak_rss_before_walk_mib": round(rss_before, 1),
        "linears": info["linears_quantized"],
    }))


if __name__ == "__main__":
    main()
