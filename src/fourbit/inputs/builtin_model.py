"""The study's default model: a small Llama trained here, from scratch, on a prepared corpus.

It needs no download, so the whole study runs offline; and because every
source of randomness is seeded, the thread count fixed, deterministic kernels
forced and the kernels' instruction set pinned (PINNED_KERNELS), the same
corpus and spec give the same weights bit for bit on every x86-64 host with
AVX2, whatever else its CPU has (with the same library versions).

The training runs in a child process (``python -m fourbit.inputs.builtin_model``)
whose environment pins the dispatch: torch and oneMKL read those variables
once, when they load, so the process that trains must have them from its start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from fourbit.atomic import atomic_dir
from fourbit.inputs.tokenizer import BOS_ID, EOS_ID, UNK_ID, check_roundtrip, train_tokenizer
from fourbit.progress import Progress, setup_logging

log = logging.getLogger("fourbit")

DEFAULT_SPEC = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    # The workflow scores perplexity on 512-token windows; a model trained on
    # shorter sequences would be scored on positions it never saw.
    "seq_len": 512,
    "batch_size": 8,
    "steps": 150,
    "lr": 3e-3,
    "weight_decay": 0.1,
    "seed": 0,
    # Fixed, not "all cores": CPU kernels may split reductions by thread, so
    # the thread count can change the rounding and with it the weights; a host
    # with fewer cores runs the same threads, only slower. Two: the training
    # job claims every core of the run (threads: workflow.cores), so on the
    # 2-core hosts this study is sized for nothing of the study runs beside it.
    # Beside someone else's busy job, two threads that spin while they wait
    # (OpenMP's default) are slower than one: each parallel op waits for its
    # descheduled second thread. WAIT_POLICY removes that.
    "threads": 2,
    "eval_windows": 128,
}

# For workflow tests: trains in seconds and still learns something.
TINY_SPEC = {
    **DEFAULT_SPEC,
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_layers": 1,
    "num_heads": 4,
    "num_kv_heads": 2,
    "seq_len": 128,
    "batch_size": 8,
    "steps": 40,
    "eval_windows": 16,
}

# Row lengths that are multiples of 256 let every 4-bit format in the study
# (groups of 64 or 128, llama.cpp's 256-wide K-quant super-blocks) cover whole
# rows, so no tensor silently falls back to another format.
MULTIPLE_OF_256 = ("vocab_size", "hidden_size", "intermediate_size")
FLOAT_KEYS = ("lr", "weight_decay")
MAY_BE_ZERO = ("seed", "weight_decay")
WARMUP_FRACTION = 0.1  # of the steps, rising linearly to lr before the cosine decay
FINAL_LR_FRACTION = 0.1  # the cosine ends at this fraction of lr, not at zero
LOSS_AVERAGE_STEPS = 10  # final_train_loss averages the last steps: one batch is noisy
GRADIENT_CLIP = 1.0
ROUNDTRIP_SNIPPETS = 8
ROUNDTRIP_SNIPPET_CHARS = 2000
PRESETS = {"default": DEFAULT_SPEC, "tiny": TINY_SPEC}
# Waiting threads sleep instead of spinning: no effect on the numbers, but on a
# host where another job holds a core, two spinning threads trained slower than
# one. Measured on a 2-core AMD EPYC (AVX2) beside one other busy process,
# default preset, 8 steps, pinned: 1 thread 45-49 s; 2 threads spinning 69-82 s,
# sleeping 47-49 s; the same weights in every case.
WAIT_POLICY = "PASSIVE"

# Bumped whenever the same spec and corpus would train other weights (the kernels'
# pin, the training loop's arithmetic): part of training_identity().
# 2: kernels pinned (PINNED_KERNELS), two threads.
TRAINING_SCHEME = 2

# The environment the training process runs in, on x86-64: what each library
# dispatches on, pinned to what every x86 host here has (AVX2), so an AVX-512
# host trains the same weights as an AVX2-only one. Measured with torch
# 2.13.0+cpu (torch.__config__.show(): BLAS_INFO=mkl, oneMKL 2024.2, oneDNN
# v3.12.0, "CPU capability usage: AVX2" on an AVX2 host).
PINNED_KERNELS = {
    # ATen's own vectorised kernels (elementwise ops, softmax, RMSNorm, the loss,
    # AdamW): torch picks default, avx2 or avx512 once, at import.
    "ATEN_CPU_CAPABILITY": "avx2",
    # oneMKL's SGEMM runs every float32 matmul of the training (MKL_VERBOSE=1
    # lists only SGEMM calls). On a non-Intel CPU oneMKL honours only the AUTO and
    # COMPATIBLE branches: MKL_CBWR=AVX2 runs as AUTO there (MKL_VERBOSE prints
    # CNR:AUTO on an AMD EPYC), and AUTO dispatches on the host's instruction set.
    # COMPATIBLE is SSE2 without the approximate rcpps/rsqrtps, whose results
    # differ between Intel and other vendors: the one branch that is the same on
    # every x86 CPU. With it CNR's "fixed cache sizes, deterministic reductions,
    # static scheduling" hold for the fixed thread count. Its cost: SSE2 GEMMs,
    # 2.5-2.8x the training's CPU time (default preset, 8 steps, one thread, AMD
    # EPYC AVX2: 45-51 s against 18 s unpinned).
    "MKL_CBWR": "COMPATIBLE",
    # Exactly the threads asked for: MKL and OpenMP may otherwise use fewer than
    # requested on a host with fewer cores, which changes how sums are split.
    "MKL_DYNAMIC": "FALSE",
    "OMP_DYNAMIC": "FALSE",
    # oneDNN: float32 training in torch 2.13 does not call it (ONEDNN_VERBOSE=1
    # prints nothing), capped anyway in case another torch routes matmuls there.
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
# ATen's AVX2 kernels are compiled for AVX2 with FMA: a CPU without both would
# stop on an illegal instruction, so such a host is refused up front.
PINNED_CPU_FLAGS = ("avx2", "fma")
PINNED_ATEN_CAPABILITY = "AVX2"  # what torch.backends.cpu.get_cpu_capability() then reports
X86_64 = ("x86_64", "amd64")


def resolve_spec(spec: dict) -> dict:
    """``spec`` over the defaults, validated; errors name the key and what it must be."""
    unknown = sorted(set(spec) - set(DEFAULT_SPEC))
    if unknown:
        raise ValueError(
            f"builtin model spec has unknown key(s) {unknown}; "
            f"known keys are {sorted(DEFAULT_SPEC)}"
        )
    resolved = {key: _number(key, value) for key, value in {**DEFAULT_SPEC, **spec}.items()}
    for key in MULTIPLE_OF_256:
        if resolved[key] % 256:
            raise ValueError(
                f"builtin model spec {key}={resolved[key]} must be a multiple of 256 "
                f"(e.g. {max(256, round(resolved[key] / 256) * 256)}) "
                "so 4-bit groups and K-quants cover whole rows"
            )
    _check_heads(resolved)
    if resolved["seq_len"] < 2:
        raise ValueError(
            f"builtin model spec seq_len={resolved['seq_len']} must be at least 2 "
            "(BOS plus one token)"
        )
    return resolved


def _number(key: str, value: object) -> int | float:
    wanted = float if key in FLOAT_KEYS else int
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (wanted is int and value != int(value))
    ):
        kind = "a number" if wanted is float else "a whole number"
        raise ValueError(f"builtin model spec {key}={value!r} must be {kind}")
    value = wanted(value)
    if value < 0 or (value == 0 and key not in MAY_BE_ZERO):
        bound = "zero or more" if key in MAY_BE_ZERO else "more than zero"
        raise ValueError(f"builtin model spec {key}={value!r} must be {bound}")
    return value


def _check_heads(spec: dict) -> None:
    hidden, heads, kv_heads = spec["hidden_size"], spec["num_heads"], spec["num_kv_heads"]
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(
            f"builtin model spec hidden_size={hidden} / num_heads={heads} must give a whole, even "
            "head_dim (rotary embeddings rotate pairs)"
        )
    if heads % kv_heads:
        raise ValueError(
            f"builtin model spec num_heads={heads} must be a multiple of num_kv_heads={kv_heads}"
        )


def train_builtin_model(
    corpus_dir: Path, out_dir: Path, spec: dict, *, pin_kernels: bool = True
) -> dict:
    """Train tokenizer and model on the corpus's train split; save a Hugging Face folder.

    ``out_dir`` gets model.safetensors (float32, tied embeddings), config.json,
    generation_config.json, the tokenizer files and training.json, whose
    contents (what was trained, how long, how well, on which kernels) are
    returned. The training runs in a child process with PINNED_KERNELS set;
    ``pin_kernels=False`` leaves the dispatch to the host (and to the caller's
    environment), which only measurements of the pin itself want.
    """
    spec = resolve_spec(spec)
    corpus_dir = Path(corpus_dir)
    for path in (corpus_dir / "train.txt", corpus_dir / "evaluation.txt"):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist; prepare the corpus into {corpus_dir} first"
            )
    env = training_environment(os.environ, spec["threads"], pin_kernels=pin_kernels)
    with atomic_dir(out_dir) as temp:
        _run_training_process(corpus_dir, temp, spec, env)
        report = json.loads((temp / "training.json").read_text())
    log.info(
        "builtin model: held-out perplexity %.2f (uniform %d) after %d steps in %.0f s "
        "on %d threads, kernels %s",
        report["held_out_perplexity"],
        report["uniform_perplexity"],
        spec["steps"],
        report["wall_seconds"],
        spec["threads"],
        "pinned" if report["kernels"]["pinned"] else "as the host dispatches",
    )
    return report


def training_identity(preset: str, overrides: dict) -> dict:
    """Everything that determines the builtin model's weights besides the corpus:
    for the model id to hash, so other weights never share an id."""
    from importlib.metadata import version

    return {
        "scheme": TRAINING_SCHEME,
        "spec": resolve_spec({**PRESETS[preset], **overrides}),
        "kernels": PINNED_KERNELS,
        "versions": {name: version(name) for name in ("torch", "transformers", "sentencepiece")},
    }


def training_environment(outer: dict, threads: int, *, pin_kernels: bool = True) -> dict:
    """The training process's environment: ``outer`` with the thread count fixed and,
    on x86-64, PINNED_KERNELS over whatever ``outer`` sets for them."""
    env = {**outer, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "OMP_WAIT_POLICY": WAIT_POLICY}
    if pin_kernels and _is_x86_64():
        _require_cpu_flags(PINNED_CPU_FLAGS)
        env.update(PINNED_KERNELS)
    # The child imports this package from where the parent found it.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, outer.get("PYTHONPATH")]))
    return env


def _is_x86_64() -> bool:
    return platform.machine().lower() in X86_64


def _require_cpu_flags(flags: tuple[str, ...], cpuinfo: Path = Path("/proc/cpuinfo")) -> None:
    if not cpuinfo.is_file():
        return  # not Linux: torch itself then says whether it could run AVX2 kernels
    present = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            break
    missing = [flag for flag in flags if flag not in present]
    if missing:
        raise RuntimeError(
            f"this CPU lacks {', '.join(missing)}: the builtin model trains on AVX2 kernels "
            "on every x86 host, so that every host trains the same weights under one id; "
            "use a host with AVX2 and FMA (any x86 CPU since 2013-2015), or model.source: "
            "hf or path"
        )


def _run_training_process(corpus_dir: Path, out_dir: Path, spec: dict, env: dict) -> None:
    """``python -m fourbit.inputs.builtin_model`` in ``env``; its log lines go to this process's
    stderr (the rule's log) as they come."""
    command = [sys.executable, "-m", "fourbit.inputs.builtin_model", "--corpus", str(corpus_dir),
               "--out", str(out_dir), "--spec", json.dumps(spec, sort_keys=True)]
    tail: list[str] = []
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as child:
        for line in child.stdout:
            sys.stderr.write(line)
            tail = (tail + [line.rstrip()])[-20:]
    if child.returncode != 0:
        raise RuntimeError(
            f"training the builtin model failed (exit {child.returncode}); its last lines:\n"
            + "\n".join(tail)
        )


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


def _new_model(spec: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        head_dim=spec["hidden_size"] // spec["num_heads"],
        max_position_embeddings=spec["seq_len"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # seeds the initial weights, not the caller's RNG
        torch.manual_seed(spec["seed"])
        return LlamaForCausalLM(config).to(torch.float32)


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
    """The training process: ``python -m fourbit.inputs.builtin_model --corpus D --out D --spec JSON``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--corpus", type=Path, required=True, help="a prepared corpus folder")
    parser.add_argument("--out", type=Path, required=True, help="an existing, empty folder")
    parser.add_argument("--spec", type=json.loads, required=True, help="a resolved spec, as JSON")
    args = parser.parse_args(argv)
    setup_logging()
    _train_here(args.corpus, args.out, resolve_spec(args.spec))


if __name__ == "__main__":
    main()
