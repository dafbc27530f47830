"""Divergences between the target's and the drafter's next-token distributions.

The drafter only has logits over its draft vocabulary, so the target's
distribution is restricted to those tokens and renormalised before comparing.
"""

from __future__ import annotations

import torch


def restrict_to_draft_vocab(target_logits: torch.Tensor, draft_to_target: torch.Tensor) -> torch.Tensor:
    """Target log-probs over the draft vocabulary, renormalised: [..., V] -> [..., Vd]."""
    return torch.log_softmax(target_logits.float().index_select(-1, draft_to_target), dim=-1)


def forward_kl(target_logp: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, p from the target's log-probs, q from the drafter's logits: [...] values."""
    q_logp = torch.log_softmax(draft_logits.float(), dim=-1)
    p = target_logp.exp()
    return (p * (target_logp - q_logp)).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over positions where `mask` is True; 0 (with a gradient path) when none are."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp_min(1.0)
