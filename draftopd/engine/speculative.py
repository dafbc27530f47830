"""Batched speculative decoding in plain torch, with a drafter of any family, that records every step.

One loop, for a batch of prompts of any lengths:

1. the target prefills the prompts and emits the first token;
2. the drafter's proposer (drafters/base.py) reads what the target committed and
   proposes K drafts with their probabilities;
3. the target scores [last token, d_1..d_K] in one pass; the verification rule
   keeps a prefix and adds the correction or bonus token; the step is recorded;
4. rejected slots are masked out of the target's key/value cache, the proposer
   commits the emitted tokens, finished rows leave the batch, and the loop goes on.

Rows of a batch advance by different amounts, so both caches are slot arrays with
a per-row validity mask and explicit position ids: a rejected draft's slot stays
in the cache but is never attended to again. Without a drafter, the same loop
with K = 0 is plain decoding with the target alone, which is what the
losslessness tests compare against.

A proposer of several candidate rows per step (D²SD, drafters/base.py
`RowProposer`) takes `step_rows` instead: one cascade pass of the target over
all rows (engine/cascade.py), the first-valid-row walk (engine/verify.py), and
the winning row's slots appended to the cache; the rest of the step is shared.
"""

from __future__ import annotations

import torch

from draftopd.drafters.base import Drafter
from draftopd.engine.cascade import append_row, cascade_forward
from draftopd.engine.verify import first_valid_row_walk, greedy_verify, rejection_verify, sample
from draftopd.messages import SamplingConfig, Trajectory, VerificationStep
from draftopd.models.layers import at_least_fp32, attend_mask
from draftopd.models.target import TargetModel, TargetOutput


def _partial_draft_vocab(engine: SpeculativeEngine) -> torch.Tensor | None:
    """The drafter's draft-vocabulary target ids when they are fewer than the target's; None when it drafts
    over the whole target vocabulary (its mass there is then 1: log 0.0, recorded exactly)."""
    ids = engine.drafter.draft_to_target_ids()
    return None if len(ids) == engine.target.vocab_size else ids


def draft_log_mass(target_logp: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """[..., V] target log-probs -> [...] log of their total over the draft vocabulary (zeros: the whole one).

    Recorded with each step as `target_draft_logz` (messages.py): only the draft-vocabulary columns are read."""
    if draft_ids is None:
        return torch.zeros(target_logp.shape[:-1], dtype=target_logp.dtype, device=target_logp.device)
    return target_logp.index_select(-1, draft_ids.to(target_logp.device)).logsumexp(-1)


class SpeculativeEngine:
    """Decodes with `target`, drafting with `drafter` when one is given. Not thread-safe."""

    def __init__(self, target: TargetModel, drafter: Drafter | None, eos_token_ids: list[int]):
        self.target = target
        self.drafter = drafter.eval() if drafter is not None else None
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        if drafter is not None:
            if drafter.vocab_size != target.vocab_size:
                raise ValueError(
                    f"drafter vocabulary ({drafter.vocab_size}) does not match the target's ({target.vocab_size})"
                )
            if drafter.aux_layer_ids and drafter.aux_layer_ids != target.aux_layer_ids:
                raise ValueError(
                    f"drafter reads target layers {drafter.aux_layer_ids}, target captures {target.aux_layer_ids}"
                )

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], cfg: SamplingConfig, policy_version: int = -1) -> list[Trajectory]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        k = cfg.num_draft_tokens if self.drafter is not None else 0
        gen = torch.Generator().manual_seed(cfg.seed)
        trajs = [
            Trajectory(
                prompt_ids=list(p),
                output_ids=[],
                policy_version=policy_version,
                temperature=cfg.temperature,
                num_draft_tokens=k,
                prompt_index=i,
            )
            for i, p in enumerate(prompts)
        ]
        run = _Run(self, cfg, k, gen, trajs)
        run.prefill()
        step = run.step_rows if k and hasattr(run.proposer, "propose_rows") else run.step
        while run.active.numel():
            step()
        return trajs


