"""Per-layer held-out output error of each grid search, on one model; not a test.

    .venv/bin/python benchmarks/grid_search.py --model results/<model id>/untied \
        --calibration results/corpus/<corpus id>/calibration.txt [--samples 32 --heldout 16]
    .venv/bin/python benchmarks/grid_search.py --synthetic qwen2.5-0.5b [--rows 256]

For every linear of the untied model (the head included) and every grid (sym and
asym, groups 32/64/128), the relative output error on held-out activations,
||X_h (W - W_hat)^T||^2 / ||X_h W^T||^2 = tr(dW H_h dW^T) / tr(W H_h W^T), of:

    minmax       plain min/max rounding (the baseline every search must not lose to)
    shrink       the old search (20 shrunken ranges, squared weight error): cpu_int4's
                 default before the weighted search
    shrink+H     the same weighted by diag(H) of the calibration windows (the old
                 cpu_int4 importance: activation)
    weighted     llama.cpp's weighted search, av_x + |x| (cpu_int4's default now)
    weighted+H   the same with diag(H) as llama.cpp's imatrix (cpu_int4 activation now,
                 before its guard)
    guarded      weighted+H or minmax, whichever is better on the held-out windows:
                 what cpu_int4 importance: activation now stores
    gptq, gptq+w GPTQ on the calibration Hessian with the minmax and the weighted grid
                 (with --gptq; the gptq arm stores the better of the two per layer)

The windows are the arm's own draw (fourbit.quantizers.methods.calibration_tokens):
``--samples`` calibration windows to fit and ``--heldout`` more, disjoint, to judge
by. Unlike the arms, every layer sees the *unquantized* model's inputs (one forward
pass), which isolates each layer's own error, as benchmarks/layer_errors.py does;
so "guarded" here is decided and scored on the same held-out windows, exactly as
the arm decides it. Columns are per 1e-3 of relative error.

``--synthetic ARCH`` instead takes one decoder layer's linears and the head at a shipped
architecture's shapes (src/fourbit/inputs/architectures/ARCH.json), rows 0:``--rows`` of each:
heavy-tailed random weights (randn * 0.02 * u^-0.3) and synthetic activations with
log-normal channel scales, a few outlier channels and mixed columns, fit and held-out
tokens drawn independently from one distribution. Real shapes, made-up numbers.

Measured 2026-12-01 on a 2-core AVX2 AMD EPYC (one torch thread), the workflow's default
model (builtin_default-f6b92d46c9: 4 layers, hidden 256, trained by
`snakemake --cores 1 results/builtin_default-f6b92d46c9/untied`), `--samples 32 --heldout 16
--gptq`: mean over its 29 linears (x 1e-3) and [layers worse than minmax]:

    grid      minmax  shrink      shrink+H    weighted    weighted+H  gptq    gptq guarded
    asym g32  0.601   0.592 [9]   0.559 [3]   0.529 [0]   0.495 [0]   0.0355  0.0337
    asym g64  0.750   0.733 [9]   0.675 [1]   0.690 [0]   0.648 [0]   0.0444  0.0427
    asym g128 0.921   0.862 [9]   0.800 [1]   0.829 [2]   0.791 [1]   0.0539  0.0513
    sym g32   0.770   0.720 [6]   0.651 [0]   0.668 [0]   0.610 [0]   0.0455  0.0421
    sym g64   0.948   0.862 [4]   0.769 [0]   0.812 [0]   0.753 [0]   0.0556  0.0512
    sym g128  1.123   0.969 [4]   0.869 [0]   0.944 [0]   0.891 [0]   0.0657  0.0585

(guarded, by construction, is worse than minmax on no layer.) With `--synthetic
qwen2.5-0.5b --rows 128 --samples 8 --heldout 4 --gptq` shrink+H, not weighted+H, is the
best column (e.g. asym g128: minmax 22.4, shrink+H 9.9, weighted+H 13.0): on random
heavy-tailed weights the extremes do not matter more than the rest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SEARCHES = ("minmax", "shrink", "shrink+H", "weighted", "weighted+H", "guarded")


def layer_hessians(model, linears: dict, windows: torch.Tensor, fit: int):
    """{name: (H_fit, H_heldout)} of each linear's input, the first ``fit`` windows vs the rest."""
    from fourbit.quant.hessian import Hessian

    hs = {name: (Hessian(m.in_features), Hessian(m.in_features)) for name, m in linears.items()}
    current = {"part": 0}
    hooks = []
    for name, module in linears.items():
        def add(_module, args, name=name):
            hs[name][current["part"]].add_batch(args[0])
        hooks.append(module.register_forward_pre_hook(add))
    with torch.no_grad():
        for i, ids in enumerate(windows):
            current["part"] = 0 if i < fit else 1
            model(ids.unsqueeze(0))  # [T] -> [1, T]
    for hook in hooks:
        hook.remove()
    return {name: (a.h, b.h) for name, (a, b) in hs.items()}


