"""Error-position replay: rebuild the drafter's own chains at recorded verification steps and score them.

For a step whose first draft sits at absolute position P, the drafter's last
context row is t = P - 2 (target state at P - 2 paired with the anchor token at
P - 1); chain depth d predicts draft d + 1 and, for d >= 1, reads the drafter's
own draft d as input. The drafter's `score` (drafters/base.py) with those tokens
at row t therefore recomputes exactly the chain of the rollout (the tests check that the
replayed log-probs equal the recorded ones when the weights are the same).

Two streams per step with `a` accepted drafts out of K:
* accepted (target-distributed) stream: depths 0..a, whose context is the target's
  own text; divergence to the target's full distribution at position P - 1 + d;
* rejected-draft stream: depths a..K-1 (or only the first rejected draft, depth a),
  the drafter's rejected block scored against the target in the context it was
  verified in (the drafter's own rejected prefix): k3 on the drafted token
  against the target log-prob recorded at verification (the reference), total
  variation to the target's distribution there, or a margin between the target's
  top token and the rejected draft in the drafter's log-probs. The target is
  restricted to the draft vocabulary by default: the drafter can only match
  that, and each form's optimum is then the restricted target, as the forward
  KL's is. k3 reads the restriction from the records too (`target_draft_logz`),
  so a learner step runs the target once over each replayed trajectory;
  `tv` and `margin` need the target's whole distribution at each rejected
  position and re-run it over every rejected step's prefix, at many times the
  cost (`target_tokens_per_token`, logged every step).
Depth d is weighted decay**d (offset within the block, as in the reference).
The streams are mixed as one weighted token mean (`token_mean`) or as the sum
of their own means (`stream_means`); with several learner ranks every
denominator is global (summed over the ranks), so a rank's share of the batch
does not change a token's weight. Each stream's share of the gradient-carrying
weight is reported with every step.

The replay unit is an error state (its own step only) or, by default, its whole
trajectory: every verification step of it, accepted blocks and rejected ones,
as the reference replays.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from dataclasses import dataclass

import torch

from draftopd.divergences import cat_weights, restrict_to_draft_vocab
from draftopd.messages import ErrorState
from draftopd.opd.objective import DIVERGENCES, NORMALISATIONS, bernoulli_forward_kl, k3, mix_streams
from draftopd.schema import CHOICES


@dataclass
class ReplayBatch:
    """Rows are trajectories; per-depth tensors are [B, D, L-1], indexed by the drafter row t."""

    input_ids: torch.Tensor
    valid: torch.Tensor
    depth_tokens: torch.Tensor
    acc_weight: torch.Tensor
    rej_weight: torch.Tensor
    rej_draft_idx: torch.Tensor
    rej_target_logp: torch.Tensor
    num_steps: int
    rej_target_logp_draft: torch.Tensor | None = None
    """[B, D, L-1] the recorded target log-prob of each rejected draft restricted to the draft vocabulary
    (`target_logprobs - target_draft_logz`, messages.py); zero where no weight, None in SFT batches."""
    num_unrecorded: int = 0
    """Rejected-stream tokens whose step lacks `target_draft_logz` (older records, partial draft vocabulary)."""


ACCEPTED_ROWS = CHOICES["learner.accepted_rows"]
REPLAY_UNITS = CHOICES["learner.replay_unit"]
REJECTED_OFFSETS = CHOICES["learner.rejected_offsets"]
REJECTION_LOSSES = CHOICES["learner.rejection_loss"]


def target_to_draft_index(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] long: the draft id of each target id, -1 where the draft vocabulary lacks it."""
    idx = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_to_target.device)
    idx[draft_to_target] = torch.arange(len(draft_to_target), device=draft_to_target.device)
    return idx


def _group(states: list[ErrorState]) -> list[list[ErrorState]]:
    """Error states of the same trajectory object share one row."""
    groups: dict[int, list[ErrorState]] = defaultdict(list)
    for s in states:
        groups[id(s.trajectory)].append(s)
    return list(groups.values())


