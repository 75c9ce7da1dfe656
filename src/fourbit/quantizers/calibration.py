"""Calibration windows: the token sequences whose activations GPTQ measures.

They come from the corpus's calibration split only. The evaluation split is a
different file, so calibration and evaluation text are disjoint by construction,
not by a check that could be forgotten.
"""

from __future__ import annotations

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
