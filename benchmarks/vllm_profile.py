"""torch.profiler's view of one vLLM step, for benchmarks that miss a target; not a test.

Imported by benchmarks/vllm_speed.py (and any benchmark beside it: python puts this
folder on sys.path when it runs a script here).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fourbit.engines.vllm.throughput import synthetic_prompt
from fourbit.engines.vllm.lifecycle import llm_options, open_llm
from fourbit.engines.vllm.settings import VllmSettings, resolve
from fourbit.threads import torch_threads


def profile_step(checkpoint: str | os.PathLike, settings: Mapping[str, Any] | VllmSettings,
                 what: str, threads: int, rows: int = 15, batch: int = 1) -> str:
    """torch.profiler's table (top ops by self CPU time) of one decode step (``batch``
    sequences of a 1-token prompt, 2 outputs each: two ``batch``-row forwards, the first a
    1-token prefill of each; batch > 1 is a step of a server holding that many users) or
    of one 512-token prefill, after an untimed first call.

    ``settings``: the vllm engine's, as the workflow passes them (fourbit's plugin), or a
    VllmSettings (VllmSettings.from_engine(settings, plugin=False) for vLLM's own kernel).
    """
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if what not in ("decode", "prefill"):
        raise ValueError(f"what={what!r}; profile 'decode' or 'prefill'")
    settings = resolve(settings)
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    ids = synthetic_prompt(512, vocab)
    if what == "prefill" and batch != 1:
        raise ValueError("a prefill is profiled for one sequence (batch=1)")
    # decode: a different 1-token prompt per sequence, so no two share a cached prefix
    prompts, outputs = ([ids[i:i + 1] for i in range(batch)], 2) if what == "decode" else ([ids], 1)
    params = SamplingParams(max_tokens=outputs, temperature=0.0, ignore_eos=True, detokenize=False)
    options = {**llm_options(settings, checkpoint), "max_num_seqs": batch}
    with (torch_threads(threads),
          open_llm(checkpoint, max_model_len=513, max_num_batched_tokens=512, **options) as llm):
        def run():
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

        run()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
