"""SFT of a drafter on target-written responses, on the shared (row, depth) grid of drafters/base.py.

The loss at depth d compares the drafter's prediction d + 1 tokens past its
context (for EAGLE-3 the chain step computed from its own fed-back states:
training-time test) with the target's distribution at the same place,
restricted to the draft vocabulary: forward KL, weighted `depth_decay ** d`,
averaged over response positions. A family with its own published objective
(PARD: conditional drop, CAT weights, CE + KD) gives `sft_loss`, used instead.
The trainer is a plain
class (no Ray, no DeepSpeed) so tests and the Draft-OPD learner can drive it.
"""

from __future__ import annotations

import inspect
import logging
import math
import random
from dataclasses import dataclass

import torch

from draftopd.divergences import forward_kl, masked_mean, restrict_to_draft_vocab
from draftopd.drafters.base import RowSet
from draftopd.schema import SFTConfig

log = logging.getLogger(__name__)


@dataclass
class SFTExample:
    """A prompt + target-written response; positions >= prompt_len are the response."""

    ids: list[int]
    prompt_len: int


@dataclass
class Batch:
    """Right-padded sequences. `loss_pos[b, j]` is True where position j predicts a response token."""

    input_ids: torch.Tensor
    valid: torch.Tensor
    loss_pos: torch.Tensor


