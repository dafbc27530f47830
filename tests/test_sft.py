"""SFT with training-time test really trains: loss falls and acceptance rises."""

import pytest
import torch
from conftest import random_prompts

from draftopd.config import SFTConfig
from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
from draftopd.eval.acceptance import acceptance_stats
from draftopd.sft.trainer import SFTExample, SFTTrainer, check_window, collate, lr_at
from draftopd.sft.vocab import build_draft_vocab, coverage
from draftopd.testing import tiny_drafter, tiny_target


def test_collate_marks_response_positions():
    batch = collate([SFTExample([5, 6, 7, 8, 9], prompt_len=3), SFTExample([5, 6, 7], prompt_len=1)], max_len=8)
    # Position j is a loss position when token j+1 belongs to the response.
    assert batch.loss_pos.tolist() == [[False, False, True, True, False], [True, True, False, False, False]]
    assert batch.valid.sum().item() == 8


def test_a_window_that_cuts_every_response_is_refused_and_one_that_cuts_some_warns(caplog):
    """Long prompts (long-context traffic) fill sft.max_seq_len: with nothing left to learn the trainer says which
    setting to raise, instead of training on no token."""
    long = [SFTExample(list(range(12)), prompt_len=9), SFTExample(list(range(10)), prompt_len=8)]
    with pytest.raises(ValueError, match=r"2 of 2 prompts .* sft.max_seq_len \(8\).*set sft.max_seq_len=12"):
        check_window(long, 8)
    with caplog.at_level("WARNING", logger="draftopd.sft.trainer"):
        check_window(long, 9)
    assert "1 of 2 prompts are at least sft.max_seq_len (9)" in caplog.text
    assert collate(long, 9).loss_pos[1].any() and not collate(long, 9).loss_pos[0].any()
    caplog.clear()
    check_window(long, 10)
    assert not caplog.text


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
