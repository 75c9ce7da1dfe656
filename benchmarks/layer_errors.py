"""Per-layer output error of each arm of a finished study, on calibration activations; not a test.

    .venv/bin/python benchmarks/layer_errors.py --study results --sequences 8

For every linear layer of the untied model (the head included), the relative output
error of each arm's weights, ||X (W - W_hat)^T||^2 / ||X W^T||^2, where X are that
layer's inputs in the *unquantized* model on the first ``--sequences`` sequences of
``--seq-len`` tokens of the corpus's calibration split, and W_hat is the arm's dense
expansion (arms/<id>/dense, the control checkpoint). Using the unquantized model's
inputs isolates each layer's own error from the errors of the layers before it. The
plain relative weight error ||W - W_hat||^2 / ||W||^2 is printed beside it: an arm can
win on one and lose on the other, which is what tells a weight-error objective from
an output-error one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def study_paths(study: Path) -> dict:
    models = [p for p in study.glob("*/untied") if p.is_dir()]
    if len(models) != 1:
        raise SystemExit(f"expected one <model>/untied under {study}, found {len(models)}: "
                         "point --study at a finished study's results folder")
    model_dir = models[0].parent
    arms = sorted(p for p in model_dir.glob("arms/*/dense") if p.is_dir())
    corpus = sorted(study.glob("corpus/*/calibration.txt"))
    if not arms or not corpus:
        raise SystemExit(f"{model_dir} has no arms/*/dense or {study} no corpus/*/calibration.txt")
    return {"untied": models[0], "arms": arms, "calibration": corpus[0]}


def layer_inputs(model, linears: dict, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each of ``linears``' inputs, [tokens, in_features], from one forward of ``ids``."""
    captured, hooks = {}, []
    for name, module in linears.items():
        def keep(_module, args, _out, name=name):
            captured[name] = args[0].detach().reshape(-1, args[0].shape[-1])
        hooks.append(module.register_forward_hook(keep))
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return captured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, default=Path("results"))
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fourbit.checkpoints.hf import load_tensors, quantizable_linears

    paths = study_paths(args.study)
    tokenizer = AutoTokenizer.from_pretrained(paths["untied"])
    ids = tokenizer.encode(paths["calibration"].read_text(), add_special_tokens=False)
    need = args.sequences * args.seq_len
    if len(ids) < need:
        raise SystemExit(f"the calibration split has {len(ids)} tokens; {need} asked for")
    batch = torch.tensor(ids[:need]).view(args.sequences, args.seq_len)
    model = AutoModelForCausalLM.from_pretrained(paths["untied"], dtype=torch.float32).eval()
    linears = quantizable_linears(model)  # what the arms quantize: the layers' linears and the head
    inputs = layer_inputs(model, linears, batch)
    weights = {name: module.weight.detach() for name, module in linears.items()}
    arm_names = [p.parent.name for p in paths["arms"]]
    rows = {name: {} for name in weights}
    for arm, folder in zip(arm_names, paths["arms"], strict=True):
        state = load_tensors(folder)
        for name, w in weights.items():
            w_hat = state[f"{name}.weight"].float()
            x = inputs[name]
            exact = x @ w.T
            output = ((x @ (w - w_hat).T).square().sum() / exact.square().sum()).item()
            weight = ((w - w_hat).square().sum() / w.square().sum()).item()
            rows[name][arm] = (output, weight)

    print(f"relative output error ||X(W-W_hat)^T||^2/||XW^T||^2 [relative weight error], "
          f"{args.sequences} x {args.seq_len} calibration tokens, unquantized inputs\n")
    width = max(len(a) for a in arm_names) + 2
    print(f"{'layer':34s}" + "".join(f"{a:>{width}s}" for a in arm_names))
    for name, by_arm in rows.items():
        print(f"{name:34s}" + "".join(f"{by_arm[a][0]:>{width - 10}.5f} [{by_arm[a][1]:.4f}]"
                                      for a in arm_names))
    means = {a: [sum(rows[n][a][k] for n in rows) / len(rows) for k in (0, 1)] for a in arm_names}
    print(f"{'mean over layers':34s}" + "".join(f"{means[a][0]:>{width - 10}.5f} [{means[a][1]:.4f}]"
                                                for a in arm_names))
    print(json.dumps({"mean_output_error": {a: m[0] for a, m in means.items()},
                      "mean_weight_error": {a: m[1] for a, m in means.items()}}, indent=1))


if __name__ == "__main__":
    main()
