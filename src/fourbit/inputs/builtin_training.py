"""The builtin model's training process: ``python -m fourbit.inputs.builtin_training``.

:func:`fourbit.inputs.builtin_model.train_builtin_model` starts it in the environment
:mod:`fourbit.inputs.pinned_kernels` pins. It trains the tokenizer and the model on the
corpus's train split, seeded and on deterministic kernels with a fixed thread count,
saves a Hugging Face folder and writes training.json (what was trained, how long, how
well, on which kernels).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fourbit.inputs.builtin_model import _new_model, resolve_spec
from fourbit.inputs.pinned_kernels import PINNED_ATEN_CAPABILITY, PINNED_KERNELS
from fourbit.inputs.tokenizer import BOS_ID, EOS_ID, UNK_ID, check_roundtrip, train_tokenizer
from fourbit.progress import Progress, setup_logging

WARMUP_FRACTION = 0.1  # of the steps, rising linearly to lr before the cosine decay
FINAL_LR_FRACTION = 0.1  # the cosine ends at this fraction of lr, not at zero
LOSS_AVERAGE_STEPS = 10  # final_train_loss averages the last steps: one batch is noisy
GRADIENT_CLIP = 1.0
ROUNDTRIP_SNIPPETS = 8
ROUNDTRIP_SNIPPET_CHARS = 2000


def _train_here(corpus_dir: Path, out_dir: Path, spec: dict) -> None:
    """The training itself, in this process, into the existing folder ``out_dir``."""
    import torch

    pinned = all(os.environ.get(key) == value for key, value in PINNED_KERNELS.items())
    capability = torch.backends.cpu.get_cpu_capability()
    if pinned and capability != PINNED_ATEN_CAPABILITY:
        raise RuntimeError(
            f"ATEN_CPU_CAPABILITY={PINNED_KERNELS['ATEN_CPU_CAPABILITY']} was set, yet torch "
            f"dispatches to {capability}; the pin did not take"
        )
    train_path, evaluation_path = corpus_dir / "train.txt", corpus_dir / "evaluation.txt"
    evaluation_text = evaluation_path.read_text(encoding="utf-8")
    with _deterministic_torch(spec["threads"]):
        _train_tokenizer_into(out_dir, train_path, evaluation_text, spec)
        train_stream = _token_stream(out_dir, train_path.read_text(encoding="utf-8"))
        evaluation_stream = _token_stream(out_dir, evaluation_text)
        _require_enough_tokens(train_stream, evaluation_stream, spec)
        model = _new_model(spec)
        started, cpu_started = time.monotonic(), time.process_time()
        final_loss = _train(model, train_stream, spec)
        wall_seconds = time.monotonic() - started
        model.save_pretrained(out_dir)
        report = _training_report(spec, out_dir, train_path, train_stream, wall_seconds, final_loss)
        # CPU time of every thread: the kernels' cost, less swayed by a busy host than wall time
        report["cpu_seconds"] = time.process_time() - cpu_started
        report.update(_held_out_perplexity(model, evaluation_stream, spec))
    report["kernels"] = {
        "pinned": dict(PINNED_KERNELS) if pinned else None,
        "aten_capability": capability,
        "threads": spec["threads"],
        "machine": platform.machine(),
    }
    (out_dir / "training.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


@contextmanager
def _deterministic_torch(threads: int) -> Iterator[None]:
    """Fix threads and force deterministic kernels, restoring the caller's settings afterwards."""
    import torch

    saved_threads = torch.get_num_threads()
    saved_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        torch.use_deterministic_algorithms(saved_deterministic)


def _train_tokenizer_into(folder: Path, train_path: Path, evaluation_text: str, spec: dict) -> None:
    """Train the tokenizer into the model folder and check it on held-out text."""
    train_tokenizer(train_path, folder, spec["vocab_size"], seed=spec["seed"])
    check_roundtrip(folder, _snippets(evaluation_text))


