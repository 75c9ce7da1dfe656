"""Calibration windows: the token sequences whose activations GPTQ measures.

They come from the corpus's calibration split only. The evaluation split is a
different file, so calibration and evaluation text are disjoint by construction,
not by a check that could be forgotten.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def calibration_samples(
    token_ids: list[int] | torch.Tensor, n_samples: int, seq_len: int, seed: int
) -> torch.Tensor:
    """``n_samples`` non-overlapping windows of ``seq_len`` tokens -> int64 [n_samples, seq_len].

    The stream is cut into consecutive windows after a seeded random offset (so the
    cut points vary with the seed too), and a seeded random subset of them is kept,
    in stream order.
    """
    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"need n_samples >= 1 and seq_len >= 1, got {n_samples} and {seq_len}")
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    need = n_samples * seq_len
    if len(ids) < need:
        raise ValueError(
            f"calibration split has {len(ids)} tokens; {n_samples} windows of {seq_len} "
            f"need {need}"
        )
    gen = torch.Generator().manual_seed(seed)
    n_windows = len(ids) // seq_len
    offset = int(torch.randint(len(ids) - n_windows * seq_len + 1, (), generator=gen))
    windows = ids[offset : offset + n_windows * seq_len].view(n_windows, seq_len)  # [W, T]
    keep = torch.randperm(n_windows, generator=gen)[:n_samples].sort().values
    return windows[keep]


def calibration_ids(model_dir: str | os.PathLike, text_path: str | os.PathLike) -> list[int]:
    """The calibration split's token ids by the model's own tokenizer, no special tokens
    added: the stream every calibrated arm draws its windows from."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer(Path(text_path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]


def draw_windows(token_ids: list[int] | torch.Tensor, spec: dict, heldout: int) -> torch.Tensor:
    """Windows [S + heldout, T] as a calibration block ``spec`` says: S = its ``samples``
    to fit (0 where the block has none: a method that fits nothing), then ``heldout`` more
    to judge by.

    All S + heldout windows are one draw (calibration_samples, so none overlap), split
    by a permutation seeded like it; each part stays in stream order.
    """
    fitted = spec.get("samples", 0)
    try:
        windows = calibration_samples(token_ids, fitted + heldout, spec["seq_len"], spec["seed"])
    except ValueError as error:
        raise ValueError(f"{error} (calibration.samples {fitted} + {heldout} held out)") from None
    if not heldout:
        return windows
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(spec["seed"]))
    held, fit = order[:heldout].sort().values, order[heldout:].sort().values
    return torch.cat([windows[fit], windows[held]])  # [S, T] + [heldout, T] -> [S + heldout, T]
