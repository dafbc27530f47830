"""`draftopd bench opd-vs-sft`: more SFT against Draft-OPD from the same start, at matched learner compute.

Both arms start from the same drafter checkpoint and run the same TTT pass over
whole sequences at the same depth, so learner FLOPs are proportional to the
tokens fed to the learner; the OPD arm stops once it has used as many learner
tokens as the SFT arm. Rollouts (inference) are timed separately, not matched.
In-process and single-rank on purpose: it compares the objectives, not the
distributed system, and fits in minutes on a laptop.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from draftopd.engine.speculative import SpeculativeEngine
from draftopd.eval.acceptance import acceptance_stats
from draftopd.messages import SamplingConfig
from draftopd.opd.buffer import BufferConfig, ReplayBuffer
from draftopd.opd.replay import OPDLossConfig, build_replay_batch, opd_loss, target_to_draft_index
from draftopd.sft.trainer import SFTExample, collate, ttt_loss


@dataclass
class BenchSettings:
    """Sizes of the comparison; defaults fit a few minutes on 2 CPU cores with the toy target."""

    sft_steps: int = 30
    batch_size: int = 8
    lr: float = 3e-4
    depth: int = 4
    num_draft_tokens: int = 4
    rollout_prompts: int = 8
    steps_per_round: int = 2
    max_new_tokens: int = 96
    max_seq_len: int = 320
    decay: float = 0.8
    temperature: float = 0.0
    accepted_rows: str = "all"
    seed: int = 0


def _optimizer(drafter, lr):
    return torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95))


def _step(opt, drafter, loss):
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()


def sft_arm(drafter, target, examples: list[SFTExample], s: BenchSettings) -> int:
    """`sft_steps` TTT steps on target responses; returns learner tokens used."""
    rng, opt, tokens = random.Random(s.seed), _optimizer(drafter, s.lr), 0
    for _ in tqdm(range(s.sft_steps), desc="arm: more SFT", unit="step"):
        batch = collate(rng.sample(examples, min(s.batch_size, len(examples))), s.max_seq_len)
        tokens += int(batch.valid.sum())
        drafter.train()
        loss, _ = ttt_loss(drafter, target, batch, s.depth, s.decay)
        _step(opt, drafter, loss)
    return tokens


def opd_arm(drafter, target, eos, prompts: list[list[int]], budget: int, s: BenchSettings) -> dict:
    """Rollout rounds and replay steps until `budget` learner tokens are spent."""
    opt, tokens, version = _optimizer(drafter, s.lr), 0, 0
    buffer = ReplayBuffer(BufferConfig(capacity=2048, max_staleness=4, seed=s.seed))
    t2d = target_to_draft_index(drafter.draft_to_target_ids(), target.vocab_size)
    rollout_s, rollout_tokens, start = 0.0, 0, 0
    with tqdm(total=budget, desc="arm: Draft-OPD", unit="tok") as bar:
        while tokens < budget:
            chunk = [prompts[(start + i) % len(prompts)] for i in range(s.rollout_prompts)]
            start += s.rollout_prompts
            t0 = time.perf_counter()
            trajs = SpeculativeEngine(target, drafter.eval(), eos).generate(
                chunk, SamplingConfig(s.max_new_tokens, s.temperature, s.num_draft_tokens, s.seed + version), version
            )
            rollout_s += time.perf_counter() - t0
            rollout_tokens += sum(len(t.output_ids) for t in trajs)
            buffer.add(trajs)
            for _ in range(s.steps_per_round):
                states = buffer.sample(s.batch_size, version)
                if not states or tokens >= budget:
                    break
                batch = build_replay_batch(
                    states, t2d, s.num_draft_tokens, s.decay, s.max_seq_len, accepted_rows=s.accepted_rows
                )
                used = int(batch.valid.sum())
                drafter.train()
                loss, _ = opd_loss(drafter, target, batch, OPDLossConfig())
                _step(opt, drafter, loss)
                tokens, version = tokens + used, version + 1
                bar.update(used)
    return {
        "learner_tokens": tokens,
        "learner_steps": version,
        "rollout_seconds": rollout_s,
        "rollout_tokens_per_s": rollout_tokens / max(rollout_s, 1e-9),
        "buffer": buffer.stats(version),
    }


def held_out_tau(drafter, target, eos, prompts, s: BenchSettings) -> dict:
    trajs = SpeculativeEngine(target, drafter.eval(), eos).generate(
        prompts, SamplingConfig(s.max_new_tokens, 0.0, s.num_draft_tokens, s.seed)
    )
    return acceptance_stats(trajs, s.num_draft_tokens)


def run_bench(target, eos, load_start, train_prompts, eval_sets: dict[str, list], s: BenchSettings) -> dict:
    """`load_start()` returns a fresh copy of the starting drafter each time it is called.

    `eval_sets` maps a held-out set's name to its prompts; the first one is the headline.
    """
    torch.manual_seed(s.seed)
    engine = SpeculativeEngine(target, None, eos)
    # The SFT arm learns from the same kind of text the OPD arm's rollouts follow (the target at the rollout
    # temperature), so the comparison isolates the on-policy signal, not a change of data distribution.
    responses = engine.generate(train_prompts, SamplingConfig(s.max_new_tokens, s.temperature, 0, s.seed))
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in responses]
    start_drafter = load_start()
    start = {n: held_out_tau(start_drafter, target, eos, p, s) for n, p in eval_sets.items()}
    sft = load_start()
    budget = sft_arm(sft, target, examples, s)
    sft_eval = {n: held_out_tau(sft, target, eos, p, s) for n, p in eval_sets.items()}
    opd = load_start()
    opd_info = opd_arm(opd, target, eos, train_prompts, budget, s)
    opd_eval = {n: held_out_tau(opd, target, eos, p, s) for n, p in eval_sets.items()}
    head = next(iter(eval_sets))
    per_set = {
        n: {
            "start_tau": start[n]["tau"],
            "sft_tau": sft_eval[n]["tau"],
            "opd_tau": opd_eval[n]["tau"],
            "tau_ratio_opd_over_sft": opd_eval[n]["tau"] / sft_eval[n]["tau"],
            "opd_tau_over_ceiling": opd_eval[n]["tau"] / (s.num_draft_tokens + 1),
        }
        for n in eval_sets
    }
    return {
        "settings": s.__dict__,
        "headline_set": head,
        "start": start[head],
        "sft": {"learner_tokens": budget, **sft_eval[head]},
        "opd": {**opd_info, **opd_eval[head]},
        "tau_ratio_opd_over_sft": opd_eval[head]["tau"] / sft_eval[head]["tau"],
        "per_set": per_set,
    }