def _all_rows_weights(acc_w: torch.Tensor, row: int, prompt_len: int, length: int, decay: float) -> None:
    """Teacher-forced weights on every response row: depth d at row t scores position j = t + 1 + d
    when token j + 1 is a response token (the SFT loss positions)."""
    for d in range(acc_w.shape[1]):
        lo, hi = max(prompt_len - 2 - d, 0), length - 3 - d  # rows t with prompt_len - 1 <= j <= length - 2
        if hi >= lo:
            acc_w[row, d, lo : hi + 1] = decay**d


def _token_grid(seqs: list[list[int]], depth: int, pad_id: int = 0):
    """(ids [B, W], valid [B, W], teacher-forced depth tokens [B, D, W-1]: token t+1+d at row t)."""
    b, width = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        valid[i, : len(s)] = True
    depth_tokens = torch.stack([torch.roll(ids, -(1 + d), 1)[:, : width - 1] for d in range(depth)], 1)
    return ids, valid, depth_tokens


def sequence_batch(seqs: list[tuple[list[int], int]], depth: int, decay: float, max_len: int) -> ReplayBatch:
    """SFT rows in the replay batch's form: (ids, prompt length) sequences, the accepted stream teacher-forced on
    every response row and no rejected stream. Scored by `opd_loss`, an SFT step and a Draft-OPD step share one
    loss and one normalisation (the matched comparison of `draftopd bench opd-vs-sft`)."""
    cut = [ids[:max_len] for ids, _ in seqs]
    ids, valid, depth_tokens = _token_grid(cut, depth)
    shape = (len(cut), depth, ids.shape[1] - 1)
    acc_w = torch.zeros(shape)
    for row, (s, (_, prompt_len)) in enumerate(zip(cut, seqs)):
        _all_rows_weights(acc_w, row, prompt_len, len(s), decay)
    zeros = torch.zeros(shape)
    return ReplayBatch(ids, valid, depth_tokens, acc_w, zeros, torch.zeros(shape, dtype=torch.long), zeros, 0)


