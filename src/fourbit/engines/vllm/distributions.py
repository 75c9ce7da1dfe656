"""Whole next-token distributions from inside the vllm engine, for an exact KL.

vLLM's API returns at most a top k of logprobs per position, as Python floats; k=-1
(the whole vocabulary, with max_logprobs=-1) makes vocabulary-size lists per position,
which cost many times the window's own forward in time and memory (docs/engines.md,
"Exact KL on vLLM"). So the logits are taken where vLLM computes prompt logprobs
instead (line numbers are vllm 0.32.0 in site-packages/vllm): for each request with
prompt_logprobs set, the model runner computes the logits of its prompt positions
(model.compute_logits of their hidden states, the quantized head included) and passes
them to its sampler's compute_logprobs (v1/worker/gpu_model_runner.py:5375-5388,
inherited by the CPU runner; v1/sample/sampler.py:308, log_softmax in float32).
Nothing else calls that method unless a request asks for the logprobs of sampled
tokens, which none here does. ``keeping_logits`` wraps it on the worker's sampler
(LLM.collective_rpc runs a function on the worker, which is this process:
VLLM_ENABLE_V1_MULTIPROCESSING=0, fourbit.engines.vllm.lifecycle) and keeps a float32
copy of each logits tensor it is given (float32 holds a bfloat16 engine's logits
exactly). So the KL comes from exactly the logits the engine's own prompt logprobs come
from, for the checkpoint the engine ran; ``window_logits`` checks them against the
logprobs vLLM returns.

The baseline's logits go to disk in the baseline's ppl job (``keep_logits``: an .npy of
float32 [positions, V], every compared window's positions 1..W-1 in order); an arm's ppl
job reads them back window by window (``compare_with_kept``) and keeps only the KL and
top-1 agreement per position (fourbit.metrics.kl.kl_from_logits), so no job holds more
than a window's logits of each model, and no model runs twice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fourbit.atomic import atomic_path
from fourbit.engines.vllm.score import logprobs_on
from fourbit.metrics.kl import kl_from_logits

# vLLM's log_softmax of the logits against ours of the float32 copy: the same op on the
# same rows, equal but for a vectorized reduction's order; a kept row of another
# position misses by whole nats.
SAME_LOGPROB = 1e-5


@contextlib.contextmanager
def keeping_logits(llm: Any) -> Iterator[list]:
    """While the block runs, every prompt-logprob computation of ``llm`` appends a float32
    copy of its logits, a [positions, V] tensor, to the list yielded; the engine is left
    as it was."""
    import torch

    kept: list[torch.Tensor] = []

    def install(worker: Any) -> int:
        sampler = worker.model_runner.sampler
        compute_logprobs = sampler.compute_logprobs

        def keeping(logits: torch.Tensor) -> torch.Tensor:
            kept.append(logits.to(torch.float32, copy=True))
            return compute_logprobs(logits)

        sampler.compute_logprobs = keeping  # an instance attribute over the staticmethod
        return os.getpid()

    def remove(worker: Any) -> None:
        del worker.model_runner.sampler.compute_logprobs

    where = llm.collective_rpc(install)
    try:
        if where != [os.getpid()]:
            raise RuntimeError(f"vLLM's worker runs in process(es) {where}, not this one "
                               f"({os.getpid()}): its logits cannot be kept here")
        yield kept
    finally:
        llm.collective_rpc(remove)


def window_logits(llm: Any, kept: list, window: list[int]) -> tuple[dict[str, Any], Any]:
    """One window alone through ``llm`` under ``keeping_logits`` (``kept``, its list): its
    score as fourbit.engines.vllm.score.logprobs_on returns it (with token_logprobs), and
    its logits at positions 0..W-2, a [W-1, V] float32 tensor whose row t-1 predicts token
    t. One request per generate call, so every kept chunk is this window's, in order."""
    import torch

    kept.clear()
    (scored,) = logprobs_on(llm, [window], token_logprobs=True)
    logits = torch.cat(kept) if kept else torch.empty(0, 0)
    kept.clear()
    if logits.shape[0] != len(window) - 1:
        raise RuntimeError(f"kept {tuple(logits.shape)} logits for a window of {len(window)} "
                           "tokens; expected one row per position 1..W-1")
    actual = torch.tensor(window[1:])[:, None]  # [W-1, 1]
    ours = logits.log_softmax(-1).gather(-1, actual).squeeze(-1)  # [W-1]
    miss = (ours - torch.tensor(scored["token_logprobs"])).abs().max().item()
    if miss > SAME_LOGPROB:
        raise RuntimeError(f"the kept logits give the window's tokens logprobs up to {miss:.3g} "
                           "from vLLM's own: they are not the logits vLLM scored")
    return scored, logits


def keep_logits(llm: Any, windows: list[list[int]], path: str | os.PathLike,
                ) -> list[dict[str, Any]]:
    """Each window's score (window_logits) and, written to ``path`` (atomically), the
    logits of all of them: an .npy of float32 [sum of W-1, V], window after window."""
    import numpy as np

    rows = sum(len(w) - 1 for w in windows)
    scores = []
    with keeping_logits(llm) as kept, atomic_path(path) as temp, open(temp, "wb") as f:
        for i, window in enumerate(windows):
            scored, logits = window_logits(llm, kept, window)  # [W-1, V]
            if i == 0:  # the vocabulary is the logits' width
                header = {"descr": "<f4", "fortran_order": False, "shape": (rows, logits.shape[1])}
                np.lib.format.write_array_header_1_0(f, header)
            f.write(logits.numpy().tobytes())
            scores.append(scored)
    return scores


def compare_with_kept(llm: Any, windows: list[list[int]], path: str | os.PathLike,
                      ) -> tuple[list[dict[str, Any]], list[list[float]], list[list[bool]]]:
    """Each window's score (window_logits), and per window and position KL(P_base || P_arm)
    and top-1 agreement of this engine's logits against the baseline's in ``path``
    (keep_logits' file for the same windows)."""
    import numpy as np
    import torch

    stored = np.load(Path(path), mmap_mode="r")  # [sum of W-1, V]
    rows = [len(w) - 1 for w in windows]
    if stored.shape[0] != sum(rows):
        raise ValueError(f"{path} holds {stored.shape[0]} positions; the compared windows have "
                         f"{sum(rows)}: it was kept for other windows")
    scores, window_kl, window_top1 = [], [], []
    with keeping_logits(llm) as kept:
        for i, window in enumerate(windows):
            scored, logits = window_logits(llm, kept, window)  # [W-1, V]
            start = sum(rows[:i])
            base = torch.from_numpy(np.array(stored[start : start + rows[i]]))  # out of the map
            kl, top1 = kl_from_logits(base, logits)
            scores.append(scored)
            window_kl.append(kl)
            window_top1.append(top1)
    return scores, window_kl, window_top1
