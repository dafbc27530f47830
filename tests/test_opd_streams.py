"""Draft-OPD's replay unit and rejected-stream forms: whole trajectories, k3 / total variation / margin,
first-offset-only, the control without the rejected stream."""

import pytest
import torch
from conftest import random_prompts

from draftopd.config import BufferConfig
from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
from draftopd.messages import ErrorState
from draftopd.opd.buffer import ReplayBuffer
from draftopd.opd.replay import OPDLossConfig, build_replay_batch, opd_loss, replay_forward, target_to_draft_index


@pytest.fixture(scope="module")
def rollouts(tiny_pair):
    target, drafter = tiny_pair
    trajs = SpeculativeEngine(target, drafter, [1]).generate(random_prompts(4, 16, seed=8), SamplingConfig(30, 0.0, 4))
    trajs = [t for t in trajs if sum(s.rejected for s in t.steps) >= 2]
    assert len(trajs) >= 2
    return target, drafter, trajs


def _t2d(target, drafter):
    return target_to_draft_index(drafter.draft_to_target_ids(), target.vocab_size)


def test_trajectory_unit_replays_every_step_of_each_trajectory(rollouts):
    target, drafter, trajs = rollouts
    one_each = [ErrorState(t, next(i for i, s in enumerate(t.steps) if s.rejected), 0) for t in trajs]
    every = [ErrorState(t, i, 0) for t in trajs for i in range(len(t.steps))]
    whole = build_replay_batch(one_each, _t2d(target, drafter), 4, 0.8, 512, unit="trajectory")
    by_state = build_replay_batch(every, _t2d(target, drafter), 4, 0.8, 512, unit="state")
    single = build_replay_batch(one_each, _t2d(target, drafter), 4, 0.8, 512, unit="state")
    assert whole.num_steps == sum(len(t.steps) for t in trajs) == by_state.num_steps > single.num_steps
    for name in ("depth_tokens", "acc_weight", "rej_weight", "rej_target_logp", "rej_target_logp_draft"):
        assert torch.equal(getattr(whole, name), getattr(by_state, name)), name


def test_buffer_samples_whole_trajectories():
    from test_opd_fixes import _traj

    buf = ReplayBuffer(BufferConfig(capacity=100, max_staleness=4, seed=0))
    trajs = [_traj(3, [(0, 1), (1, 2), (2, 3)], k=3) for _ in range(5)]
    buf.add(trajs)
    got = buf.sample_trajectories(2, 0)
    picked = {id(s.trajectory) for s in got}
    assert len(picked) == 2 and len(got) == 2 * 3  # every held state of each picked trajectory
    assert buf.num_sampled == 6
    assert len({id(s.trajectory) for s in buf.sample_trajectories(50, 0)}) == 5  # all, when fewer are held


def test_first_offset_only_scores_the_first_rejected_draft(rollouts):
    target, drafter, trajs = rollouts
    states = [ErrorState(t, i, 0) for t in trajs for i, s in enumerate(t.steps) if s.rejected]
    batch = build_replay_batch(states, _t2d(target, drafter), 4, 0.8, 512, rejected_offsets="first")
    rows = {tid: r for r, tid in enumerate(dict.fromkeys(id(s.trajectory) for s in states))}
    for s in states:
        row, t, a = rows[id(s.trajectory)], s.step.position - 2, s.step.num_accepted
        assert [d for d in range(4) if batch.rej_weight[row, d, t] > 0] == [a]


def test_margin_and_tv_rejection_losses_by_hand(rollouts):
    """At one rejected draft: the margin is relu(m - (s[target's top] - s[draft])) in the drafter's log-probs,
    and TV is half the L1 distance to the target restricted to the draft vocabulary, in the drafted context."""
    target, drafter, trajs = rollouts
    traj = trajs[0]
    i, step = next((i, s) for i, s in enumerate(traj.steps) if s.rejected)
    batch = build_replay_batch(
        [ErrorState(traj, i, 0)], _t2d(target, drafter), 4, 0.8, 512, accepted_rows="anchors", rejected_offsets="first"
    )
    a, t = step.num_accepted, step.position - 2
    d2t = drafter.draft_to_target_ids()
    with torch.no_grad():
        _, d_logits = replay_forward(drafter, target, batch)
        s = torch.log_softmax(d_logits[0, a, t].float(), -1)
        ctx = torch.tensor([traj.full_ids[: step.position] + step.draft_tokens[:a]])
        full = target.forward(ctx, torch.arange(ctx.shape[1])[None], want_aux=False).logits[0, -1]
        p = torch.log_softmax(full[d2t].float(), -1)
    drafted = int(_t2d(target, drafter)[step.draft_tokens[a]])
    best = int(p.argmax())
    assert best != drafted  # greedy verification rejected it: the target's top token is another one
    want_margin = max(0.0, 2.0 - float(s[best] - s[drafted]))
    want_tv = 0.5 * float((p.exp() - s.exp()).abs().sum())
    weight = 0.8**a  # only this token in the rejected stream at depth a; read it from the loss via stream_means
    for kind, want in (("margin", want_margin), ("tv", want_tv)):
        cfg = OPDLossConfig(acc_coef=0.0, rejection_loss=kind, margin=2.0, rejected_offsets="first")
        cfg.accepted_rows = "anchors"
        loss, m = opd_loss(drafter, target, batch, cfg)
        assert m["loss_rejected"] == pytest.approx(want, rel=1e-4, abs=1e-6), kind
        assert loss.item() == pytest.approx(want, rel=1e-4, abs=1e-6) and m["share_rejected"] == 1.0
        assert batch.rej_weight.sum().item() == pytest.approx(weight)