class _Run:
    """State of one `generate` call; rows are indexed by their place in the shrinking batch."""

    def __init__(self, engine: SpeculativeEngine, cfg: SamplingConfig, k: int, gen, trajs: list[Trajectory]):
        self.e, self.cfg, self.k, self.gen, self.trajs = engine, cfg, k, gen, trajs
        self.active = torch.arange(len(trajs))  # trajectory index of each batch row
        self.tcache = engine.target.new_cache()
        self.proposer = engine.drafter.proposer() if engine.drafter is not None else None
        self.draft_ids = _partial_draft_vocab(engine) if k else None

    # -- helpers -----------------------------------------------------------

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token choice from [B, V] logits; also the probabilities when sampling."""
        if self.cfg.temperature <= 0:
            return logits.argmax(-1), None
        probs = torch.softmax(logits.double() / self.cfg.temperature, dim=-1)
        return sample(probs, self.gen), probs

    def _target(self, ids, positions, new_valid, past_valid):
        mask = attend_mask(past_valid, new_valid)[:, None]
        want_aux = self.e.drafter is not None and self.e.drafter.needs == "aux"
        return self.e.target.forward(ids, positions, mask, self.tcache, want_aux=want_aux)

    # -- phases ------------------------------------------------------------

    def prefill(self):
        prompts = [t.prompt_ids for t in self.trajs]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding: the last prompt token sits in the last slot
            ids[i, width - len(p) :] = torch.tensor(p)
            valid[i, width - len(p) :] = True
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        out = self._target(ids, positions, valid, torch.zeros(len(prompts), 0, dtype=torch.bool))
        self.tvalid = valid
        first, _ = self._pick(out.logits[:, -1])
        self.pending = first
        self.next_pos = valid.sum(1)  # position of the pending token
        for i, tok in enumerate(first.tolist()):
            self.trajs[i].output_ids.append(tok)
        if self.proposer is not None:
            self.proposer.begin(ids, positions, valid, first, out)
        self._retire(self._finished_rows(first[:, None], torch.ones(len(prompts), dtype=torch.long)))

    def step(self):
        b, k = self.active.numel(), self.k
        if k:
            drafts, q, draft_logps = self.proposer.propose(k, self._pick)
        else:
            drafts, q, draft_logps = torch.zeros(b, 0, dtype=torch.long), None, None
        ids = torch.cat([self.pending[:, None], drafts], dim=1)
        positions = self.next_pos[:, None] + torch.arange(k + 1)
        out = self._target(ids, positions, torch.ones(b, k + 1, dtype=torch.bool), self.tvalid)
        if self.cfg.temperature <= 0:
            accepted, nxt = greedy_verify(drafts, out.logits)
        else:
            p = torch.softmax(out.logits.double() / self.cfg.temperature, dim=-1)
            q = q if q is not None else torch.zeros(b, 0, p.shape[-1], dtype=p.dtype)
            accepted, nxt = rejection_verify(drafts, q, p, self.gen)
        self._advance(drafts, draft_logps, out, accepted, nxt, positions)

    def step_rows(self):
        """One step of a proposer of several candidate rows (drafters/base.py `RowProposer`): all rows in one
        cascade pass of the target, accepted along the first row that still agrees (engine/verify.py)."""
        b, k = self.active.numel(), self.k
        drafts, draft_logps = self.proposer.propose_rows(k)  # [B, R, K]
        ids = torch.cat([self.pending[:, None, None].expand(-1, drafts.shape[1], 1), drafts], dim=2)
        positions = self.next_pos[:, None] + torch.arange(k + 1)
        want_aux = self.e.drafter.needs == "aux"
        out = cascade_forward(self.e.target, self.tcache, self.tvalid, ids, positions, want_aux)
        row, accepted, nxt = first_valid_row_walk(drafts, out.logits, self.cfg.temperature, self.gen)
        append_row(self.tcache, out.kv, row)
        at = torch.arange(b)
        won = TargetOutput(out.logits[at, row], out.aux_hidden[at, row] if want_aux else None)
        self._advance(drafts[at, row], draft_logps[at, row], won, accepted, nxt, positions, row)

    def _advance(self, drafts, draft_logps, out, accepted, nxt, positions, row=None):
        """Record the step, drop the dead cache slots, let the proposer commit, retire finished rows."""
        b, k = self.active.numel(), self.k
        emitted = torch.cat([drafts, torch.zeros(b, 1, dtype=torch.long)], dim=1)
        emitted[torch.arange(b), accepted] = nxt
        num_emitted = accepted + 1
        self._record(drafts, draft_logps, out.logits, accepted, emitted, num_emitted, row)
        # Slots past each row's accepted prefix are dead; trim those dead in every row.
        slot = torch.arange(k + 1)
        self.tvalid = torch.cat([self.tvalid, slot[None] <= accepted[:, None]], dim=1)
        trim = k - int(accepted.max())
        if trim:
            self.tcache.crop(-trim)
            self.tvalid = self.tvalid[:, :-trim]
        if self.proposer is not None:
            self.proposer.commit(out, emitted, num_emitted, positions)
        self.pending = nxt
        self.next_pos = self.next_pos + num_emitted
        self._retire(self._finished_rows(emitted, num_emitted))

    def _record(self, drafts, draft_logps, target_logits, accepted, emitted, num_emitted, row=None):
        """Append each row's new tokens, and its VerificationStep when it drafted (from candidate `row` [B])."""
        rows = self.active.tolist()
        new_tokens = [e[:n] for e, n in zip(emitted.tolist(), num_emitted.tolist())]
        if not self.k:
            for r, toks in zip(rows, new_tokens):
                self.trajs[r].output_ids.extend(toks)
            return
        t_full = torch.log_softmax(target_logits[:, :-1].to(at_least_fp32(target_logits.dtype)), -1)
        t_logps = t_full.gather(2, drafts[..., None]).squeeze(2)
        logz = draft_log_mass(t_full, self.draft_ids).tolist()
        won = row.tolist() if row is not None else [0] * len(rows)
        columns = zip(rows, new_tokens, drafts.tolist(), draft_logps.tolist(), t_logps.tolist(), accepted.tolist(), won)
        for (r, toks, d, d_lp, t_lp, a, w), z in zip(columns, logz):
            traj = self.trajs[r]
            position = len(traj.prompt_ids) + len(traj.output_ids)
            traj.steps.append(VerificationStep(position, d, d_lp, t_lp, a, toks, w, z))
            traj.output_ids.extend(toks)

    def _finished_rows(self, emitted: torch.Tensor, num_emitted: torch.Tensor) -> list[int]:
        """Cut each row's new tokens at end-of-sequence or the budget; return the rows that are done."""
        width = emitted.shape[1]
        is_new = torch.arange(width)[None] < num_emitted[:, None]
        hit = torch.isin(emitted, self.e.eos) & is_new
        first_hit = torch.where(hit.any(1), hit.float().argmax(1), width)  # index within the new tokens
        lengths = torch.tensor([len(self.trajs[r].output_ids) for r in self.active.tolist()])
        stop_at = lengths - num_emitted + first_hit + 1  # output length if cut right after the EOS
        over = lengths >= self.cfg.max_new_tokens
        candidates = (hit.any(1) | over).nonzero().squeeze(1).tolist()
        for row in candidates:
            traj = self.trajs[int(self.active[row])]
            cut, traj.finish_reason = (int(stop_at[row]), "stop") if hit[row].any() else (len(traj.output_ids), "")
            if cut > self.cfg.max_new_tokens or not traj.finish_reason:
                cut, traj.finish_reason = min(cut, self.cfg.max_new_tokens), "length"
            drop = len(traj.output_ids) - cut
            if drop and traj.steps:
                last = traj.steps[-1]
                last.emitted = last.emitted[: len(last.emitted) - drop]
            del traj.output_ids[cut:]
        return candidates

    def _retire(self, rows: list[int]):
        if not rows:
            return
        keep_mask = torch.ones(self.active.numel(), dtype=torch.bool)
        keep_mask[rows] = False
        keep = keep_mask.nonzero().squeeze(1)
        self.active = self.active[keep]
        if not keep.numel():
            return
        self.tcache.batch_select_indices(keep)
        self.tvalid = self.tvalid[keep]
        self.pending, self.next_pos = self.pending[keep], self.next_pos[keep]
        if self.proposer is not None:
            self.proposer.select(keep)
