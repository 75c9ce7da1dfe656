"""Shared fixtures: tiny real Hugging Face models written to disk; the tiny study, run once."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from fourbit.quant.qweight import QuantizedWeight


def hub_cache(root: Path, repo_folder: str, revision: str, files: dict[str, bytes]) -> Path:
    """A Hugging Face hub cache holding ``files`` at ``revision``, laid out as a download leaves it.

    ``repo_folder`` is the cache's folder name, e.g. "models--org--name" or
    "datasets--org--name". The real huggingface_hub code then reads it offline.
    """
    repo = root / "hub" / repo_folder
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(content)
        link = repo / "snapshots" / revision / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return root / "hub"


def save_tiny_llama(folder, *, tied: bool, hidden: int = 256, intermediate: int = 512, layers: int = 2,
                    vocab: int = 512, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def save_tiny_tokenizer(folder, *, vocab: int = 300) -> None:
    """A word-level tokenizer of ``vocab`` ids (tokenizer.json and tokenizer_config.json),
    which AutoTokenizer loads: what a local model folder needs beside its weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    Path(folder).mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}))


@pytest.fixture
def tiny_tied(tmp_path):
    folder = tmp_path / "tied"
    save_tiny_llama(folder, tied=True)
    return folder


@pytest.fixture
def tiny_untied(tmp_path):
    folder = tmp_path / "untied-source"
    save_tiny_llama(folder, tied=False)
    return folder


@pytest.fixture(scope="module")
def int4_checkpoints(tmp_path_factory):
    """(arm, baseline): a tiny untied Llama ("baseline") and its cpu_int4 g64
    quantization ("arm"), the checkpoints the bench tests time and count."""
    from fourbit.schema import canonical_quant, load_schema
    from fourbit.steps.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("int4_checkpoints")
    save_tiny_llama(root / "baseline", tied=False)
    quant = canonical_quant({"method": "cpu_int4", "group_size": 64, "search": "minmax"},
                            load_schema())
    arm = {"name": "t", "id": "t-0000000000", "quant": quant}
    quantize_checkpoint(root / "baseline", root / "arm", root / "arm.json", arm)
    return root / "arm", root / "baseline"


@pytest.fixture(scope="session")
def finished_study(tmp_path_factory):
    """A folder where the tiny study (tests/workflow/tiny.yaml) has run to its report: run
    once for the session, read by tests/test_workflow.py and copied by tests/test_faults.py
    (a test that changes it works on a copy)."""
    from tiny_study import snakemake

    workdir = tmp_path_factory.mktemp("study")
    run = snakemake(workdir, "results/report.md")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return workdir


@pytest.fixture(scope="session")
def task_sandbox():
    """Skips the test, saying why, unless this host can run fourbit.tasks.sandbox (root,
    `unshare`, network, mount and PID namespaces, a right program passing in it)."""
    from fourbit.tasks import sandbox

    try:
        sandbox.check_available()
    except sandbox.SandboxError as error:
        pytest.skip(str(error))


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, size: int):
    """A tmpfs of ``size`` bytes mounted on ``folder`` (made if missing) while the block
    runs: a small filesystem that fills up. Skips the test, saying why, where mounting is
    not permitted (it needs root, or CAP_SYS_ADMIN, outside a container that forbids it)."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up ({mount.stderr.strip() or 'mount failed'}); "
                    "this test needs root or CAP_SYS_ADMIN")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)  # still busy: detach


def random_qweight(n: int, k: int, g: int, *, sym: bool, gen: torch.Generator,
                   zeros: tuple[int, int] = (0, 16),
                   scales: tuple[float, float] = (0.002, 0.032)) -> QuantizedWeight:
    """Random 4-bit codes [N, K], zero points drawn from ``zeros`` (8 when symmetric) and
    float16 scales uniform in ``scales``, per group of ``g`` columns [N, K/G]."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    if sym:
        zero_points = torch.full((n, k // g), 8, dtype=torch.uint8)
    else:
        zero_points = torch.randint(*zeros, (n, k // g), generator=gen, dtype=torch.uint8)
    low, high = scales
    group_scales = (low + (high - low) * torch.rand(n, k // g, generator=gen)).half()
    return QuantizedWeight(codes, group_scales, zero_points, g)
