"""The opd-vs-sft bench's serving temperature and its fixed-anchor arm, on the toy target at a few steps."""

from __future__ import annotations

import pytest

from draftopd.bench.opd_vs_sft import BenchSettings, held_out, run_bench
from draftopd.data.prompts import encode_chats, toy_prompts
from draftopd.drafters import load_drafter
from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_drafter_path


@pytest.fixture(scope="module")
def toy():
    tokenizer = load_tokenizer("toy")
    target = load_target("toy", [1, 2, 3])
    path = resolve_drafter_path("toy-plateau")
    return target, eos_ids(tokenizer, "toy"), lambda: load_drafter(path, target), tokenizer


def test_held_out_tau_at_a_temperature_is_the_mean_over_paired_sampling_seeds(toy):
    target, eos, start, tokenizer = toy
    prompts = encode_chats(tokenizer, toy_prompts("held_out", 4, 0))
    one = held_out(start(), target, eos, prompts, 4, 3, 32, temperature=1.0, samples=2)
    again = held_out(start(), target, eos, prompts, 4, 3, 32, temperature=1.0, samples=2)
    assert len(one["tau_per_sample"]) == 2 and one["tau_per_sample"][0] != one["tau_per_sample"][1]
    assert one["tau"] == pytest.approx(sum(one["tau_per_sample"]) / 2)
    assert again == one  # the same seed: the same sampling seeds, so two arms measured at one seed are paired
    greedy = held_out(start(), target, eos, prompts, 4, 3, 32)
    assert "tau_per_sample" not in greedy and greedy["tau"] != one["tau"]


def test_fixed_anchor_arm_replays_the_starting_drafters_rollouts_only(toy):
    target, eos, start, tokenizer = toy
    train = encode_chats(tokenizer, toy_prompts("train", 8, seed=1))
    held = {"toy": encode_chats(tokenizer, toy_prompts("held_out", 2, 0))}
    s = BenchSettings(
        steps=3,
        batch_size=4,
        eval_ks=(4,),
        eval_every=3,
        rollout_prompts=4,
        max_new_tokens=32,
        seeds=(0,),
        arms=("opd-control", "opd-fixed-anchors"),
        rollout_temperature=1.0,
        eval_temperature=1.0,
        eval_samples=1,
    )
    report = run_bench(target, eos, start, train, held, s)
    on, fixed = (report["arms"][a]["seeds"][0] for a in ("opd-control", "opd-fixed-anchors"))
    # as many rollouts as the on-policy arm, every one decoded by the starting drafter (policy version 0)
    assert on["rollout"]["trajectories"] == fixed["rollout"]["trajectories"] == 3 * 4
    assert on["rollout"]["policy_versions"] == [0, 1, 2] and fixed["rollout"]["policy_versions"] == [0]
    assert on["loss"] == fixed["loss"] and fixed["loss"]["rej_coef"] == 0
    assert on["optimizer_steps"] == fixed["optimizer_steps"] == 3 and on["learner_rows"] == fixed["learner_rows"]
    assert report["settings"]["max_seq_len"] == max(map(len, train)) + 32