def build_replay_batch(
    states: list[ErrorState],
    t2d_index: torch.Tensor,
    depth: int,
    decay: float,
    max_len: int,
    *,
    pad_id: int = 0,
    accepted_rows: str = "all",
    unit: str = "state",
    rejected_offsets: str = "all",
) -> ReplayBatch:
    """`accepted_rows`: "all" scores the accepted stream on every response row (teacher-forced, as the
    reference's full-TTT mode), "anchors" only at the replayed steps' own blocks.
    `unit`: "state" replays the given states' steps; "trajectory" every step of their trajectories.
    `rejected_offsets`: "all" scores every rejected draft (depths a..K-1), "first" only depth a."""
    for name, value, allowed in (
        ("accepted_rows", accepted_rows, ACCEPTED_ROWS),
        ("replay unit", unit, REPLAY_UNITS),
        ("rejected_offsets", rejected_offsets, REJECTED_OFFSETS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    groups = _group(states)
    if unit == "trajectory":
        groups = [
            [ErrorState(g[0].trajectory, i, g[0].policy_version) for i in range(len(g[0].trajectory.steps))]
            for g in groups
        ]
    seqs = [g[0].trajectory.full_ids[:max_len] for g in groups]
    # Teacher-forced tokens everywhere (token t+1+d at row t); anchor rows get their own drafts below.
    ids, valid, depth_tokens = _token_grid(seqs, depth, pad_id)
    shape = (len(seqs), depth, ids.shape[1] - 1)
    acc_w, rej_w = torch.zeros(shape), torch.zeros(shape)
    rej_idx, rej_t, rej_r = torch.zeros(shape, dtype=torch.long), torch.zeros(shape), torch.zeros(shape)
    whole_vocab = bool((t2d_index >= 0).all())  # the draft vocabulary is the target's: its log-mass is 0
    used = unrecorded = 0
    for row, group in enumerate(groups):
        length = len(seqs[row])
        if accepted_rows == "all":
            _all_rows_weights(acc_w, row, len(group[0].trajectory.prompt_ids), length, decay)
        for state in group:
            step = state.step
            t, a, k = step.position - 2, step.num_accepted, min(len(step.draft_tokens), depth)
            if t < 0 or step.position > length - 1:
                continue  # cut off by max_len
            used += 1
            # Depth d sees the target's own text only while the drafts before it were accepted: past them
            # (through a rejected draft, or beyond the block when the replay depth exceeds K) no label.
            acc_w[row, a + 1 :, t] = 0.0
            for d in range(k):
                # A stock step's accepted drafts are the teacher-forced tokens already in the grid; its others
                # are unknown (-1) and keep them too: no weight reaches past them (rej_coef 0, config.py).
                if d and step.scored:
                    depth_tokens[row, d, t] = step.draft_tokens[d - 1]
                acc_w[row, d, t] = decay**d if d <= a and t + 2 + d <= length - 1 else 0.0  # label exists
                if not step.scored:  # stock records: the accepted stream only (messages.py)
                    continue
                if d >= a and (rejected_offsets == "all" or d == a):
                    rej_w[row, d, t] = decay**d
                    rej_idx[row, d, t] = max(int(t2d_index[step.draft_tokens[d]]), 0)
                    rej_t[row, d, t] = step.target_logprobs[d]
                    if step.target_draft_logz or whole_vocab:
                        logz = step.target_draft_logz[d] if step.target_draft_logz else 0.0
                        rej_r[row, d, t] = step.target_logprobs[d] - logz
                    else:
                        unrecorded += 1
    return ReplayBatch(ids, valid, depth_tokens, acc_w, rej_w, rej_idx, rej_t, used, rej_r, unrecorded)


@dataclass
class OPDLossConfig:
    """How the two streams are scored and mixed (see opd/objective.py)."""

    accepted_divergence: str = "forward_kl"
    acc_coef: float = 1.0
    rej_coef: float = 1.0
    accepted_rows: str = "all"
    k3_full_vocab_target: bool = False
    """k3 against the recorded full-vocabulary target log-probs (the reference), not the draft-vocabulary target."""
    accepted_cat: bool = False
    """Multiply the accepted stream's weights by CAT weights (`cat_grid`)."""
    rejection_loss: str = "k3"
    """The rejected stream's form: `k3`, `tv` (total variation to the target there) or `margin`."""
    rejected_offsets: str = "all"
    """Score every rejected draft of a block (`all`) or only the first (`first`, the only one whose context
    occurs again at inference)."""
    margin: float = 1.0
    """`margin`: the drafter's log-prob of the target's top token must exceed the rejected draft's by this."""
    normalisation: str = "token_mean"
    """`token_mean`: one weighted token mean over both streams; `stream_means`: the sum of each stream's mean."""
    rerun_rejected_target: bool = False
    """k3 against a fresh target pass over each rejected step's prefix (`rejected_block_targets`) rather than
    the recorded restricted log-prob: for records without `target_draft_logz`. `tv` and `margin` always take it."""

    def check(self) -> None:
        for name, value, allowed in (
            ("accepted_divergence", self.accepted_divergence, (*DIVERGENCES, "bernoulli_fkl")),
            ("accepted_rows", self.accepted_rows, ACCEPTED_ROWS),
            ("rejection_loss", self.rejection_loss, REJECTION_LOSSES),
            ("rejected_offsets", self.rejected_offsets, REJECTED_OFFSETS),
            ("normalisation", self.normalisation, NORMALISATIONS),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")


def opd_loss_config(learner) -> OPDLossConfig:
    """The loss settings of a recipe's `learner` section."""
    names = [f.name for f in dataclasses.fields(OPDLossConfig)]
    return OPDLossConfig(**{name: getattr(learner, name) for name in names})


def rejected_block_targets(target, batch: ReplayBatch, d2t: torch.Tensor, chunk: int = 4):
    """The target at every replayed step's block, in the context it was verified in (the trajectory up to the
    anchor, then the step's own drafts), restricted to the draft vocabulary: (rows, ts, [R, D, Vd] log-probs,
    target tokens processed without padding), R = replayed steps with a rejected-stream weight, at depth d the
    distribution the step's draft d was verified against.

    A target pass over each step's whole prefix: many times the replayed tokens (`target_tokens_per_token`).
    Only `tv` and `margin`, which read the whole distribution there, and `rerun_rejected_target` need it; k3
    reads the log-probs the rollout recorded."""
    rows, ts = (batch.rej_weight > 0).any(1).nonzero(as_tuple=True)
    depth = batch.depth_tokens.shape[1]
    offsets = torch.arange(depth, device=batch.input_ids.device)
    parts, tokens = [], 0
    for i in range(0, len(rows), chunk):  # a few contexts per target pass: full-vocabulary logits are large
        r, t = rows[i : i + chunk], ts[i : i + chunk]
        # The step's drafts are its depth tokens 1..D-1 at its anchor row; logits at t + 1 + d predict draft d.
        seqs = [
            torch.cat([batch.input_ids[a, : b + 2], batch.depth_tokens[a, 1:, b]])
            for a, b in zip(r.tolist(), t.tolist())
        ]
        tokens += sum(len(x) for x in seqs)
        ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        with torch.no_grad():
            logits = target.forward(ids, pos, want_aux=False).logits
        picked = logits[torch.arange(len(seqs), device=ids.device)[:, None], t[:, None] + 1 + offsets]
        parts.append(restrict_to_draft_vocab(picked, d2t))
    restricted = torch.cat(parts) if parts else torch.zeros(0, depth, len(d2t), device=batch.input_ids.device)
    return rows, ts, restricted, tokens


def weighed_rows(batch: ReplayBatch) -> torch.Tensor:
    """[R] the grid rows (ascending) where either stream has weight at some depth in some batch row."""
    return ((batch.acc_weight > 0) | (batch.rej_weight > 0)).any(1).any(0).nonzero().flatten()


def replay_forward(drafter, target, batch: ReplayBatch, forward=None):
    """Target pass (no grad) and the drafter's replayed chains; returns (target logits, [B, D, n, Vd] logits).

    `forward` runs the drafter's TTT pass (a DeepSpeed engine wrapping it); default the drafter itself. A family
    that `scores_rows` computes only the rows the loss weighs (a long prompt's rows carry none: the target's pass
    over it is the context they need, and costs a fraction of the drafter's); the others are left at zero logits,
    where no weight reads them.
    """
    ids = batch.input_ids
    out = target.forward(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
    depth, n = batch.depth_tokens.shape[1], ids.shape[1] - 1
    args = (ids, drafter.features(out), batch.valid, depth, batch.depth_tokens)
    rows = weighed_rows(batch).to(ids.device) if getattr(drafter, "scores_rows", False) else None
    if rows is None or not 0 < len(rows) < n:
        return out.logits, (forward or drafter)(*args)
    part = (forward or drafter)(*args, rows=rows.expand(ids.shape[0], -1))  # [B, D, R, Vd]
    logits = part.new_zeros(*part.shape[:2], n, part.shape[3]).index_copy(2, rows, part)
    return out.logits, logits


def cat_grid(t_logits: torch.Tensor, input_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, D, n] CAT weights on the (row, depth) grid: row t, depth d predicts token t + 2 + d from a context
    ending at t + 1, so it weighs the target's probabilities of the d gold tokens t + 2 .. t + 1 + d (the
    copy-d weight at p = t + 1 + d of `cat_weights`); zeros where the grid has no label."""
    w = cat_weights(t_logits, input_ids, depth)
    n = input_ids.shape[1] - 1
    grid = torch.zeros(w.shape[0], depth, n, dtype=torch.float32, device=w.device)
    for d in range(depth):
        grid[:, d, : n - 1 - d] = w[:, d, 1 + d : n].float()  # labels t + 2 + d <= n
    return grid


def _accepted_divergence(kind: str, t_logits, d_logits, input_ids, d2t, t2d_index, d: int, span: int):
    """Per-row divergence at depth d between the target (position t + 1 + d) and the drafter."""
    teacher = t_logits[:, 1 + d : 1 + d + span]
    student = d_logits[:, d, :span]
    if kind != "bernoulli_fkl":
        return DIVERGENCES[kind](restrict_to_draft_vocab(teacher, d2t), student)
    # Reference proxy from two scalars: both models' log-probs of the token the target emitted there.
    gold = torch.roll(input_ids, -(2 + d), 1)[:, :span]
    draft_id = t2d_index[gold]
    t_lp = torch.log_softmax(teacher.float(), -1).gather(2, gold[..., None]).squeeze(2)
    s_lp = torch.log_softmax(student.float(), -1).gather(2, draft_id.clamp_min(0)[..., None]).squeeze(2)
    return torch.where(draft_id >= 0, bernoulli_forward_kl(t_lp, s_lp), torch.zeros_like(t_lp))


_warned_rerun = False


def _warn_rerun_cost(cfg: OPDLossConfig, tokens: int, replayed: int) -> None:
    """Once per process: the re-run path's cost, in the units of `target_tokens_per_token`."""
    global _warned_rerun
    if not _warned_rerun:
        _warned_rerun = True
        why = f"learner.rejection_loss={cfg.rejection_loss}"
        why = "learner.rerun_rejected_target=true" if cfg.rejection_loss == "k3" else why
        print(
            f"{why}: the rejected stream re-runs the target over every rejected step's prefix: {tokens} target "
            f"tokens beside one pass over {replayed} replayed tokens ({(tokens + replayed) / max(replayed, 1):.1f}x; "
            "logged every step as target_tokens_per_token)",
            file=sys.stderr,
            flush=True,
        )


def _recorded_target(cfg: OPDLossConfig, batch: ReplayBatch) -> torch.Tensor:
    """[B, D, n] the target log-prob k3 compares with: recorded at verification, no target pass."""
    if cfg.k3_full_vocab_target:
        return batch.rej_target_logp
    if batch.num_unrecorded:
        raise ValueError(
            f"{batch.num_unrecorded} rejected drafts come from verification steps without target_draft_logz "
            "(recorded before it existed, or by a backend that does not record it), which k3 against the "
            "draft-vocabulary target needs: roll out again, or set learner.rerun_rejected_target=true to re-run "
            "the target over each rejected step's prefix (many target passes per trajectory)"
        )
    return batch.rej_target_logp_draft


def _rejected_stream(cfg: OPDLossConfig, target, batch: ReplayBatch, d_logits, d2t) -> tuple[torch.Tensor, int]:
    """([B, D, n] per-token loss of the rejected stream, zero where it has no weight; target tokens it processed).

    The drafter's log-softmax is taken only at the rejected positions, not over the whole [B, D, n, Vd] grid."""
    out = torch.zeros_like(batch.rej_weight, dtype=torch.float32)
    if cfg.rej_coef == 0 or not (batch.rej_weight > 0).any():  # the stream is off or empty: no target pass
        return out, 0
    if cfg.rejection_loss == "k3" and not cfg.rerun_rejected_target:
        at = (batch.rej_weight > 0).nonzero(as_tuple=True)  # (b, d, t) of every rejected-stream token
        s = torch.log_softmax(d_logits[at].float(), -1).gather(1, batch.rej_draft_idx[at][:, None]).squeeze(1)
        out[at] = k3(_recorded_target(cfg, batch)[at], s)
        return out, 0
    rows, ts, t_logp, tokens = rejected_block_targets(target, batch, d2t)  # t_logp [R, D, Vd]
    _warn_rerun_cost(cfg, tokens, int(batch.valid.sum()))
    s = torch.log_softmax(d_logits[rows, :, ts].float(), -1)  # [R, D, Vd]
    drafted = batch.rej_draft_idx[rows, :, ts]  # [R, D]
    if cfg.rejection_loss == "k3":
        value = k3(t_logp.gather(2, drafted[..., None]).squeeze(2), s.gather(2, drafted[..., None]).squeeze(2))
    elif cfg.rejection_loss == "tv":
        value = 0.5 * (t_logp.exp() - s.exp()).abs().sum(-1)
    else:  # margin: the target's top token over the rejected draft, in the drafter's log-probs
        best = t_logp.argmax(-1)
        gap = s.gather(2, best[..., None]).squeeze(2) - s.gather(2, drafted[..., None]).squeeze(2)
        value = torch.where(best == drafted, torch.zeros_like(gap), torch.relu(cfg.margin - gap))
    out[rows, :, ts] = value
    return out, tokens


def opd_loss(
    drafter, target, batch: ReplayBatch, cfg: OPDLossConfig, forward=None, all_reduce=None, world: int = 1
) -> tuple[torch.Tensor, dict]:
    """The two-stream Draft-OPD loss on a replay batch, with per-stream metrics and weight shares.

    `all_reduce` sums a tensor over the learner ranks in place (None: one rank) and `world` is their number;
    the denominators are then global, and the loss is scaled so that DeepSpeed's averaging of the ranks'
    gradients gives the gradient of the global mean.
    """
    cfg.check()
    t_logits, d_logits = replay_forward(drafter, target, batch, forward)
    b, depth, n, _ = d_logits.shape
    d2t = drafter.draft_to_target_ids()
    t2d_index = target_to_draft_index(d2t, target.vocab_size)
    acc = torch.zeros(b, depth, n, device=d_logits.device)
    for d in range(depth):
        span = n - d  # rows whose teacher position t + 1 + d exists
        acc[:, d, :span] = _accepted_divergence(
            cfg.accepted_divergence, t_logits, d_logits, batch.input_ids, d2t, t2d_index, d, span
        )
    rej, rerun_tokens = _rejected_stream(cfg, target, batch, d_logits, d2t)
    acc_w, rej_w = batch.acc_weight, batch.rej_weight
    if cfg.accepted_cat:
        acc_w = acc_w * cat_grid(t_logits, batch.input_ids, depth).to(acc_w.device)
    loss, (share_acc, share_rej) = mix_streams(
        acc, acc_w, rej, rej_w, cfg.acc_coef, cfg.rej_coef, cfg.normalisation, all_reduce, world
    )
    metrics = {
        "loss": loss.item() / world,
        "loss_accepted": float((acc.detach() * acc_w).sum() / acc_w.sum().clamp_min(1e-12)),
        "loss_rejected": float((rej.detach() * rej_w).sum() / rej_w.sum().clamp_min(1e-12)),
        "share_accepted": float(share_acc),
        "share_rejected": float(share_rej),
        "num_accepted_tokens": int((acc_w > 0).sum()),
        "num_rejected_tokens": int((rej_w > 0).sum()),
        "num_replayed_steps": batch.num_steps,
        "num_rows": b,
        "num_tokens": int(batch.valid.sum()),
        # The target's tokens this step (padding excluded) per replayed token: one teacher-forced pass over each
        # trajectory is 1.0; re-running prefixes for the rejected stream adds `rerun_tokens`.
        "target_tokens_per_token": (int(batch.valid.sum()) + rerun_tokens) / max(int(batch.valid.sum()), 1),
    }
    return loss, metrics
