"""fourbit.metrics.kl: KL from full logits, the one way every engine computes it."""

from __future__ import annotations

import pytest
import torch

from fourbit.metrics.kl import KL_POSITIONS, kl_from_logits, kl_full


def test_kl_full_matches_torch_and_is_zero_for_identical_rows():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(7, 50, generator=g).log_softmax(-1)
    arm = (base + 0.3 * torch.randn(7, 50, generator=g)).log_softmax(-1)
    want = torch.nn.functional.kl_div(arm.double(), base.double(), log_target=True,
                                      reduction="none").sum(-1)
    assert torch.allclose(kl_full(base, arm), want, atol=1e-12)
    assert kl_full(base, base).abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_from_logits_is_kl_full_of_float64_log_softmax_in_slices(dtype):
    """More rows than one slice, either logits dtype: the float64 KL per row, the argmax
    agreement, never negative, and 0 for the same logits."""
    g = torch.Generator().manual_seed(1)
    rows = KL_POSITIONS + 5
    base = (4 * torch.randn(rows, 300, generator=g)).to(dtype)
    arm = (base.float() + torch.randn(rows, 300, generator=g)).to(dtype)
    kl, top1 = kl_from_logits(base, arm)
    want = kl_full(base.double().log_softmax(-1), arm.double().log_softmax(-1))
    assert kl == want.tolist()
    assert top1 == (base.float().argmax(-1) == arm.float().argmax(-1)).tolist()
    assert 0 < sum(top1) < rows and min(kl) >= 0
    same, agree = kl_from_logits(base, base)
    assert set(same) == {0.0} and all(agree)
    with pytest.raises(ValueError, match=r"\[positions, V\]"):
        kl_from_logits(base, arm[:, :299])
