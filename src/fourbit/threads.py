"""torch's intra-op thread count, set for a block of code and put back after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads at ``threads`` inside the block (None or 0: left as they
    are), and what they were before restored on exit, whatever the block did to them.

    An engine sets them for its own job; whatever runs next in the process (the next
    test, a benchmark's next variant) must not inherit that. torch.set_num_threads is
    looked up on exit, so it is the real one again by then: vLLM's CPU worker replaces it
    with a no-op while its engine is open (fourbit.engines.vllm.lifecycle.open_llm puts
    it back on teardown, inside this block).
    """
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)
