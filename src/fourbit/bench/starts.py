"""Start a group of engines side by side, then wait until every one of them is open.

The engines a bench group holds open compile at their start (vLLM: minutes each with a
cold compile cache). Launched together they compile side by side, and the group's first
pass, and the settle wait before it, must not begin until every start has ended: a settle
wait that began at their launch ran out while ten of them were still compiling
(docs/measurement.md, "Guards"). A pass runner whose engine
starts in the background (fourbit.engines.vllm.throughput's held-open worker) offers
``wait_ready``, which returns once its engine is open and stops it until its first pass.

An optional engine's failed start (a runtime variant's) is its refusal, recorded with the
reason; any other engine's is the job's failure.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

log = logging.getLogger("fourbit")


def open_group(stack: contextlib.ExitStack, openers: Mapping[str, Callable[[], AbstractContextManager]],
               *, optional: set[str], failed: dict[str, str]) -> dict[str, Any]:
    """Each key's pass runner (its opener's), open until ``stack`` closes, once every one has
    started; None for an ``optional`` key whose start failed (``failed`` says why)."""
    runs = {}
    for key, opener in openers.items():
        with _start_of(key, key in optional, failed):
            runs[key] = stack.enter_context(opener())
    for key, run in runs.items():
        if hasattr(run, "wait_ready"):
            with _start_of(key, key in optional, failed):
                run.wait_ready()
    return {key: None if key in failed else runs[key] for key in openers}


@contextlib.contextmanager
def _start_of(key: str, optional: bool, failed: dict[str, str]) -> Iterator[None]:
    """An engine's start: its failure is the job's, or an optional engine's refusal."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any start failure; it is recorded
        if not optional:
            raise
        log.warning("a runtime variant's engine failed to start: %s", error)
        failed[key] = f"its engine failed to start: {type(error).__name__}: {error}"
