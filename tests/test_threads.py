"""fourbit.threads: torch's thread count for a block, put back after it."""

from __future__ import annotations

import torch

from fourbit.threads import torch_threads


def test_torch_threads_restores_what_the_block_changed():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before + 1)  # what an engine inside may do
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before