def collate(examples: list[SFTExample], max_len: int, pad_id: int = 0) -> Batch:
    seqs = [e.ids[:max_len] for e in examples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    loss_pos = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (s, e) in enumerate(zip(seqs, examples)):
        ids[i, : len(s)] = torch.tensor(s)
        valid[i, : len(s)] = True
        loss_pos[i, max(e.prompt_len - 1, 0) : len(s) - 1] = True
    return Batch(ids, valid, loss_pos)


def check_window(examples: list[SFTExample], max_len: int) -> None:
    """Raise when sft.max_seq_len cuts every response away (a long prompt fills the window: nothing to learn);
    warn when it cuts some."""
    cut = sum(e.prompt_len >= max_len for e in examples)
    if not cut:
        return
    longest = max(len(e.ids) for e in examples)
    msg = f"{cut} of {len(examples)} prompts are at least sft.max_seq_len ({max_len}) tokens long"
    if cut == len(examples):
        raise ValueError(f"{msg}: no response token is left to train on; set sft.max_seq_len={longest}")
    log.warning("%s: they train on nothing (the longest prompt and response: %d tokens)", msg, longest)


def random_rows(batch: Batch, num: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`num` distinct rows per sequence whose anchor and next token are response tokens (DFlash's anchors):
    rows [B, num] and whether each is real [B, num] (a short response has fewer)."""
    eligible = batch.loss_pos[:, :-1] & batch.loss_pos[:, 1:]  # row t: loss_pos[t] and loss_pos[t + 1]
    noise = torch.rand(eligible.shape, generator=generator).to(eligible.device)
    keys = torch.where(eligible, noise, torch.full_like(noise, -1.0))
    top = keys.topk(min(num, keys.shape[1]), dim=1)
    return top.indices, top.values >= 0


def ttt_loss(
    drafter, target, batch: Batch, depth: int, decay: float, forward=None, rows=None, generator=None
) -> tuple[torch.Tensor, dict]:
    """Weighted forward KL over TTT depths, plus per-depth top-1 agreement with the target.

    `forward` is what runs the drafter's TTT pass (a DeepSpeed engine wrapping it); default the drafter itself.
    `rows` (rows [B, R], real [B, R], from `random_rows`) scores only those rows; a family with
    `training_rows` (drafters/base.py) turns them into its own row sets (drawn with `generator`), each scored
    and weighted the same way, their losses summed.
    """
    n = batch.input_ids.shape[1]
    positions = torch.arange(n, device=batch.input_ids.device).expand_as(batch.input_ids)
    out = target.forward(batch.input_ids, positions)
    forward = forward or drafter
    features = drafter.features(out)
    if rows is None:
        draft_logits = forward(batch.input_ids, features, batch.valid, depth)  # [B, D, n, Vd]
        total, metrics = _depth_losses(drafter, batch, out.logits, draft_logits, decay)
        return total, {**metrics, "loss": total.item()}
    if hasattr(drafter, "training_rows"):
        sets = drafter.training_rows(rows[0], rows[1], generator)
    else:
        sets = {"": RowSet(rows[0], rows[1])}
    total, metrics = 0.0, {}
    for name, s in sets.items():
        draft_logits = forward(batch.input_ids, features, batch.valid, depth, rows=s.rows, **s.kwargs)
        loss, m = _depth_losses(drafter, batch, out.logits, draft_logits, decay, s)
        total = total + loss
        metrics.update({name + key: value for key, value in m.items()})
    return total, {**metrics, "loss": total.item()}


def _depth_losses(drafter, batch: Batch, teacher_logits, draft_logits, decay: float, rows: RowSet | None = None):
    """sum_d decay**d x (masked mean KL at depth d) over the grid rows (all, or `rows`), with metrics."""
    n = batch.input_ids.shape[1]
    d2t = drafter.draft_to_target_ids()
    total = torch.zeros((), dtype=torch.float32, device=batch.input_ids.device)
    metrics = {}
    for d in range(draft_logits.shape[1]):
        logits = draft_logits[:, d]
        if rows is None:
            span = n - 1 - d  # draft rows whose teacher (position t + 1 + d) exists
            if span <= 0:
                break
            teacher = teacher_logits[:, 1 + d : 1 + d + span]
            mask = batch.loss_pos[:, 1 + d : 1 + d + span]
        else:  # row t's teacher sits at position t + 1 + d, as above, gathered
            span = rows.rows.shape[1]
            at = rows.rows + 1 + d
            inside = at < n
            at = at.clamp_max(n - 1)
            teacher = teacher_logits.gather(1, at[..., None].expand(-1, -1, teacher_logits.shape[-1]))
            mask = batch.loss_pos.gather(1, at) & inside & rows.real
            if rows.num_depths is not None:
                mask = mask & (d < rows.num_depths)
        kl = forward_kl(restrict_to_draft_vocab(teacher, d2t), logits[:, :span])
        loss_d = masked_mean(kl, mask)
        total = total + (decay**d) * loss_d
        agree = (d2t[logits[:, :span].argmax(-1)] == teacher.argmax(-1)).float()
        metrics[f"kl_{d}"] = loss_d.item()
        metrics[f"acc_{d}"] = float(masked_mean(agree, mask))
    return total, metrics


def lr_at(step: int, total: int, peak: float, warmup_ratio: float) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    warm = max(1, int(total * warmup_ratio))
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


class SFTTrainer:
    """Owns the optimizer; `run()` yields one metrics dict per optimizer step."""

    def __init__(self, drafter, target, examples: list[SFTExample], cfg: SFTConfig, seed: int = 0, pad_id: int = 0):
        if not examples:
            raise ValueError("no training examples")
        if cfg.num_anchors and "rows" not in inspect.signature(drafter.score).parameters:
            raise ValueError(f"sft.num_anchors needs a family whose score takes rows, not '{drafter.kind}'")
        if hasattr(drafter, "training_rows") and not cfg.num_anchors:
            raise ValueError(f"a '{drafter.kind}' drafter trains at random anchors: set sft.num_anchors")
        check_window(examples, cfg.max_seq_len)
        self.drafter, self.target, self.examples, self.cfg = drafter, target, examples, cfg
        self.pad_id = pad_id
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)  # anchors, drawn afresh each step
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        self.step = 0

    def batches(self):
        for _ in range(self.cfg.epochs):
            order = list(range(len(self.examples)))
            self.rng.shuffle(order)
            for i in range(0, len(order), self.cfg.batch_size):
                yield [self.examples[j] for j in order[i : i + self.cfg.batch_size]]

    def train_step(self, examples: list[SFTExample]) -> dict:
        self.drafter.train()
        lr = lr_at(self.step, self.total_steps, self.cfg.lr, self.cfg.warmup_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        batch = collate(examples, self.cfg.max_seq_len, self.pad_id)
        loss, metrics = self._loss(batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        metrics.update(step=self.step, lr=lr, grad_norm=float(grad_norm))
        return metrics

    def _loss(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """The family's own SFT objective when it has one (PARD: COD, CAT weights, CE + KD), else `ttt_loss`."""
        cfg = self.cfg
        if hasattr(self.drafter, "sft_loss"):
            out = self.target.forward(
                batch.input_ids, torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)
            )
            loss, metrics = self.drafter.sft_loss(batch, out, cfg.ttt_depth, cfg, self.gen)
            return loss, {**metrics, "loss": loss.item()}
        rows = random_rows(batch, cfg.num_anchors, self.gen) if cfg.num_anchors else None
        return ttt_loss(self.drafter, self.target, batch, cfg.ttt_depth, cfg.depth_decay, rows=rows, generator=self.gen)

    def run(self):
        for examples in self.batches():
            yield self.train_step(examples)
