"""How close llama-imatrix on text comes to the token ids a gptq arm calibrates on (issue 38);
not a test.

    .venv/bin/python benchmarks/imatrix_tokens.py --untied results/<model>/untied \\
        --gguf results/<model>/gguf/f16.gguf --calibration results/corpus/<corpus>/calibration.txt \\
        [--samples 128 --seq-len 512 --seed 0 --heldout 16] --out /tmp/imatrix-tokens

The study's imatrix step (fourbit.steps.llamacpp.importance_matrix) gives llama.cpp the
calibration windows' ids themselves (fourbit-imatrix). This measures what the plain route
would have given instead, on the same windows:

1. each window decoded by the model's tokenizer and encoded again: how many windows come
   back as their own ids, and how many ids differ;
2. llama-imatrix as users run it, on the windows' texts joined in stream order, with the
   chunk length the ids route uses: how many chunks it cut (its imatrix.chunk_count)
   against the windows, and how many tokens the tokenizer makes of that text;
3. the two importance matrices, per matrix: the relative difference of the mean squared
   activation per column (in_sum2 / count), ||text - ids|| / ||ids||.

Prints one JSON object; --out keeps the files.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from fourbit.llamacpp import common_arithmetic_flags, run_tool
from fourbit.llamacpp.build import ensure_llamacpp
from fourbit.llamacpp.imatrix import compute_imatrix, read_imatrix, vocabulary_bos
from fourbit.quantizers.calibration import calibration_ids, draw_windows
from fourbit.schema import canonical_quant, load_schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--untied", type=Path, required=True, help="the model folder (its tokenizer)")
    parser.add_argument("--gguf", type=Path, required=True, help="its f16 GGUF")
    parser.add_argument("--calibration", type=Path, required=True, help="the calibration split")
    parser.add_argument("--samples", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--heldout", type=int)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    given = {"samples": args.samples, "seq_len": args.seq_len, "seed": args.seed, "heldout": args.heldout}
    spec = block_defaults({k: v for k, v in given.items() if v is not None})
    out = args.out or Path(tempfile.mkdtemp(prefix="imatrix-tokens-"))
    out.mkdir(parents=True, exist_ok=True)
    tools = ensure_llamacpp()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.untied)
    ids = calibration_ids(args.untied, args.calibration)
    windows = draw_windows(ids, spec, spec["heldout"])[: spec["samples"]].tolist()
    texts = [tokenizer.decode(w) for w in windows]
    again = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    differing = sum(sum(a != b for a, b in zip(w, r)) + abs(len(w) - len(r)) for w, r in zip(windows, again))

    add_bos, _ = vocabulary_bos(args.gguf, tools.gguf_py)
    chunk = len(windows[0]) + add_bos
    by_ids = compute_imatrix(args.gguf, out / "ids.imatrix.gguf", windows, tools=tools, threads=args.threads)
    joined = "".join(texts)
    (out / "text.txt").write_text(joined)
    run_tool([tools.imatrix, "-m", args.gguf.resolve(), "-f", "text.txt", "-o", "text.imatrix.gguf",
              "-c", chunk, "-t", args.threads, "--no-ppl", *common_arithmetic_flags()],
             "llama-imatrix", merge_stderr=True, cwd=out)
    text_matrix = read_imatrix(out / "text.imatrix.gguf", tools.gguf_py)
    ids_matrix = read_imatrix(out / "ids.imatrix.gguf", tools.gguf_py)
    print(json.dumps({
        "calibration": spec,
        "windows": len(windows), "window_tokens": len(windows[0]), "bos_prepended": add_bos,
        "windows_that_reencode_to_their_ids": sum(w == r for w, r in zip(windows, again)),
        "ids_that_differ_after_reencoding": differing,
        "text_tokens_by_the_hf_tokenizer": len(tokenizer(joined, add_special_tokens=False)["input_ids"]),
        "ids_route": {k: by_ids[k] for k in ("chunks", "chunk_size", "tokens")},
        "text_route": {"chunks": text_matrix["chunks"], "chunk_size": text_matrix["chunk_size"],
                       "tokens": text_matrix["chunks"] * text_matrix["chunk_size"]},
        "relative_difference_of_mean_squares": relative_differences(text_matrix, ids_matrix),
        "files": str(out),
    }, indent=2))


def block_defaults(given: dict) -> dict:
    """A llama.cpp arm's calibration block with the schema's defaults, as a study fills them."""
    quant = {"method": "llamacpp", "imatrix": "calibration", "calibration": given}
    return canonical_quant(quant, load_schema())["calibration"]


def relative_differences(text: dict, ids: dict) -> dict:
    """Per matrix, ||mean_text - mean_ids|| / ||mean_ids|| of in_sum2 / tokens; the median
    and the largest over the matrices."""
    rows = {}
    for name, summed in ids["in_sum2"].items():
        mean_ids = np.asarray(summed, dtype=np.float64) / ids["tokens_per_matrix"][0]
        mean_text = np.asarray(text["in_sum2"][name], dtype=np.float64) / text["tokens_per_matrix"][0]
        rows[name] = float(np.linalg.norm(mean_text - mean_ids) / np.linalg.norm(mean_ids))
    values = sorted(rows.values())
    return {"median": values[len(values) // 2], "max": values[-1],
            "largest": max(rows, key=rows.get)}


if __name__ == "__main__":
    main()
