"""The serving workload: the same prompts, as token ids, for every arm and every server.

Prompts are the first ``prompt_tokens`` tokens of the study's evaluation windows
(``windows.json``, written by the evaluation step), request i taking window i (cycling
when a level asks for more requests than there are windows). Text the model was made
to predict, not random ids: a small model's attention and sampling cost the same
either way, but real text keeps the prompts the study's own, and they are the same
token ids on both servers, with no tokenizer in between.
"""

from __future__ import annotations

import json
from pathlib import Path

SOURCE = "evaluation windows (windows.json): the first prompt_tokens token ids of window i"


def prompts_from_windows(windows_json: str | Path, *, prompt_tokens: int,
                         requests: int) -> list[list[int]]:
    """``requests`` prompts of ``prompt_tokens`` token ids each."""
    windows = json.loads(Path(windows_json).read_text())
    if prompt_tokens > windows["window"]:
        raise ValueError(
            f"serve.prompt_tokens is {prompt_tokens}, longer than the evaluation windows "
            f"({windows['window']} tokens, {windows_json}); ask for at most {windows['window']}")
    if not windows["windows"]:
        raise ValueError(f"{windows_json} holds no windows; the evaluation split is empty")
    ids = windows["windows"]
    return [list(ids[i % len(ids)][:prompt_tokens]) for i in range(requests)]
