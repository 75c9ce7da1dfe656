"""What an exact KL of a vLLM arm costs, by each way of getting whole distributions; not a test.

    .venv/bin/python benchmarks/vllm_exact_kl.py --baseline <untied model> --arm <4-bit
        checkpoint> --dense <its dense expansion> --windows <windows.json> [--count 4]

The fidelity step compares next-token distributions of an arm and its baseline, and vLLM
returns only a top k of logprobs per position. Each way of getting KL(P_base || P_arm)
runs in a process of its own (so its peak resident set is its own), over the first
``--count`` windows after one untimed window (vLLM compiles its prompt-logprob op on the
first), the baseline's pass first, then the arm's, which computes the KL:

    topk20     vLLM prompt_logprobs with the top 20 of each model: the lower bound fourbit
               computed before, for scale (its KL is the bound's merged estimate, not exact)
    full       vLLM prompt_logprobs=-1 (max_logprobs=-1): every logprob, as Python floats
    kept       fourbit.engines.vllm.distributions: the logits kept from inside vLLM, the
               baseline's written to disk as the workflow does
    reference  the reference engine (transformers float32) on the baseline and on the arm's
               dense expansion instead of the arm itself

Printed per way: seconds per window for each model's pass (the arm's with its KL), the
engines' start, the peak resident set (VmHWM) and the resident set once the models were
open, and the KL's mean over the positions.

A shared host's speed drifts between those processes, so ``--rounds N`` then times the
ways side by side in one process: one vLLM engine on the arm (max_logprobs=-1, which
every way's request accepts) and transformers on the dense expansion, each round giving
every way one window in turn (the order rotated), a window's whole distribution each
(topk20 only its top 20), and kl_from_logits of two windows; it prints each way's median
and [min-max] seconds per window. docs/engines.md ("Exact KL on vLLM") records a run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUTES = ("topk20", "full", "kept", "reference")
OPTIONS = {"dtype": "float32", "kv_cache_bytes": 256 << 20, "enforce_eager": True}


def _rss_mib(field: str) -> float:
    """VmRSS or VmHWM of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _vllm_full(llm, window: list[int], k: int):
    """The window's prompt logprobs with the top ``k`` (-1: every id) as a [W-1, V] float32
    tensor, -inf where vLLM returned nothing."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=k, flat_logprobs=True, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=window)], params, use_tqdm=False)
    plp = out.prompt_logprobs
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rows = torch.full((len(window) - 1, vocab), -math.inf)
    for t in range(1, len(window)):
        s, e = plp.start_indices[t], plp.end_indices[t]
        rows[t - 1, torch.tensor(plp.token_ids[s:e])] = torch.tensor(plp.logprobs[s:e])
    return rows


def _merged_topk_kl(base, arm) -> list[float]:
    """The top-k bound's merged estimate per row: ids both returned, the rest one outcome."""
    import torch

    known = torch.isfinite(base) & torch.isfinite(arm)
    pb, pa = base.double().exp() * known, arm.double().exp() * known
    head = (pb * (base.double() - arm.double()).where(known, 0)).sum(-1)
    rest_b, rest_a = (1 - pb.sum(-1)).clamp_min(0), (1 - pa.sum(-1)).clamp_min(1e-6)
    return (head + torch.where(rest_b > 0, rest_b * (rest_b / rest_a).log(), 0)).tolist()


def run_route(route: str, args: argparse.Namespace) -> dict:
    import torch

    from fourbit.threads import torch_threads

    windows = json.loads(Path(args.windows).read_text())["windows"][: args.count + 1]
    warm, timed = windows[0], windows[1:]
    result: dict = {"route": route, "windows": len(timed), "tokens": len(timed[0])}
    with torch_threads(args.threads), torch.inference_mode():
        if route == "reference":
            kl = _reference(args, warm, timed, result)
        else:
            kl = _vllm(route, args, warm, timed, result)
    result["kl_mean"] = math.fsum(kl) / len(kl)
    result["peak_mib"] = _rss_mib("VmHWM")
    return result


def _vllm(route: str, args, warm: list[int], timed: list[list[int]], result: dict) -> list[float]:
    from fourbit.engines.vllm import open_llm
    from fourbit.engines.vllm.distributions import compare_with_kept, keep_logits
    from fourbit.engines.vllm.score import logprobs_on
    from fourbit.metrics.kl import kl_full

    k = {"topk20": 20, "full": -1}.get(route)
    kl: list[float] = []
    kept_base: list = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        logits_file = Path(tmp) / "baseline.logits.npy"
        for side, checkpoint in (("baseline", args.baseline), ("arm", args.arm)):
            t0 = time.perf_counter()
            with open_llm(checkpoint, max_model_len=len(timed[0]) + 1, max_logprobs=k or 20,
                          cache_root=Path(tmp) / side, **OPTIONS) as llm:
                result[f"{side}_start_s"] = time.perf_counter() - t0
                logprobs_on(llm, [warm], token_logprobs=False)  # compiles the logprob op
                result[f"{side}_open_mib"] = _rss_mib("VmRSS")
                t0 = time.perf_counter()
                if route == "kept" and side == "baseline":
                    keep_logits(llm, timed, logits_file)
                elif route == "kept":
                    kl = [x for w in compare_with_kept(llm, timed, logits_file)[1] for x in w]
                else:
                    for i, window in enumerate(timed):
                        rows = _vllm_full(llm, window, k)
                        if side == "baseline":
                            kept_base.append(rows)
                        elif route == "full":
                            kl += kl_full(kept_base[i], rows).tolist()
                        else:
                            kl += _merged_topk_kl(kept_base[i], rows)
                result[f"{side}_s_per_window"] = (time.perf_counter() - t0) / len(timed)
    return kl


