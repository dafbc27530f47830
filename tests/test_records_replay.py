"""One target pass per replayed trajectory: the rejected stream's k3 reads what verification recorded
(`target_logprobs`, `target_draft_logz`) instead of re-running the target over every rejected step's prefix,
and the learner's draft-vocabulary restrictions never widen the full vocabulary to fp32."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from draftopd.data.prompts import encode_chats
from draftopd.divergences import restrict_to_draft_vocab
from draftopd.drafters import load_drafter
from draftopd.engine.speculative import SpeculativeEngine
from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_drafter_path
from draftopd.messages import ErrorState, SamplingConfig
from draftopd.opd.replay import (
    OPDLossConfig,
    _rejected_stream,
    build_replay_batch,
    opd_loss,
    replay_forward,
    target_to_draft_index,
)
from draftopd.testing import tiny_drafter, tiny_target

K = 4
# Toy-corpus style requests (arithmetic and stdlib code); the corpus itself takes half a minute to build.
REQUESTS = [
    "What is 37 + 48?",
    "Compute 125 * 4 - 17.",
    "Write a Python function that returns the largest element of a list.",
    "What is 91 - 56?",
    "Write a function `is_even(n)` in Python.",
    "Add 308 and 499.",
    "Write a Python function that reverses a string.",
    "What is 12 * 12?",
]


@pytest.fixture(scope="module")
def toy():
    """The shipped toy target and its plateau EAGLE-3 drafter (draft vocabulary 1,024 of 2,048), toy prompts."""
    target = load_target("toy", [1, 2, 3])
    drafter = load_drafter(resolve_drafter_path("toy-plateau"), target)
    assert len(drafter.draft_to_target_ids()) < target.vocab_size
    tokenizer = load_tokenizer("toy")
    prompts = encode_chats(tokenizer, [[{"role": "user", "content": r}] for r in REQUESTS])
    return target, drafter, eos_ids(tokenizer, "toy"), prompts


def _rollouts(toy, temperature: float):
    """Eight trajectories of the native engine (K = 4, 96 tokens: the bench's default arm), as a replay batch."""
    target, drafter, eos, prompts = toy
    trajs = SpeculativeEngine(target, drafter, eos).generate(prompts, SamplingConfig(96, temperature, K, seed=3))
    t2d = target_to_draft_index(drafter.draft_to_target_ids(), target.vocab_size)
    states = [ErrorState(t, 0, 0) for t in trajs]
    return trajs, build_replay_batch(states, t2d, K, 0.8, 384, unit="trajectory")


@pytest.fixture(scope="module")
def greedy(toy):
    return _rollouts(toy, 0.0)


@pytest.fixture(scope="module", params=[0.0, 1.0], ids=["greedy", "t1"])
def toy_rollouts(toy, greedy, request):
    return greedy if request.param == 0.0 else _rollouts(toy, request.param)


def _fresh_draft_logz(target, traj, step, d2t):
    """Per draft d, logsumexp over the draft vocabulary of the target's log-probs in its context (the text up to
    the step, then drafts 0..d-1), from one plain causal pass over the text and the step's drafts."""
    ctx = torch.tensor([traj.full_ids[: step.position] + step.draft_tokens[:-1]])
    with torch.no_grad():
        logits = target.forward(ctx, torch.arange(ctx.shape[1])[None], want_aux=False).logits[0]
    at = step.position - 1 + torch.arange(len(step.draft_tokens))  # the logits that predict draft d
    return torch.log_softmax(logits[at].double(), -1)[:, d2t].logsumexp(-1).tolist()


def test_k3_from_records_equals_the_target_rerun(toy, toy_rollouts):
    """Per rejected draft, k3 against the recorded restricted target equals k3 against a fresh target pass over
    the step's prefix (the re-run path), on the toy target with its real drafter, greedy and T = 1."""
    target, drafter, _, _ = toy
    _, batch = toy_rollouts
    d2t = drafter.draft_to_target_ids()
    with torch.no_grad():
        _, d_logits = replay_forward(drafter, target, batch)
        recorded, tokens = _rejected_stream(OPDLossConfig(), target, batch, d_logits, d2t)
        rerun, rerun_tokens = _rejected_stream(OPDLossConfig(rerun_rejected_target=True), target, batch, d_logits, d2t)
    at = batch.rej_weight > 0
    # The re-run passes cover each rejected step's prefix up to its anchor, then its K - 1 first drafts.
    rejected = [s for t in toy_rollouts[0] for s in t.steps if s.rejected]
    assert rerun_tokens == sum(s.position + K - 1 for s in rejected) > 5 * int(batch.valid.sum())
    assert int(at.sum()) > 100 and tokens == 0
    assert float(rerun[at].abs().max()) > 0.1  # not a vacuous comparison of zeros
    torch.testing.assert_close(recorded[at], rerun[at], rtol=1e-4, atol=2e-5)
    assert torch.equal(recorded[~at], torch.zeros_like(recorded[~at]))


def test_recorded_draft_logz_equals_a_fresh_target_pass(toy, toy_rollouts):
    """EAGLE-3 with a draft vocabulary half the target's: the engine's `target_draft_logz` is the log of the
    target's mass on the draft vocabulary in the step's context."""
    target, drafter, _, _ = toy
    trajs, _ = toy_rollouts
    d2t = drafter.draft_to_target_ids()
    checked = 0
    for traj in sorted(trajs, key=lambda t: -len(t.steps))[:1]:
        for step in traj.steps:
            assert len(step.target_draft_logz) == K
            assert step.target_draft_logz == pytest.approx(_fresh_draft_logz(target, traj, step, d2t), abs=2e-5)
            checked += K
    assert checked >= 48
    assert min(z for t in trajs for s in t.steps for z in s.target_draft_logz) < -1e-3  # mass leaves the vocab


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "pard"])
def test_recorded_draft_logz_on_tiny_models(kind):
    """float64, so equality is tight: a partial EAGLE-3 draft vocabulary (10 of 16) records the fresh value;
    DFlash and PARD draft over the whole target vocabulary and record exactly 0.0 (the fresh value, to rounding)."""
    target = tiny_target(vocab=16)
    drafter = tiny_drafter(target, draft_vocab=10 if kind == "eagle3" else None, kind=kind)
    d2t = drafter.draft_to_target_ids()
    prompts = [[3, 4, 5], [6, 7, 8, 9, 2]]
    for temperature in (0.0, 1.0):
        trajs = SpeculativeEngine(target, drafter, [1]).generate(prompts, SamplingConfig(24, temperature, 3, seed=5))
        for traj in trajs:
            for step in traj.steps:
                fresh = _fresh_draft_logz(target, traj, step, d2t)
                assert step.target_draft_logz == pytest.approx(fresh, abs=1e-10)
                if kind != "eagle3":
                    assert step.target_draft_logz == [0.0] * len(step.draft_tokens)