def synthetic_layers(architecture: str, rows: int, fit_tokens: int, heldout_tokens: int,
                     seed: int = 0) -> tuple[dict, dict]:
    """({name: W [rows, K]}, {name: (H_fit, H_heldout)}) at ``architecture``'s shapes."""
    from fourbit.quant.hessian import Hessian
    from fourbit.inputs.sources import ARCHITECTURES

    config = json.loads((ARCHITECTURES / f"{architecture}.json").read_text())
    d, ff = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config.get("head_dim", d // config["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)

    def activations(k):  # [fit + heldout, K]: mixed columns, uneven scales, 4 outlier channels
        scale = torch.exp(torch.randn(k, generator=gen))
        scale[torch.randperm(k, generator=gen)[:4]] *= 20
        mix = torch.eye(k) + torch.randn(k, k, generator=gen) * (0.5 / k**0.5)
        x = torch.randn(fit_tokens + heldout_tokens, k, generator=gen) @ mix * scale
        fit, held = Hessian(k), Hessian(k)
        fit.add_batch(x[:fit_tokens])
        held.add_batch(x[fit_tokens:])
        return fit.h, held.h

    inputs = {d: activations(d), ff: activations(ff)}  # attention/MLP/head inputs share widths
    shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
              "self_attn.o_proj": (d, d), "mlp.gate_proj": (ff, d), "mlp.up_proj": (ff, d),
              "mlp.down_proj": (d, ff), "lm_head": (config["vocab_size"], d)}
    weights, hessians = {}, {}
    for name, (n, k) in shapes.items():
        w = torch.randn(min(n, rows), k, generator=gen) * 0.02
        weights[name] = w * torch.rand(w.shape, generator=gen).pow(-0.3)
        hessians[name] = inputs[k]
    return weights, hessians


def errors_of_layer(w, h_fit, h_held, grid, gptq: bool) -> dict[str, float]:
    from fourbit.quant.grid import quantize_rtn
    from fourbit.quantizers.methods import heldout_error

    imp = h_fit.diagonal().float()
    out = {}
    plain = quantize_rtn(w, grid, search="minmax")
    out["minmax"] = heldout_error(w, plain.dequantize(), h_held)
    out["shrink"] = heldout_error(w, quantize_rtn(w, grid, search="shrink").dequantize(), h_held)
    out["shrink+H"] = heldout_error(
        w, quantize_rtn(w, grid, search="shrink", importance=imp).dequantize(), h_held)
    out["weighted"] = heldout_error(w, quantize_rtn(w, grid).dequantize(), h_held)
    out["weighted+H"] = heldout_error(w, quantize_rtn(w, grid, importance=imp).dequantize(), h_held)
    out["guarded"] = min(out["weighted+H"], out["minmax"])
    if gptq:
        from fourbit.quant.gptq import gptq_quantize

        for label, search in (("gptq", "minmax"), ("gptq+w", "weighted")):
            qw, _ = gptq_quantize(w, h_fit, grid, search=search)
            out[label] = heldout_error(w, qw.dequantize(), h_held)
        out["gptq guarded"] = min(out["gptq"], out["gptq+w"])
    return out


