"""Divergences between the target's and the drafter's next-token distributions on the draft vocabulary.

The drafter only has logits over its draft vocabulary, so the target's
distribution is restricted to those tokens and renormalised before comparing.
SFT's loss is built from these; so is Draft-OPD's accepted stream (opd/objective.py).
"""

from __future__ import annotations

import torch

from draftopd.models.layers import at_least_fp32


def restrict_to_draft_vocab(target_logits: torch.Tensor, draft_to_target: torch.Tensor) -> torch.Tensor:
    """Target log-probs over the draft vocabulary, renormalised: [..., V] -> [..., Vd].

    The draft columns are selected before widening to fp32: a bf16 target's full-vocabulary fp32 copy is
    never made (at a 150K vocabulary and a 32K draft vocabulary, 4.7x the bytes of the result)."""
    return torch.log_softmax(target_logits.index_select(-1, draft_to_target).float(), dim=-1)


def forward_kl(target_logp: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, p from the target's log-probs, q from the drafter's logits: [...] values."""
    q_logp = torch.log_softmax(draft_logits.float(), dim=-1)
    p = target_logp.exp()
    return (p * (target_logp - q_logp)).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over positions where `mask` is True; 0 (with a gradient path) when none are."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp_min(1.0)


def cat_weights(target_logits: torch.Tensor, ids: torch.Tensor, num_copies: int) -> torch.Tensor:
    """PARD-2's confidence-adaptive token (CAT) weights.

    [B, K, L]: the weight of the copy-i logit at p (predicting x_{p+1}): prod_{s=0..i-1} g_{p-s}, where
    g_j = p_target(x_j | x_<j) teacher-forced and g_0 = 1 (ones where p - s < 0). No gradient."""
    with torch.no_grad():
        logp = torch.log_softmax(target_logits.to(at_least_fp32(target_logits.dtype)), -1)
        g = torch.ones(ids.shape, dtype=logp.dtype, device=ids.device)
        g[:, 1:] = logp[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2).exp()
        w = [torch.ones_like(g)]
        for i in range(1, num_copies):  # copy i multiplies in g_{p-i+1}
            shifted = torch.cat([torch.ones_like(g[:, : i - 1]), g[:, : g.shape[1] - i + 1]], 1)
            w.append(w[-1] * shifted)
        return torch.stack(w, 1)
