"""Verification rules of speculative decoding, as plain batched functions.

Both rules return (num_accepted [B], next_token [B]): the number of leading drafts
kept and the token the target adds after them (the correction at the first
rejection, or the bonus token when every draft passed). Notation as in the
papers: p is the target's distribution, q the drafter's.
"""

from __future__ import annotations

import torch


def leading_true(flags: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row of a [B, K] boolean tensor."""
    if flags.shape[1] == 0:
        return torch.zeros(flags.shape[0], dtype=torch.long, device=flags.device)
    return flags.long().cumprod(dim=1).sum(dim=1)


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: keep draft i iff it equals the target's argmax there.

    draft_tokens [B, K]; target_logits [B, K + 1, V], row i predicting the token after draft i - 1.
    """
    greedy = target_logits.argmax(dim=-1)  # [B, K + 1]
    k = draft_tokens.shape[1]
    num_accepted = leading_true(draft_tokens == greedy[:, :k])
    next_token = greedy.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of [B, V] probabilities."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def rejection_verify(
    draft_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    p_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature > 0: the standard rule, which leaves the output distributed exactly as p.

    Accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection draw from norm(max(0, p_i - q_i)); if all K pass, draw the bonus from p_K.
    q_probs [B, K, V] (over the target vocabulary, zero outside the draft vocabulary),
    p_probs [B, K + 1, V].
    """
    b, k = draft_tokens.shape
    idx = draft_tokens[..., None]
    q_x = q_probs.gather(2, idx).squeeze(2)  # q: draft prob of each drafted token
    p_x = p_probs[:, :k].gather(2, idx).squeeze(2)  # p: target prob of the same token
    u = torch.rand(b, k, generator=generator, dtype=p_probs.dtype, device=p_probs.device)
    num_accepted = leading_true(u * q_x < p_x)
    rows = torch.arange(b, device=draft_tokens.device)
    p_next = p_probs[rows, num_accepted]  # [B, V]
    q_pad = torch.cat([q_probs, q_probs.new_zeros(b, 1, q_probs.shape[-1])], dim=1)  # bonus row: residual = p
    residual = (p_next - q_pad[rows, num_accepted]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # A rejection has probability 0 when the residual vanishes; guard against rounding anyway.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    return num_accepted, sample(residual, generator)


def first_valid_row_walk(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Several candidate rows of fixed drafts, verified together: (row [B], num_accepted [B], next_token [B]).

    draft_tokens [B, R, K]; target_logits [B, R, K + 1, V], each row scored on its own drafts. At step t the
    target's token is taken (argmax, or a sample at `temperature`) from the first row that still agrees with
    every token emitted so far: such rows share the committed context, so its distribution there is exactly
    the target's. Rows whose draft t differs from that token drop out; the walk ends when none is left (or
    after the bonus), and the last row it read from is the winner. Each emitted token is a draw from the
    target given the tokens before it, whatever the drafts are, so the output is distributed as the target's.
    """
    b, r, k = draft_tokens.shape
    at = torch.arange(b, device=draft_tokens.device)
    valid = torch.ones(b, r, dtype=torch.bool, device=draft_tokens.device)
    alive = torch.ones(b, dtype=torch.bool, device=draft_tokens.device)
    row, accepted, nxt = (torch.zeros(b, dtype=torch.long, device=draft_tokens.device) for _ in range(3))
    for t in range(k + 1):
        first = valid.long().argmax(1)  # the first still-valid row (every live sequence has one)
        logits = target_logits[at, first, t]
        if temperature <= 0:
            token = logits.argmax(-1)
        else:
            token = sample(torch.softmax(logits.double() / temperature, dim=-1), generator)
        valid = valid & (draft_tokens[:, :, t] == token[:, None]) if t < k else torch.zeros_like(valid)
        ends = alive & ~valid.any(1)
        row, accepted, nxt = (torch.where(ends, new, old) for new, old in ((first, row), (t, accepted), (token, nxt)))
        alive = alive & ~ends
        if not alive.any():
            break
    return row, accepted, nxt
