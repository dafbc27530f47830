"""Draft-OPD maths: the estimators, and replay that rebuilds exactly the rollout's own chains."""

import math

import pytest
import torch
from conftest import random_prompts

from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
from draftopd.messages import ErrorState
from draftopd.opd.objective import bernoulli_forward_kl, jsd, k3, mix_streams, total_variation
from draftopd.opd.replay import OPDLossConfig, build_replay_batch, opd_loss, replay_forward, target_to_draft_index


def test_k3_values_and_gradient():
    t = torch.tensor([-1.0, -2.0, -0.5])
    s = torch.tensor([-1.0, -0.5, -3.0], requires_grad=True)
    loss = k3(t, s)
    d = t - s.detach()
    assert torch.allclose(loss, d.exp() - d - 1)
    assert loss[0] == 0 and (loss >= 0).all()
    loss.sum().backward()
    assert torch.allclose(s.grad, 1 - d.exp())  # pushes s down where the target likes the token less
    assert k3(torch.tensor([0.0]), torch.tensor([-50.0])).item() == 10.0  # loss clamp


def test_bernoulli_proxy_matches_two_outcome_kl():
    t, s = torch.tensor([math.log(0.7)]), torch.tensor([math.log(0.4)])
    want = 0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6)
    assert bernoulli_forward_kl(t, s).item() == pytest.approx(want, rel=1e-5)


def test_jsd_and_tv_on_known_distributions():
    p = torch.tensor([[0.5, 0.5, 0.0]]).clamp_min(1e-30).log()
    q_logits = torch.tensor([[0.0, 0.0, -1e9]])
    assert jsd(p, q_logits).item() == pytest.approx(0.0, abs=1e-6)
    assert total_variation(p, torch.tensor([[0.0, -1e9, -1e9]])).item() == pytest.approx(0.5, abs=1e-6)


def test_mix_streams_token_mean_and_stream_means():
    acc, rej = torch.tensor([1.0, 3.0]), torch.tensor([10.0])
    acc_w, rej_w = torch.tensor([1.0, 0.5]), torch.tensor([0.8])
    got, shares = mix_streams(acc, acc_w, rej, rej_w, 1.0, 2.0, "token_mean")
    assert got.item() == pytest.approx((1 * 1 + 0.5 * 3 + 2 * 0.8 * 10) / (1.5 + 2 * 0.8))
    assert shares == pytest.approx((1.5 / 3.1, 1.6 / 3.1))
    got, shares = mix_streams(acc, acc_w, rej, rej_w, 1.0, 2.0, "stream_means")
    assert got.item() == pytest.approx((1 + 1.5) / 1.5 + 2 * 10)
    assert shares == pytest.approx((1 / 3, 2 / 3))
    # A stream without weight drops out of both the loss and the shares (the control arm, rej_coef=0, likewise).
    got, shares = mix_streams(acc, acc_w, rej, torch.zeros(1), 1.0, 2.0, "stream_means")
    assert got.item() == pytest.approx(2.5 / 1.5) and shares == (1.0, 0.0)


def test_mix_streams_denominators_are_global_across_ranks():
    """Two ranks holding different shares of the tokens: the mean of their scaled losses is the global mean."""
    ranks = [
        (torch.tensor([1.0, 2.0, 3.0]), torch.ones(3), torch.tensor([4.0]), torch.ones(1)),
        (torch.tensor([5.0]), torch.ones(1), torch.tensor([0.0]), torch.zeros(1)),
    ]
    global_sums = sum(torch.stack([r[1].sum(), r[3].sum()]).double() for r in ranks)

    def all_reduce(t):
        t.copy_(global_sums)

    for norm in ("token_mean", "stream_means"):
        losses = [mix_streams(*r, 1.0, 1.0, norm, all_reduce, world=2)[0] for r in ranks]
        cat = [torch.cat([r[i] for r in ranks]) for i in range(4)]
        want = mix_streams(*cat, 1.0, 1.0, norm)[0]
        assert (sum(losses) / 2).item() == pytest.approx(want.item())
        per_rank = [mix_streams(*r, 1.0, 1.0, norm)[0] for r in ranks]  # per-rank denominators differ
        assert (sum(per_rank) / 2).item() != pytest.approx(want.item())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replay_rebuilds_the_recorded_chains(tiny_pair, temperature):
    """With the rollout's weights, replayed log-probs of every draft equal the recorded ones."""
    target, drafter = tiny_pair
    k = 4
    trajs = SpeculativeEngine(target, drafter, [1]).generate(
        random_prompts(6, 16, seed=4), SamplingConfig(30, temperature, k, seed=1)
    )
    states = [ErrorState(t, i, 0) for t in trajs for i in range(len(t.steps))]
    t2d = target_to_draft_index(drafter.draft_to_target_ids(), target.vocab_size)
    batch = build_replay_batch(states, t2d, depth=k, decay=0.8, max_len=512)
    assert batch.num_steps == len(states)
    _, d_logits = replay_forward(drafter, target, batch)
    logp = torch.log_softmax(d_logits, -1)
    rows = {tid: r for r, tid in enumerate(dict.fromkeys(id(s.trajectory) for s in states))}
    checked = 0
    for s in states:
        row, t = rows[id(s.trajectory)], s.step.position - 2
        for d, tok in enumerate(s.step.draft_tokens):
            assert logp[row, d, t, int(t2d[tok])].item() == pytest.approx(s.step.draft_logprobs[d], abs=1e-9)
            checked += 1
    assert checked == k * len(states)