def test_one_target_pass_per_replayed_trajectory(toy, greedy, monkeypatch):
    """The default loss runs the target once, over the replayed batch itself: 1.0 target tokens per replayed
    token (the metric says so, padding excluded). The re-run path, kept as an option, costs many times that."""
    target, drafter, _, _ = toy
    trajs, batch = greedy
    calls = []
    forward = target.forward

    def counting(ids, *args, **kwargs):
        calls.append(ids.clone())
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(target, "forward", counting)
    _, m = opd_loss(drafter, target, batch, OPDLossConfig())
    assert len(calls) == 1 and torch.equal(calls[0], batch.input_ids)
    assert m["target_tokens_per_token"] == 1.0 and m["loss_rejected"] > 0 and m["num_rejected_tokens"] > 100
    calls.clear()
    with torch.no_grad():
        _, rerun = opd_loss(drafter, target, batch, OPDLossConfig(rerun_rejected_target=True))
    # Each rejected step's context: its prefix up to the anchor, then its K - 1 first drafts.
    steps = [s for t in trajs for s in t.steps if s.rejected]
    want = (int(batch.valid.sum()) + sum(s.position + K - 1 for s in steps)) / int(batch.valid.sum())
    assert rerun["target_tokens_per_token"] == pytest.approx(want) and want > 5
    assert len(calls) == 1 + -(-len(steps) // 4)  # the batch, then four contexts per pass
    assert rerun["loss_rejected"] == pytest.approx(m["loss_rejected"], rel=1e-4)


def test_k3_refuses_records_without_draft_logz(toy, greedy):
    """Records made before `target_draft_logz` cannot give k3 its restricted target: a clear error, unless the
    re-run path is asked for."""
    target, drafter, _, _ = toy
    trajs, _ = greedy
    old = [ErrorState(t, 0, 0) for t in trajs[:2]]
    saved = [[s.target_draft_logz for s in t.steps] for t in trajs[:2]]
    try:
        for t in trajs[:2]:
            for s in t.steps:
                s.target_draft_logz = []
        t2d = target_to_draft_index(drafter.draft_to_target_ids(), target.vocab_size)
        batch = build_replay_batch(old, t2d, K, 0.8, 384, unit="trajectory")
        assert batch.num_unrecorded == int((batch.rej_weight > 0).sum()) > 0
        with pytest.raises(ValueError, match="rerun_rejected_target=true"):
            opd_loss(drafter, target, batch, OPDLossConfig())
        loss, m = opd_loss(drafter, target, batch, OPDLossConfig(rerun_rejected_target=True))
        assert torch.isfinite(loss) and m["target_tokens_per_token"] > 1.0
        full, _ = opd_loss(drafter, target, batch, OPDLossConfig(k3_full_vocab_target=True))  # needs no logz
        assert torch.isfinite(full)
    finally:
        for t, logz in zip(trajs[:2], saved):
            for s, z in zip(t.steps, logz):
                s.target_draft_logz = z


class _Allocations(TorchDispatchMode):
    """The bytes of every tensor an op returns, in order: what a function allocates."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.sizes.append(t.numel() * t.element_size())
        return out


def test_restrict_to_draft_vocab_never_widens_the_full_vocabulary():
    """bf16 target logits over 2,048 ids, a draft vocabulary of 512: nothing allocated is larger than the fp32
    result (today's order, widen then select, allocates a 4x larger full-vocabulary fp32 copy first)."""
    logits = torch.randn(2, 64, 2048, dtype=torch.bfloat16)
    d2t = torch.randperm(2048)[:512].sort().values
    with _Allocations() as seen:
        got = restrict_to_draft_vocab(logits, d2t)
    assert got.dtype == torch.float32 and got.shape == (2, 64, 512)
    assert max(seen.sizes) == got.numel() * 4 and sum(seen.sizes) <= 2.5 * got.numel() * 4
    torch.testing.assert_close(got, torch.log_softmax(logits.float()[..., d2t], -1))


def test_rejected_stream_takes_log_softmax_only_at_rejected_positions(toy, greedy):
    """The drafter's log-softmax is taken at the rejected-stream tokens only: no fp32 copy of the [B, D, n, Vd]
    grid of drafter logits (bf16 here, as a bf16 run's)."""
    target, drafter, _, _ = toy
    _, batch = greedy
    with torch.no_grad():
        _, d_logits = replay_forward(drafter, target, batch)
    d_logits = d_logits.bfloat16()
    with _Allocations() as seen:
        out, _ = _rejected_stream(OPDLossConfig(), target, batch, d_logits, drafter.draft_to_target_ids())
    rejected = int((batch.rej_weight > 0).sum())
    assert rejected < d_logits[..., 0].numel() / 4
    assert max(seen.sizes) <= max(rejected * d_logits.shape[-1] * 4, out.numel() * 4) < d_logits.numel() * 4


def test_session_logs_target_tokens_per_token_under_learner():
    """The learner's figure reaches MLflow as `learner/target_tokens_per_token` (opd/session.py)."""
    from test_opd_fixes import _traj

    from draftopd.config import load_config
    from draftopd.opd.session import Session
    from draftopd.testing import in_process_session

    cfg = load_config(None, ["learner.num_learners=1"])

    class Learner:
        def opd_step(self, states, depth, decay, max_len, loss_cfg, lr, unit):
            return {"loss": 1.0, "skipped_nonfinite": 0, "target_tokens_per_token": 1.0}

    s = in_process_session(cfg, Learner(), [_traj(4, [(0, 1)] * 8, k=3)])
    m = Session.opd_step(s, 0, 4)
    assert m["learner/target_tokens_per_token"] == 1.0 and "target_tokens_per_token" not in m
