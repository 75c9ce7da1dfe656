"""End to end, each grid search's whole model against the unquantized one; not a test.

    .venv/bin/python benchmarks/grid_end_to_end.py --model results/<model id>/untied \
        --corpus results/corpus/<corpus id> [--windows 64 --samples 32 --heldout 16]

Quantizes the model with cpu_int4 / rtn / gptq arms that differ only by ``search``
(calibrated ones with ``--samples`` calibration windows, and every search checked per
layer against minmax on ``--heldout`` held-out windows, so not the default config's 128), expands each to float32 (the dense control, exact), and
scores the first ``--windows`` windows of 512 tokens of the evaluation split on the
reference engine: perplexity, mean next-token KL(base || arm) in nats/token (with the
standard error over windows) and top-1 agreement with the unquantized model.
Per-layer errors are benchmarks/grid_search.py's; this says whether they carry through.

Measured 2026-12-01 on a 2-core AVX2 AMD EPYC, the default model (builtin_default-543ad5183b),
the command above with its defaults (base ppl 86.0069 on these 64 windows; every search
checked per tensor against minmax on 16 held-out windows, the last column the tensors
where minmax won; bits/weight of the quantized matrices, from the files):

    arm                                bits     ppl delta  KL 1e-3 (s.e.)  top-1    kept minmax
    cpu_int4 g128 minmax                4.188  +0.2459   2.109 (0.029)     94.57%
    cpu_int4 g128 shrink                4.188  +0.1223   2.031 (0.029)     94.54%  8 of 29
    cpu_int4 g128 weighted              4.188  +0.2647   1.421 (0.021)     95.68%  2 of 29
    cpu_int4 g64 shrink                 4.375  +0.0516   1.359 (0.019)     96.40%  8 of 29
    cpu_int4 g64 weighted               4.375  +0.1112   1.117 (0.010)     96.26%  0 of 29
    rtn sym g128 minmax                 4.229  +0.0372   1.849 (0.015)     94.71%
    rtn sym g128 weighted               4.229  +0.3371   1.495 (0.026)     95.65%  2 of 29
    cpu_int4 g128 act shrink+H          4.188  +0.3018   1.354 (0.033)     96.50%  2 of 29
    cpu_int4 g128 act weighted+H        4.188  +0.2775   1.309 (0.027)     96.34%  0 of 29
    gptq sym g128 minmax                4.229  +0.0385   0.105 (0.011)     99.17%
    gptq sym g128 weighted              4.229  +0.0327   0.099 (0.007)     99.17%  1 of 29
    gptq asym g128 weighted             4.157  +0.0159   0.075 (0.003)     99.02%  10 of 29
    gptq asym g128, head dense          4.157  -0.0125   0.038 (0.002)     99.42%  9 of 28
    cpu_int4 g64 weighted, head dense   4.375  -0.0181   0.249 (0.010)     98.62%  0 of 28
    gptq asym g128, head 8-bit          5.149  -0.0253   0.042 (0.002)     99.37%  10 of 28
    cpu_int4 g64 weighted, head 8-bit   5.344  -0.0183   0.251 (0.010)     98.60%  0 of 28
    gptq asym g128, mixed +0.5          4.653  +0.0331   0.039 (0.002)     99.28%  10 of 29
    gptq asym g128, mixed +1.0          5.087  +0.0354   0.039 (0.002)     99.28%  10 of 29

By KL every search beats minmax of its own grid (by 3-40%), but on this small model the
ppl deltas do not follow KL. The head is a fifth of this model's weights: kept dense
(float32, so 15.3-15.4 bits per parameter of the file) it halves gptq asym's KL and cuts
cpu_int4 g64's by 4.5x; on the 8-bit grid (quantize_head: 8) it keeps nearly all of
that for one bit per quantized weight more (the bits column counts the head's 8-bit
codes; the dense rows count only the 4-bit matrices). llama.cpp's Q4_K_M spends 5.241
bits per weight on this model (docs/default-study-2026-12-02). mixed_precision (the two
mixed rows, same day and host) measured layer 0's q/k/v (KL 2.9e-5 alone at 4 bits) and
the head (2.6e-5) as the two sets that matter, every other set below 7e-7: +0.5 bits
moved layer 0's q/k/v, o and down and layer 3's q/k/v, which keeps as much KL as the
8-bit head for half its bits; +1.0 (the head alone would take 0.99) added only more
attention sets, which changed nothing measurable.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

ARMS = {
    "cpu_int4 g128 minmax": {"method": "cpu_int4", "group_size": 128, "search": "minmax"},
    "cpu_int4 g128 shrink": {"method": "cpu_int4", "group_size": 128, "search": "shrink"},
    "cpu_int4 g128 weighted": {"method": "cpu_int4", "group_size": 128},
    "cpu_int4 g64 shrink": {"method": "cpu_int4", "group_size": 64, "search": "shrink"},
    "cpu_int4 g64 weighted": {"method": "cpu_int4", "group_size": 64},
    "rtn sym g128 minmax": {"method": "rtn", "group_size": 128},
    "rtn sym g128 weighted": {"method": "rtn", "group_size": 128, "search": "weighted",
                              "shrink_steps": 20},
    "cpu_int4 g128 act shrink+H": {"method": "cpu_int4", "group_size": 128,
                                   "importance": "activation", "search": "shrink"},
    "cpu_int4 g128 act weighted+H": {"method": "cpu_int4", "group_size": 128,
                                     "importance": "activation"},
    "gptq sym g128 minmax": {"method": "gptq", "group_size": 128, "search": "minmax"},
    "gptq sym g128 weighted": {"method": "gptq", "group_size": 128},
    "gptq asym g128 weighted": {"method": "gptq", "group_size": 128, "sym": False},
    # what a head at higher precision is worth (the upper bound: not quantized at all)
    "gptq asym g128, head dense": {"method": "gptq", "group_size": 128, "sym": False,
                                   "quantize_head": False},
    "cpu_int4 g64 weighted, head dense": {"method": "cpu_int4", "group_size": 64,
                                          "quantize_head": False},
    # ... and what the 8-bit head (quantize_head: 8) keeps of that, for about 0.8 bits
    "gptq asym g128, head 8-bit": {"method": "gptq", "group_size": 128, "sym": False,
                                   "quantize_head": 8},
    "cpu_int4 g64 weighted, head 8-bit": {"method": "cpu_int4", "group_size": 64,
                                          "quantize_head": 8},
    # ... and the input embedding on the 8-bit grid (quantize_embedding: 8), which the bits
    # per weight over all matrices otherwise count at its dense 32 bits
    "gptq asym g128, embedding 8-bit": {"method": "gptq", "group_size": 128, "sym": False,
                                        "quantize_embedding": 8},
    "gptq asym g64, embedding 8-bit": {"method": "gptq", "group_size": 64, "sym": False,
                                       "quantize_embedding": 8},
    # ... and what the same extra bits buy where measured sensitivity puts them (mixed_precision)
    "gptq asym g128, mixed +0.5": {"method": "gptq", "group_size": 128, "sym": False,
                                   "mixed_precision": {"extra_bits": 0.5}},
    "gptq asym g128, mixed +1.0": {"method": "gptq", "group_size": 128, "sym": False,
                                   "mixed_precision": {"extra_bits": 1.0}},
    "cpu_int4 g64 weighted, mixed +0.8": {"method": "cpu_int4", "group_size": 64,
                                          "mixed_precision": {"extra_bits": 0.8}},
}


def log_probs(checkpoint: Path, windows: torch.Tensor) -> torch.Tensor:
    """[windows, T - 1, V] next-token log-probabilities of a dense checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.cat([torch.log_softmax(model(b).logits[:, :-1].float(), -1)
                          for b in windows.split(8)])  # [8, T, V] -> [8, T - 1, V] each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, required=True, help="results/corpus/<corpus id>")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--arms", default="", help="only the arms whose label contains this text")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from fourbit.quantizers.shapes import shared_pass_quant
    from fourbit.schema import canonical_quant, load_schema
    from fourbit.steps.quantize import (
        dequantize_checkpoint,
        measure_sensitivity,
        quantize_checkpoint,
    )

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer((args.corpus / "evaluation.txt").read_text(), add_special_tokens=False)
    ids = torch.tensor(ids["input_ids"][: args.windows * 512]).view(args.windows, 512)
    base = log_probs(args.model, ids)
    p_base = base.exp()
    targets = ids[:, 1:, None]
    base_nll = -base.gather(-1, targets).mean().item()
    print(f"{args.model}: first {args.windows} x 512 evaluation tokens, base ppl "
          f"{math.exp(base_nll):.4f}\n")
    schema = load_schema()
    passes = {}  # mixed_precision arms that differ only in their budget share one pass, as in a study
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, quant) in enumerate(ARMS.items()):
            if args.arms not in label:
                continue
            quant = canonical_quant(quant, schema)
            if "calibration" in quant:  # fitted (samples) and/or a search checked on held-out windows
                fitted = {"samples": args.samples} if "samples" in quant["calibration"] else {}
                quant["calibration"] = {**quant["calibration"], "heldout": args.heldout, **fitted}
            folder = Path(tmp) / str(i)
            shared = None
            if "mixed_precision" in quant:
                pass_quant = shared_pass_quant(quant)
                key = json.dumps(pass_quant, sort_keys=True)
                if key not in passes:
                    passes[key] = (folder / "four_bit", folder / "sensitivity.json")
                    measure_sensitivity(args.model, *passes[key], {"id": f"pass-{i}", "quant": pass_quant},
                                        calibration_text=args.corpus / "calibration.txt")
                shared = passes[key]
            manifest = quantize_checkpoint(
                args.model, folder / "q", folder / "arm.json",
                {"name": "t", "id": f"t-{i}", "quant": quant},
                calibration_text=args.corpus / "calibration.txt", shared_pass=shared)
            dequantize_checkpoint(folder / "q", folder / "d")
            arm = log_probs(folder / "d", ids)
            kl = (p_base * (base - arm)).sum(-1)  # [windows, T - 1]
            nll = -arm.gather(-1, targets).mean().item()
            top1 = (arm.argmax(-1) == base.argmax(-1)).float().mean().item()
            guard = manifest["method_facts"].get("heldout_guard")
            kept = f"  minmax kept on {guard['kept_minmax']}" if guard else ""
            mixed = manifest["method_facts"].get("mixed_precision")
            if mixed:
                kept += "  wider: " + ", ".join(f"{n}:{b}" for n, b in mixed["moved"].items())
            se = kl.mean(-1).std().item() / args.windows**0.5  # over windows
            delta = math.exp(nll) - math.exp(base_nll)
            storage = manifest["storage"]
            print(f"{label:38s} {storage['quantized_bits_per_weight']:.3f} bits/weight "
                  f"({storage['matrix_bits_per_weight']:.3f} over all matrices, "
                  f"{storage['file_bits_per_param']:.3f} per parameter of the file)  "
                  f"ppl {math.exp(nll):.4f} ({delta:+.4f})  KL "
                  f"{kl.mean().item() * 1e3:.3f}e-3 (s.e. {se * 1e3:.3f}e-3)  top-1 {top1:.2%}"
                  + kept, flush=True)


if __name__ == "__main__":
    main()