def _reference(args, warm: list[int], timed: list[list[int]], result: dict) -> list[float]:
    import torch

    from fourbit.engines.reference import load_model
    from fourbit.metrics.kl import kl_from_logits

    t0 = time.perf_counter()
    models = {"baseline": load_model(Path(args.baseline), torch.float32),
              "arm": load_model(Path(args.dense), torch.float32)}
    result["start_s"] = time.perf_counter() - t0
    for model in models.values():
        model(torch.tensor([warm]))
    result["open_mib"] = _rss_mib("VmRSS")
    kl: list[float] = []
    spent = {"baseline": 0.0, "arm": 0.0}
    for window in timed:
        t0 = time.perf_counter()
        base = models["baseline"](torch.tensor([window])).logits[0, :-1]  # [W-1, V]
        spent["baseline"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        arm = models["arm"](torch.tensor([window])).logits[0, :-1]
        kl += kl_from_logits(base, arm)[0]
        spent["arm"] += time.perf_counter() - t0
    for side, seconds in spent.items():
        result[f"{side}_s_per_window"] = seconds / len(timed)
    return kl


def interleaved(args: argparse.Namespace) -> dict:
    """Seconds per window of each way, side by side in one process (the module docstring)."""
    import statistics

    import torch

    from fourbit.engines.reference import load_model
    from fourbit.engines.vllm import open_llm
    from fourbit.engines.vllm.distributions import keeping_logits, window_logits
    from fourbit.metrics.kl import kl_from_logits
    from fourbit.threads import torch_threads

    windows = json.loads(Path(args.windows).read_text())["windows"]
    spent: dict[str, list[float]] = {route: [] for route in (*ROUTES, "kl_from_logits")}
    with torch_threads(args.threads), torch.inference_mode(), tempfile.TemporaryDirectory(
            dir=args.tmp) as tmp, open_llm(args.arm, max_model_len=len(windows[0]) + 1,
                                           max_logprobs=-1, cache_root=tmp, **OPTIONS) as llm:
        dense = load_model(Path(args.dense), torch.float32)
        with keeping_logits(llm) as kept:
            ways = {
                "topk20": lambda w: _vllm_full(llm, w, 20),
                "full": lambda w: _vllm_full(llm, w, -1),
                "kept": lambda w: window_logits(llm, kept, w)[1],
                "reference": lambda w: dense(torch.tensor([w])).logits[0, :-1],
            }
            for way in ways.values():  # untimed: compiles, allocates
                way(windows[0])
            for r in range(args.rounds):
                window = windows[1 + r % (len(windows) - 1)]
                order = list(ways)[r % len(ways):] + list(ways)[: r % len(ways)]
                for route in order:
                    t0 = time.perf_counter()
                    logits = ways[route](window)
                    spent[route].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                kl_from_logits(logits, logits + 1e-3 * torch.randn_like(logits))
                spent["kl_from_logits"].append(time.perf_counter() - t0)
    return {route: f"{statistics.median(s):.3f} [{min(s):.3f}-{max(s):.3f}]"
            for route, s in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="the untied dense model")
    parser.add_argument("--arm", required=True, help="a 4-bit checkpoint of it (vLLM's plugin)")
    parser.add_argument("--dense", required=True, help="the arm's dense expansion")
    parser.add_argument("--windows", required=True, help="a windows.json (tokenize_evaluation)")
    parser.add_argument("--count", type=int, default=4, help="windows timed, after one untimed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--tmp", default=None, help="where the kept logits go (default: /tmp)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="then time the ways side by side for this many rounds")
    parser.add_argument("--route", help=argparse.SUPPRESS)  # one route, in its own process
    args = parser.parse_args()
    if args.route == "interleaved":
        print(json.dumps(interleaved(args)))
        return
    if args.route:
        print(json.dumps(run_route(args.route, args)))
        return
    routes = [r for r in args.routes.split(",") if r] + ["interleaved"] * (args.rounds > 0)
    for route in routes:
        run = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--route", route],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{route}: failed\n{run.stderr[-3000:]}")
            continue
        print(json.loads(run.stdout.strip().splitlines()[-1]), flush=True)


if __name__ == "__main__":
    main()
