"""Per-token divergences of the Draft-OPD objective, and its weighted two-stream mean.

Notation: t = the target's log-prob of a token, s = the drafter's (student's).

* k3 (sampled reverse KL, the rejected-draft stream): with d = t - s, the
  estimator e^d - d - 1 >= 0; its gradient in s is 1 - e^(t-s), so a draft the
  target dislikes is pushed down. Clamps as in the reference (|d| <= 20, loss <= 10).
* On the accepted stream the learner holds the target, so the default is the
  full forward KL on the draft vocabulary (`forward_kl`); the reference's
  two-outcome "Bernoulli" proxy built from two scalars is kept as an option,
  and so are JSD and total variation.
"""

from __future__ import annotations

import torch

from draftopd.losses import forward_kl


def k3(
    target_logp: torch.Tensor, student_logp: torch.Tensor, diff_clamp: float = 20.0, loss_clamp: float = 10.0
) -> torch.Tensor:
    """Sampled reverse-KL estimator per token: e^d - d - 1 with d = clamp(t - s)."""
    d = (target_logp - student_logp).clamp(-diff_clamp, diff_clamp)
    return (d.exp() - d - 1).clamp(max=loss_clamp)


def bernoulli_forward_kl(target_logp: torch.Tensor, student_logp: torch.Tensor, min_logp: float = -10.0):
    """Reference proxy: KL between Bernoulli(p) and Bernoulli(q) for one token, p = e^t, q = e^s."""
    t, s = target_logp.clamp_min(min_logp), student_logp.clamp_min(min_logp)
    p, q = t.exp(), s.exp()
    eps = 1e-6
    return p * (t - s) + (1 - p) * (torch.log1p(-p.clamp(max=1 - eps)) - torch.log1p(-q.clamp(max=1 - eps)))


def jsd(target_logp: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence per position (full distributions over the draft vocabulary)."""
    q_logp = torch.log_softmax(draft_logits.float(), -1)
    m = torch.logsumexp(torch.stack([target_logp, q_logp]), 0) - torch.log(torch.tensor(2.0))
    return 0.5 * ((target_logp.exp() * (target_logp - m)).sum(-1) + (q_logp.exp() * (q_logp - m)).sum(-1))


def total_variation(target_logp: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Total variation distance per position; 1 - TV is the chance a sampled draft passes."""
    return 0.5 * (target_logp.exp() - torch.softmax(draft_logits.float(), -1)).abs().sum(-1)


DIVERGENCES = {"forward_kl": forward_kl, "jsd": jsd, "tv": total_variation}


def two_stream_mean(acc_loss, acc_weight, rej_loss, rej_weight, acc_coef: float = 1.0, rej_coef: float = 1.0):
    """(a * sum(w ℓ)_acc + r * sum(w ℓ)_rej) / (a * sum(w)_acc + r * sum(w)_rej): one global token mean."""
    num = acc_coef * (acc_weight * acc_loss).sum() + rej_coef * (rej_weight * rej_loss).sum()
    den = acc_coef * acc_weight.sum() + rej_coef * rej_weight.sum()
    return num / den.clamp_min(1e-12)