def _snippets(text: str) -> list[str]:
    """Evenly spaced pieces of ``text``, cut at line starts so indentation is included."""
    step = max(1, len(text) // ROUNDTRIP_SNIPPETS)
    snippets = []
    for start in range(0, len(text), step):
        line_start = text.rfind("\n", 0, start) + 1
        snippets.append(text[line_start : line_start + ROUNDTRIP_SNIPPET_CHARS])
    return snippets[:ROUNDTRIP_SNIPPETS]


def _token_stream(tokenizer_dir: Path, text: str):
    import sentencepiece as spm
    import torch

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    return torch.tensor(sp.encode(text), dtype=torch.long)


def _require_enough_tokens(train_stream, evaluation_stream, spec: dict) -> None:
    window = spec["seq_len"] - 1  # text tokens per window; the first position holds BOS
    for split, stream in (("train", train_stream), ("evaluation", evaluation_stream)):
        if len(stream) < window + 1:
            raise ValueError(
                f"the {split} split has {len(stream)} tokens, fewer than one window of "
                f"seq_len={spec['seq_len']}; use a larger corpus or a smaller seq_len"
            )


def _windows(stream, starts, seq_len: int):
    """Rows of BOS followed by ``seq_len - 1`` stream tokens from each start."""
    import torch

    offsets = torch.arange(seq_len - 1)
    text = stream[starts[:, None] + offsets[None, :]]
    bos = torch.full((len(starts), 1), BOS_ID, dtype=torch.long)
    return torch.cat([bos, text], dim=1)


def _learning_rate(step: int, spec: dict) -> float:
    warmup = max(1, round(spec["steps"] * WARMUP_FRACTION))
    if step < warmup:
        return spec["lr"] * (step + 1) / warmup
    progress = (step - warmup) / max(1, spec["steps"] - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return spec["lr"] * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * cosine)


def _train(model, stream, spec: dict) -> float:
    """Run the fixed number of steps; return the mean loss of the last few."""
    import torch

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=spec["weight_decay"]
    )
    # Its own generator: batches depend only on the seed, not on what else drew random numbers.
    batches = torch.Generator().manual_seed(spec["seed"])
    last_start = len(stream) - (spec["seq_len"] - 1)
    tokens_per_step = spec["batch_size"] * (spec["seq_len"] - 1)
    progress = Progress("train builtin model", spec["steps"], unit="step")
    recent_losses: list[float] = []
    started = time.monotonic()
    model.train()
    for step in range(spec["steps"]):
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, spec)
        starts = torch.randint(0, last_start + 1, (spec["batch_size"],), generator=batches)
        inputs = _windows(stream, starts, spec["seq_len"])
        loss = model(input_ids=inputs, labels=inputs).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRADIENT_CLIP)
        optimizer.step()
        recent_losses = (recent_losses + [loss.item()])[-LOSS_AVERAGE_STEPS:]
        tokens_per_second = tokens_per_step * (step + 1) / (time.monotonic() - started)
        progress.update(note=f"loss {recent_losses[-1]:.3f}, {tokens_per_second:,.0f} tokens/s")
    model.eval()
    return sum(recent_losses) / len(recent_losses)


def _held_out_perplexity(model, stream, spec: dict) -> dict:
    """Perplexity over non-overlapping windows of the evaluation split (BOS + seq_len-1 tokens)."""
    import torch

    window = spec["seq_len"] - 1
    count = min(spec["eval_windows"], len(stream) // window)
    starts = torch.arange(count) * window
    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for batch in starts.split(spec["batch_size"]):
            inputs = _windows(stream, batch, spec["seq_len"])
            logits = model(input_ids=inputs).logits[:, :-1]
            targets = inputs[:, 1:]
            total_nll += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            ).item()
            total_tokens += targets.numel()
    return {
        "held_out_perplexity": math.exp(total_nll / total_tokens),
        "held_out_windows": count,
        "held_out_tokens": total_tokens,
        "uniform_perplexity": spec["vocab_size"],
    }


def _training_report(
    spec: dict, folder: Path, train_path: Path, train_stream, wall_seconds: float, final_loss: float
) -> dict:
    import torch
    import transformers

    tokens_seen = spec["steps"] * spec["batch_size"] * (spec["seq_len"] - 1)
    return {
        "spec": spec,
        "steps": spec["steps"],
        "train_tokens_seen": tokens_seen,
        "train_split_tokens": len(train_stream),
        "train_split_sha256": _sha256(train_path),
        "epochs": tokens_seen / len(train_stream),
        "wall_seconds": wall_seconds,
        "tokens_per_second": tokens_seen / wall_seconds,
        "final_train_loss": final_loss,
        "model_sha256": _sha256(folder / "model.safetensors"),
        "special_token_ids": {"unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    """The training process: ``python -m fourbit.inputs.builtin_training --corpus D --out D --spec JSON``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--corpus", type=Path, required=True, help="a prepared corpus folder")
    parser.add_argument("--out", type=Path, required=True, help="an existing, empty folder")
    parser.add_argument("--spec", type=json.loads, required=True, help="a resolved spec, as JSON")
    args = parser.parse_args(argv)
    setup_logging()
    _train_here(args.corpus, args.out, resolve_spec(args.spec))


if __name__ == "__main__":
    main()
