"""KL(P_b || P_a) of next-token distributions, from full logits.

P_b is the baseline's distribution at a position, P_a the arm's;
KL(P_b || P_a) = sum_v P_b(v) (log P_b(v) - log P_a(v)), in nats. Every engine that
compares positions computes it the same way (FULL): log_softmax over the whole
vocabulary of each model's logits, in float64, then the sum (kl_full). The reference
engine gets the logits from transformers, the vLLM engines from inside vLLM's own
prompt-logprob computation (fourbit.engines.vllm.distributions), so an arm's KL is
one measure whichever of them ran it. Renormalizing in float64 makes every term's
distributions sum to 1 exactly enough that the KL is never negative beyond float64
rounding, and identical logits give 0 exactly.
"""

from __future__ import annotations

FULL = "full logits"
# positions per float64 log-softmax slice: [128, V] doubles stay small for a large V
KL_POSITIONS = 128


def kl_full(base_logprobs, arm_logprobs):
    """KL(P_b || P_a) per row of two [..., V] log-softmax tensors, in float64."""
    base, arm = base_logprobs.double(), arm_logprobs.double()
    return (base.exp() * (base - arm)).sum(-1)


def kl_from_logits(base_logits, arm_logits) -> tuple[list[float], list[bool]]:
    """Per row of two [positions, V] logit tensors (any float dtype), KL(P_b || P_a) by
    kl_full of their float64 log_softmax, and whether both have the same argmax (top-1
    agreement)."""
    if base_logits.shape != arm_logits.shape or base_logits.dim() != 2:
        raise ValueError(f"logits of shapes {tuple(base_logits.shape)} and "
                         f"{tuple(arm_logits.shape)}; expected two equal [positions, V]")
    kl: list[float] = []
    top1: list[bool] = []
    for start in range(0, base_logits.shape[0], KL_POSITIONS):
        base = base_logits[start : start + KL_POSITIONS].double().log_softmax(-1)  # [n, V]
        arm = arm_logits[start : start + KL_POSITIONS].double().log_softmax(-1)
        kl.extend(kl_full(base, arm).tolist())
        top1.extend((base.argmax(-1) == arm.argmax(-1)).tolist())
    return kl, top1
