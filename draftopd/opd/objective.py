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

from draftopd.divergences import forward_kl


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


NORMALISATIONS = ("token_mean", "stream_means")


def mix_streams(
    acc_loss,
    acc_weight,
    rej_loss,
    rej_weight,
    acc_coef=1.0,
    rej_coef=1.0,
    normalisation="token_mean",
    all_reduce=None,
    world: int = 1,
):
    """The two streams' per-token losses mixed into one loss; returns (loss, (accepted share, rejected share)).

    `token_mean`: (a sum(w l)_acc + r sum(w l)_rej) / (a sum(w)_acc + r sum(w)_rej), one weighted token mean;
    `stream_means`: a sum(w l)_acc / sum(w)_acc + r sum(w l)_rej / sum(w)_rej. A stream without weight drops out.
    `all_reduce` sums a tensor over the learner ranks in place (None: one rank), `world` is their number: the
    weight sums are then global and the loss is scaled by `world`, so that averaging the ranks' gradients (as
    data parallelism does) gives the gradient of the global mean. A share is the fraction of the loss's total
    per-token weight that a stream's tokens carry: the number to watch for a drowned stream.
    """
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"unknown normalisation {normalisation!r}; expected one of {', '.join(NORMALISATIONS)}")
    sums = torch.stack([acc_weight.sum(), rej_weight.sum()]).detach().double()
    if all_reduce is not None:
        all_reduce(sums)
    acc_sum, rej_sum = float(sums[0]), float(sums[1])
    a, r = (acc_coef if acc_sum > 0 else 0.0), (rej_coef if rej_sum > 0 else 0.0)
    acc_num, rej_num = (acc_weight * acc_loss).sum(), (rej_weight * rej_loss).sum()
    if normalisation == "token_mean":
        den = max(a * acc_sum + r * rej_sum, 1e-12)
        return world * (a * acc_num + r * rej_num) / den, (a * acc_sum / den, r * rej_sum / den)
    loss = world * (a * acc_num / max(acc_sum, 1e-12) + r * rej_num / max(rej_sum, 1e-12))
    total = max(a + r, 1e-12)
    return loss, (a / total, r / total)