def test_the_control_arm_drops_the_rejected_stream(rollouts):
    target, drafter, trajs = rollouts
    states = [ErrorState(t, i, 0) for t in trajs for i, s in enumerate(t.steps) if s.rejected]
    batch = build_replay_batch(states, _t2d(target, drafter), 4, 0.8, 512)
    with_rej, m1 = opd_loss(drafter, target, batch, OPDLossConfig(rej_coef=1.0))
    control, m0 = opd_loss(drafter, target, batch, OPDLossConfig(rej_coef=0.0))
    assert m0["share_rejected"] == 0.0 and m0["share_accepted"] == 1.0
    assert 0 < m1["share_rejected"] < 1 and m1["share_accepted"] + m1["share_rejected"] == pytest.approx(1.0)
    assert control.item() == pytest.approx(m0["loss_accepted"], rel=1e-5)
    assert with_rej.item() != pytest.approx(control.item())
    for kind in ("tv", "margin"):
        for norm in ("token_mean", "stream_means"):
            loss, m = opd_loss(drafter, target, batch, OPDLossConfig(rejection_loss=kind, normalisation=norm))
            assert torch.isfinite(loss) and m["loss_rejected"] > 0


def test_unknown_loss_settings_are_refused(rollouts):
    target, drafter, trajs = rollouts
    batch = build_replay_batch([ErrorState(trajs[0], 0, 0)], _t2d(target, drafter), 4, 0.8, 512)
    with pytest.raises(ValueError, match="rejection_loss 'kl'"):
        opd_loss(drafter, target, batch, OPDLossConfig(rejection_loss="kl"))
    with pytest.raises(ValueError, match="replay unit must be one of trajectory, state"):
        build_replay_batch([ErrorState(trajs[0], 0, 0)], _t2d(target, drafter), 4, 0.8, 512, unit="block")


def test_a_family_that_scores_rows_replays_the_weighed_rows_alone_to_the_full_grids_loss_and_gradients(
    rollouts, monkeypatch
):
    """DFlash and PARD compute only the rows the loss weighs (the prompt's carry none), and get the loss and
    gradients of the whole grid: a long prompt costs the drafter nothing the loss does not read."""
    from draftopd.opd.replay import weighed_rows

    target, drafter, _ = rollouts
    if not type(drafter).scores_rows:
        pytest.skip(f"{drafter.kind}'s chain attends to every earlier row: it scores them all")
    prompts = [[3, 5, 7, 9, 11, 13] * 3 + p for p in random_prompts(3, 16, seed=5)]  # 19-26 tokens
    trajs = SpeculativeEngine(target, drafter, [1]).generate(prompts, SamplingConfig(12, 0.0, 4))
    states = [ErrorState(t, i, 0) for t in trajs for i in range(len(t.steps))]
    batch = build_replay_batch(states, _t2d(target, drafter), 4, 0.8, 512)
    rows = weighed_rows(batch)
    assert 0 < len(rows) <= (batch.input_ids.shape[1] - 1) - 17  # the prompts' rows carry no weight
    seen = []

    def forward(*args, **kwargs):
        seen.append(kwargs.get("rows"))
        return drafter(*args, **kwargs)

    def loss_and_grads():
        drafter.zero_grad()
        loss, _ = opd_loss(drafter, target, batch, OPDLossConfig(), forward)
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads()
    assert seen[-1].shape[1] == len(rows)  # the drafter computed those rows alone
    monkeypatch.setattr(type(drafter), "scores_rows", False)
    full_loss, full_grads = loss_and_grads()
    assert seen[-1] is None  # the whole grid
    assert torch.allclose(loss, full_loss, rtol=1e-9, atol=1e-12)
    assert grads.keys() == full_grads.keys() and grads
    for k in grads:
        assert torch.allclose(grads[k], full_grads[k], rtol=1e-7, atol=1e-10), k
    drafter.zero_grad()
