"""The study's default model: a small Llama trained here, from scratch, on a prepared corpus.

It needs no download, so the whole study runs offline; and because every
source of randomness is seeded, the thread count fixed, deterministic kernels
forced and the kernels' instruction set pinned (PINNED_KERNELS), the same
corpus and spec give the same weights bit for bit on every x86-64 host with
AVX2 from one CPU vendor, whatever else its CPU has (with the same library
versions; the vendor is part of the model id).

Here: the spec (presets and their validation), the model it defines, the identity
the model id hashes, and ``train_builtin_model``. The training runs in a child process
(:mod:`fourbit.inputs.builtin_training`) whose environment pins the dispatch
(:mod:`fourbit.inputs.pinned_kernels`): torch and oneMKL read those variables once,
when they load, so the process that trains must have them from its start.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from fourbit.atomic import atomic_dir
from fourbit.inputs.pinned_kernels import PINNED_KERNELS, cpu_vendor, training_environment
from fourbit.inputs.tokenizer import BOS_ID, EOS_ID

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
    # descheduled second thread. WAIT_POLICY (fourbit.inputs.pinned_kernels) removes that.
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
PRESETS = {"default": DEFAULT_SPEC, "tiny": TINY_SPEC}
# Bumped whenever the same spec and corpus would train other weights (the kernels'
# pin, the training loop's arithmetic): part of training_identity().
# 2: kernels pinned (PINNED_KERNELS), two threads.
TRAINING_SCHEME = 2


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


def _new_model(spec: dict):
    """The untrained Llama ``spec`` defines (float32, tied embeddings), seeded by its seed."""
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
        # the pin gives one hash per vendor, not one for every x86 host (pinned_kernels)
        "cpu_vendor": cpu_vendor(),
        "versions": {name: version(name) for name in ("torch", "transformers", "sentencepiece")},
    }


def _run_training_process(corpus_dir: Path, out_dir: Path, spec: dict, env: dict) -> None:
    """``python -m fourbit.inputs.builtin_training`` in ``env``; its log lines go to this
    process's stderr (the rule's log) as they come."""
    command = [sys.executable, "-m", "fourbit.inputs.builtin_training",
               "--corpus", str(corpus_dir), "--out", str(out_dir),
               "--spec", json.dumps(spec, sort_keys=True)]
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
