"""vLLM's server on 4-bit arms against llama-server on Q4_K_M, side by side (issue 37); not a test.

    .venv/bin/python benchmarks/serve_vs_llamacpp.py \\
        --vllm <arm>/quantized [--vllm <another arm>/quantized] --gguf <q4_k_m arm>/gguf/model.gguf \\
        --windows <study>/eval/<corpus>/windows.json [--compiled] [--concurrency 1 4 8 16]
    .venv/bin/python benchmarks/serve_vs_llamacpp.py --qwen-shapes /tmp/fourbit-qwen \
        --compiled --dtype bfloat16

--qwen-shapes DIR builds (or reuses) in DIR the random Qwen2.5-0.5B-shaped model of
benchmarks/vllm_vs_llamacpp.py (its cpu_int4 g128 checkpoint with the w4a8_group kernel
knob, and Q4_K_M from its f16 GGUF) and evaluation windows of the builtin corpus tokenized
with its tokenizer (the study's default evaluation block), and serves those.

Each model is served as the serve step serves it (fourbit.serving: the same command
lines, the same cores and threads, the same load generator and workload: greedy
requests of --prompt-tokens token ids of the evaluation windows, --output-tokens each,
EOS ignored), all servers held open at once; every pass runs every level of every server,
the servers' order rotated from pass to pass. Printed: output tok/s per level, median
[min-max] over the passes, and the ratio of the best vLLM arm to llama-server, pass by
pass, and at one user the decode rate a user sees (1000 / TPOT p50); the host's load before
and after. With --tg128, the servers once stopped, each model's batch-1 pp512 / tg128 as
the bench times them (benchmarks/vllm_vs_llamacpp.py's runs: each vLLM engine held open in
a worker with the same settings, llama-bench), passes rotated likewise, to set beside one
user on the server.
With --profile-batch N, then torch.profiler's table of one decode step of N sequences
on the first vLLM checkpoint: where a batched step's time goes. Run it under the bench
lock on a quiet host:

    flock /tmp/fourbit-bench.lock .venv/bin/python benchmarks/serve_vs_llamacpp.py ...
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import tempfile
from pathlib import Path

from vllm_speed import summary  # the same folder: python puts it on sys.path

from fourbit.bench.pinning import choose_cores, pinned
from fourbit.serving.load import run_level
from fourbit.serving.process import exit_on_sigterm, free_port, running_server
from fourbit.serving.registry import SERVERS
from fourbit.serving.workload import prompts_from_windows
from fourbit.steps.llamacpp import load_tools


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", type=Path, action="append",
                        help="a 4-bit checkpoint folder for vLLM's server (repeatable)")
    parser.add_argument("--gguf", type=Path, help="the Q4_K_M GGUF for llama-server")
    parser.add_argument("--windows", type=Path, help="a study's windows.json")
    parser.add_argument("--qwen-shapes", type=Path, metavar="DIR",
                        help="serve the Qwen2.5-0.5B-shaped model built (or kept) in DIR instead")
    parser.add_argument("--tools", type=Path, help="the llama.cpp build's record (default: ensure it)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--compiled", action="store_true", help="vLLM compiled (default: eager)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tg128", action="store_true",
                        help="then time each model's batch-1 pp512 / tg128 as the bench does")
    parser.add_argument("--profile-batch", type=int, default=None, metavar="N",
                        help="then profile one decode step of N sequences on the first vLLM checkpoint")
    args = parser.parse_args()
    if args.qwen_shapes:
        if args.vllm or args.gguf or args.windows:
            parser.error("--qwen-shapes serves its own model: leave out --vllm, --gguf and --windows")
        args.vllm, args.gguf, args.windows = _qwen_shaped(args.qwen_shapes, args.threads)
    elif not (args.vllm and args.gguf and args.windows):
        parser.error("give --vllm, --gguf and --windows, or --qwen-shapes DIR")

    if args.tools:
        server_binary = load_tools(args.tools).server
    else:
        from fourbit.llamacpp.build import ensure_llamacpp

        server_binary = ensure_llamacpp().server
    cores = choose_cores(None, args.threads)
    slots, tokens = max(args.concurrency), args.prompt_tokens + args.output_tokens
    prompts = prompts_from_windows(args.windows, prompt_tokens=args.prompt_tokens,
                                   requests=args.requests)
    vllm_engine = {"name": "vllm", "dtype": args.dtype, "enforce_eager": not args.compiled,
                   "kv_cache_gib": 1, "max_num_seqs": 1, "quant": {}}
    served = {f"vllm {path.parent.name}": (SERVERS["vllm"], path, vllm_engine) for path in args.vllm}
    served["llama-server Q4_K_M"] = (SERVERS["llamacpp"], args.gguf,
                                     {"name": "llamacpp", "threads": args.threads})
    print(f"load before: {os.getloadavg()}; cores {cores}; {args.requests} requests of "
          f"{args.prompt_tokens}+{args.output_tokens} tokens per level, {args.passes} passes")
    logs = Path(tempfile.mkdtemp(prefix="fourbit-serve-vs-"))
    tok_s = {name: {c: [] for c in args.concurrency} for name in served}
    one_user = {name: [] for name in served}  # 1000 / TPOT p50 at concurrency 1, per pass
    with exit_on_sigterm(), pinned(cores), contextlib.ExitStack() as stack:
        running = {}
        for name, (kind, model, engine) in served.items():
            port = free_port()
            command = kind.command(model, engine, port, served_name="m", slots=slots,
                                   tokens_per_request=tokens, cores=cores,
                                   cache_root=logs / name.replace(" ", "_"),
                                   llamacpp_server=server_binary)
            running[name] = stack.enter_context(running_server(
                name, command.argv, command.env, port, logs / f"{name.replace(' ', '_')}.log",
                health_path=kind.health_path))
            print(f"{name}: answering after {running[name].startup_s:.1f} s: {' '.join(command.argv)}")
        names = list(served)
        for number in range(args.passes):
            for name in names[number % len(names):] + names[:number % len(names)]:
                for level in args.concurrency:
                    figures = run_level(running[name].base_url, "m", prompts,
                                        output_tokens=args.output_tokens, concurrency=level,
                                        warmup=2, extra_body=dict(served[name][0].extra_body))
                    tok_s[name][level].append(figures["output_tok_s"])
                    if level == 1:  # inf: its tokens arrived in one chunk (a starved server)
                        one_user[name].append(1000 / figures["tpot_ms"]["p50"] if figures["tpot_ms"]["p50"] > 0
                                              else float("inf"))
                    print(f"pass {number + 1} {name} c={level}: {figures['output_tok_s']:.1f} "
                          f"output tok/s, TPOT p99 {figures['tpot_ms']['p99']:.1f} ms", flush=True)
    print(f"load after: {os.getloadavg()}; server logs in {logs}")
    _table(tok_s, args.concurrency)
    if one_user[names[0]]:
        print("one user, decode tok/s (1000 / TPOT p50), median [min-max] over passes:")
        for name, rates in one_user.items():
            print(f"  {name:40s} {summary(rates)}")
    if args.tg128:
        _batch_one(served, args, cores, logs)
    if args.profile_batch:
        from vllm_profile import profile_step  # the same folder: python puts it on sys.path
        from vllm_speed import vllm_settings

        checkpoint = args.vllm[0]
        settings = vllm_settings({"dtype": args.dtype, "enforce_eager": not args.compiled}, logs / "profile")
        print(f"\nprofile of one decode step of {args.profile_batch} sequences on {checkpoint} "
              "(top ops by self CPU time):", flush=True)
        with pinned(cores):
            print(profile_step(checkpoint, settings, "decode", len(cores), batch=args.profile_batch))


def _qwen_shaped(workdir: Path, threads: int) -> tuple[list[Path], Path, Path]:
    """([its w4a8_group checkpoint], its Q4_K_M GGUF, its windows.json), built when missing."""
    from vllm_vs_llamacpp import qwen_shaped_model  # the same folder

    from fourbit.schema import block
    from fourbit.steps.evaluate import tokenize_windows

    model = qwen_shaped_model(workdir, threads)
    windows = workdir / "windows.json"
    if not windows.is_file():  # written atomically
        evaluation = block("evaluation", {})  # the study's defaults
        tokenize_windows(workdir / "untied", workdir / "corpus" / "evaluation.txt", windows,
                         window=evaluation["window"], max_windows=evaluation["max_windows"])
    return [model["vllm_w4a8_group"]], model["gguf"], windows


def _batch_one(served: dict, args: argparse.Namespace, cores: list[int], logs: Path) -> None:
    """Each model's pp512 / tg128 as the bench times them, passes rotated."""
    from vllm_vs_llamacpp import held_engine, llama_run  # the same folder

    from fourbit.bench.starts import open_group

    # benchmarks/vllm_vs_llamacpp.py's variant of the served engine (the checkpoint carries
    # its kernel knob, so "plugin bf16 compiled" on a w4a8_group checkpoint runs W4A8_GROUP)
    short = {"float32": "fp32", "bfloat16": "bf16"}.get(args.dtype)
    if short is None:
        raise SystemExit(f"--tg128 times float32 or bfloat16 engines, not {args.dtype}")
    variant = f"plugin {short}" + (" compiled" if args.compiled else "")
    runs = {name: [] for name in served}
    names = list(served)
    with pinned(cores), contextlib.ExitStack() as stack:
        engines = open_group(stack, {
            name: functools.partial(held_engine, variant, {"vllm": model}, cores, logs / "bench")
            for name, (_, model, _) in served.items() if not name.startswith("llama")},
            optional=set(), failed={})
        for number in range(args.passes):
            for name in names[number % len(names):] + names[:number % len(names)]:
                _, model, _ = served[name]
                rates = (llama_run({"gguf": model}, cores) if name.startswith("llama")
                         else engines[name]())
                runs[name].append(rates)
                print(f"pass {number + 1} {name}: pp512 {rates['pp512_tok_s']:.1f}, tg128 "
                      f"{rates['tg128_tok_s']:.1f} tok/s", flush=True)
    print("batch 1 as the bench times it, tok/s, median [min-max] over passes:")
    for name, rates in runs.items():
        print(f"  {name:40s} pp512 {summary([r['pp512_tok_s'] for r in rates])}   "
              f"tg128 {summary([r['tg128_tok_s'] for r in rates])}")


def _table(tok_s: dict[str, dict[int, list[float]]], levels: list[int]) -> None:
    print("output tok/s, median [min-max] over passes")
    print(f"{'server':40s}" + "".join(f"{f'c={c}':>24s}" for c in levels))
    for name, by_level in tok_s.items():
        print(f"{name:40s}" + "".join(
            f"{statistics.median(v):>10.1f} [{min(v):.1f}-{max(v):.1f}]".rjust(24)
            for v in by_level.values()))
    llama = next(name for name in tok_s if name.startswith("llama"))
    for name in (n for n in tok_s if n != llama):
        ratios = {c: [a / b for a, b in zip(tok_s[name][c], tok_s[llama][c])] for c in levels}
        print(f"{name} / llama-server, pass by pass: " + "; ".join(
            f"c={c}: {statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}]" for c, r in ratios.items()))


if __name__ == "__main__":
    main()