def test_replay_streams_follow_the_acceptance(tiny_pair):
    target, drafter = tiny_pair
    trajs = SpeculativeEngine(target, drafter, [1]).generate(random_prompts(4, 16, seed=8), SamplingConfig(30, 0.0, 5))
    states = [ErrorState(t, i, 0) for t in trajs for i, s in enumerate(t.steps) if s.rejected]
    t2d = target_to_draft_index(drafter.draft_to_target_ids(), target.vocab_size)
    batch = build_replay_batch(states, t2d, depth=5, decay=0.8, max_len=512, accepted_rows="anchors")
    rows = {tid: r for r, tid in enumerate(dict.fromkeys(id(s.trajectory) for s in states))}
    for s in states:
        row, t, a = rows[id(s.trajectory)], s.step.position - 2, s.step.num_accepted
        acc = [d for d in range(5) if batch.acc_weight[row, d, t] > 0]
        rej = [d for d in range(5) if batch.rej_weight[row, d, t] > 0]
        labelled = [d for d in range(min(a, 4) + 1) if s.step.position + d < len(s.trajectory.full_ids)]
        assert rej == list(range(a, 5)) and acc == labelled
        assert batch.rej_weight[row, a, t].item() == pytest.approx(0.8**a)
        assert batch.rej_target_logp[row, a, t].item() == pytest.approx(s.step.target_logprobs[a])
    loss, metrics = opd_loss(drafter, target, batch, OPDLossConfig())
    assert torch.isfinite(loss) and metrics["num_rejected_tokens"] > 0 and metrics["num_accepted_tokens"] > 0
    for kind in ["jsd", "tv", "bernoulli_fkl"]:
        assert torch.isfinite(opd_loss(drafter, target, batch, OPDLossConfig(accepted_divergence=kind))[0])


def test_all_rows_mode_adds_teacher_forced_rows(tiny_pair):
    target, drafter = tiny_pair
    [traj] = SpeculativeEngine(target, drafter, [1]).generate([[3, 4, 5, 6]], SamplingConfig(30, 0.0, 3))
    states = [ErrorState(traj, i, 0) for i, s in enumerate(traj.steps) if s.rejected]
    t2d = target_to_draft_index(drafter.draft_to_target_ids(), target.vocab_size)
    anchors = build_replay_batch(states, t2d, 3, 0.8, 512, accepted_rows="anchors")
    full = build_replay_batch(states, t2d, 3, 0.8, 512, accepted_rows="all")
    p, n = len(traj.prompt_ids), len(traj.full_ids)
    # Depth 0: rows p-2 .. n-2 score positions p-1 .. n-2, every response token once.
    assert (full.acc_weight[0, 0] > 0).nonzero().squeeze(1).tolist() == list(range(p - 2, n - 2))
    assert int((full.acc_weight > 0).sum()) > int((anchors.acc_weight > 0).sum())
    for s in states:  # own-draft depths past the first rejection never get a teacher-forced label
        t, a = s.step.position - 2, s.step.num_accepted
        assert all(full.acc_weight[0, d, t] == 0 for d in range(a + 1, 3))
    assert torch.equal(full.rej_weight, anchors.rej_weight)
