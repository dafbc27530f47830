"""SFT with training-time test really trains: loss falls and acceptance rises."""

import torch
from conftest import random_prompts

from draftopd.config import SFTConfig
from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
from draftopd.eval.acceptance import acceptance_stats
from draftopd.sft.trainer import SFTExample, SFTTrainer, collate, lr_at
from draftopd.sft.vocab import build_draft_vocab, coverage
from draftopd.testing import tiny_drafter, tiny_target


def test_collate_marks_response_positions():
    batch = collate([SFTExample([5, 6, 7, 8, 9], prompt_len=3), SFTExample([5, 6, 7], prompt_len=1)], max_len=8)
    # Position j is a loss position when token j+1 belongs to the response.
    assert batch.loss_pos.tolist() == [[False, False, True, True, False], [True, True, False, False, False]]
    assert batch.valid.sum().item() == 8


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 100, 1.0, 0.1) for s in range(100)]
    assert lrs[0] == 0.1 and max(lrs) == 1.0 and lrs.index(1.0) == 9
    assert lrs[-1] < 0.15 and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_draft_vocab_is_most_frequent_and_sorted():
    ids = build_draft_vocab([[5, 5, 5, 7, 7, 9], [5, 3]], size=3, vocab_size=12, always=[1])
    assert ids.tolist() == [1, 5, 7]
    assert coverage([[5, 5, 7, 9]], ids) == 0.75


def test_sft_lowers_loss_and_raises_acceptance():
    torch.manual_seed(0)
    target = tiny_target(vocab=16)
    prompts = random_prompts(64, 16, seed=1)
    trajs = SpeculativeEngine(target, None, [1]).generate(prompts, SamplingConfig(40, 1.0, 0, 0))
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs]
    drafter = tiny_drafter(target, seed=2)
    held = random_prompts(16, 16, seed=99)
    cfg = SamplingConfig(max_new_tokens=30, num_draft_tokens=4)

    def tau():
        return acceptance_stats(SpeculativeEngine(target, drafter.eval(), [1]).generate(held, cfg), 4)["tau"]

    before = tau()
    trainer = SFTTrainer(drafter, target, examples, SFTConfig(epochs=12, batch_size=16, lr=3e-3, ttt_depth=3), 0)
    losses = [m["loss"] for m in trainer.run()]
    after = tau()
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4
    assert after > before + 0.5, (before, after)