def model_layers(args) -> tuple[dict, dict]:
    """({name: W}, {name: (H_fit, H_heldout)}) of every linear of the model, the arm's windows."""
    from transformers import AutoModelForCausalLM

    from fourbit.checkpoints.hf import quantizable_linears
    from fourbit.quantizers.methods import QuantizeJob, calibration_tokens

    calibration = {"samples": args.samples, "seq_len": args.seq_len, "seed": args.seed,
                   "heldout": args.heldout}
    job = QuantizeJob(args.model, {}, {"method": "benchmark", "calibration": calibration},
                      args.calibration, 1)
    windows = calibration_tokens(job, args.heldout)  # [samples + heldout, T], held-out last
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    linears = quantizable_linears(model)
    hessians = layer_hessians(model, linears, windows, args.samples)
    return {name: m.weight.detach().float() for name, m in linears.items()}, hessians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an untied model folder")
    parser.add_argument("--calibration", type=Path, help="the corpus's calibration.txt")
    parser.add_argument("--synthetic", help="a shipped architecture name instead of --model")
    parser.add_argument("--rows", type=int, default=256, help="rows per matrix (--synthetic)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--groups", default="32,64,128")
    parser.add_argument("--sym", default="false,true")
    parser.add_argument("--gptq", action="store_true")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()

    from fourbit.quant.grid import Grid

    torch.set_num_threads(1)
    fit, held = args.samples * args.seq_len, args.heldout * args.seq_len
    if args.synthetic:
        weights, hessians = synthetic_layers(args.synthetic, args.rows, fit, held, args.seed)
        print(f"synthetic {args.synthetic}: one decoder layer and the head, rows 0:{args.rows}; "
              f"{fit} tokens to fit, {held} held out; relative held-out output error x 1e3\n")
    else:
        if not (args.model and args.calibration):
            parser.error("give --model and --calibration, or --synthetic")
        weights, hessians = model_layers(args)
        print(f"model {args.model}; {args.samples} x {args.seq_len} calibration tokens to fit, "
              f"{args.heldout} x {args.seq_len} held out; unquantized inputs; "
              "relative held-out output error x 1e3\n")
    results = {}
    for sym in (s == "true" for s in args.sym.split(",")):
        for group in map(int, args.groups.split(",")):
            grid = Grid(group_size=group, sym=sym)
            tag = f"{'sym' if sym else 'asym'} g{group}"
            started = time.monotonic()
            rows = {name: errors_of_layer(w, *hessians[name], grid, args.gptq)
                    for name, w in weights.items() if w.shape[1] % group == 0}
            results[tag] = rows
            cols = list(next(iter(rows.values())))
            print(f"## {tag} ({time.monotonic() - started:.0f} s)")
            print(f"{'layer':32s}" + "".join(f"{c:>13s}" for c in cols))
            for name, row in rows.items():
                print(f"{name:32s}" + "".join(f"{row[c] * 1e3:13.4f}" for c in cols))
            mean = {c: sum(r[c] for r in rows.values()) / len(rows) for c in cols}
            print(f"{'mean over layers':32s}" + "".join(f"{mean[c] * 1e3:13.4f}" for c in cols))
            base = "minmax"
            worse = {c: sum(r[c] > r[base] for r in rows.values()) for c in cols}
            print(f"{'layers worse than minmax':32s}" + "".join(f"{worse[c]:13d}" for c in cols))
            if args.gptq:
                worse_g = {c: sum(r[c] > r["gptq"] for r in rows.values()) for c in cols}
                print(f"{'layers worse than gptq minmax':32s}"
                      + "".join(f"{worse_g[c]:13d}" for c in cols))
            print()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
