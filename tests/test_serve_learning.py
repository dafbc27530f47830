"""The parts of `draftopd serve` that learn from traffic: the buffer, the guard, the learner thread, the versions.

The toy target and the shipped toy drafter throughout; traffic is the native engine's greedy decoding, which
records the same fields as vLLM's recording hook. The learner is shown on a shift the shipped drafter was not
trained for: the toy prompts rendered with thinking off.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from draftopd.data.prompts import encode_chats, toy_prompts
from draftopd.drafters import clone_drafter, load_drafter
from draftopd.engine.speculative import SpeculativeEngine
from draftopd.eval.acceptance import acceptance_stats
from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_drafter_path
from draftopd.messages import SamplingConfig, Trajectory, VerificationStep
from draftopd.opd.buffer import ReplayBuffer
from draftopd.schema import BufferConfig
from draftopd.serve.guard import judge, t_quantile
from draftopd.serve.learner import LearnerSettings, ServeLearner, candidate_due, feed
from draftopd.serve.traffic import TrafficBuffer
from draftopd.serve.versions import VersionStore

K = 4


def traj(i: int, n_out: int = 3) -> Trajectory:
    """A small trajectory whose ids name it (prompt [i]); one verification step per output token after the first."""
    out = [10 + j for j in range(n_out)]
    steps = [VerificationStep(1 + j, [5], [-0.1], [-0.2], 1, [out[j]]) for j in range(1, n_out)]
    return Trajectory([i], out, steps, policy_version=0)


# -- the buffer ----------------------------------------------------------------------------------------------


def test_buffer_holds_out_every_nth_and_drops_the_oldest_first():
    buf = TrafficBuffer(capacity=10, holdout_every=5)
    buf.add([traj(i) for i in range(8)], domains=["a"] * 8)
    assert [t.prompt_ids[0] for t in buf.holdout(10)] == [4]  # the 5th trajectory
    buf.add([traj(i) for i in range(8, 23)])
    s = buf.stats()
    assert s["trajectories"] == 10 and s["added"] == 23 and s["dropped"] == 13
    held = [t.prompt_ids[0] for t in buf.holdout(10)]
    kept = held + [t.prompt_ids[0] for t in buf.training()]
    assert sorted(kept) == list(range(13, 23))  # the newest 10, in both slices together
    assert held == [14, 19] and buf.holdout(1)[0].prompt_ids == [19]
    # what the learner takes never reaches the held-out slice: the training slice since an arrival number
    new, cursor = buf.train_since(17)
    assert [t.prompt_ids[0] for t in new] == [17, 18, 20, 21, 22] and cursor == 23 and buf.num_gone() == 13
    assert buf.train_since(cursor)[0] == [] and not {t.prompt_ids[0] for t in buf.train_since(0)[0]} & set(held)
    assert buf.new_tokens_since(3 * 8) == 3 * 15


def test_the_learner_samples_opds_replay_buffer_which_holds_only_what_the_traffic_buffer_still_holds():
    """The learner's replay buffer is fed from the training slice, and what the traffic buffer drops for room or
    expires leaves it too: the retention and the capacity bound what is trained on."""
    buf = TrafficBuffer(capacity=10, holdout_every=5, retention_s=60)
    replay = ReplayBuffer(BufferConfig(capacity=10**9, max_staleness=10**9, include_accepted_steps=True))
    buf.add([traj(i) for i in range(8)] + [traj(99, 1)])  # the last has no verification step: nothing to learn
    cursor, gone = feed(replay, buf, 0, -1)
    names = lambda: sorted({s.trajectory.prompt_ids[0] for s in replay.sample_trajectories(100, 0)})  # noqa: E731
    assert names() == [0, 1, 2, 3, 5, 6, 7] and len(replay) == 14  # two steps each; 4 held out, 99 has none
    buf.add([traj(i) for i in range(10, 14)])  # 3 dropped for room (0, 1, 2); 10 is the 10th: held out
    cursor, gone = feed(replay, buf, cursor, gone)
    assert names() == [3, 5, 6, 7, 11, 12, 13] and replay.stats()["num_withdrawn"] == 6 and gone == 3
    for rec in buf._train:  # an hour old: past the retention
        if rec.trajectory.prompt_ids[0] < 10:
            rec.added_at -= 3600
    cursor, gone = feed(replay, buf, cursor, gone)
    assert names() == [11, 12, 13] and cursor == 13 and feed(replay, buf, cursor, gone) == (13, gone)


def test_buffer_is_consistent_under_concurrent_writers_and_readers():
    buf = TrafficBuffer(capacity=50, holdout_every=4)

    def write(base):
        for i in range(200):
            buf.add([traj(base + i)])

    def read():
        for _ in range(300):
            buf.train_since(0)
            buf.holdout(5)
            buf.stats()

    threads = [threading.Thread(target=write, args=(k * 1000,)) for k in range(3)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = buf.stats()
    assert s["added"] == 600 and s["trajectories"] == 50 and s["dropped"] == 550
    assert s["holdout"] + s["train"] == 50 and s["tokens_recorded"] == 600 * 3


def test_buffer_round_trip_keeps_token_ids_only_and_applies_retention(tmp_path):
    buf = TrafficBuffer(capacity=20, holdout_every=3)
    buf.add([traj(i, 2 + i % 3) for i in range(7)], domains=[f"d{i % 2}" for i in range(7)], texts=["secret"] * 7)
    buf.save(tmp_path)
    text = (tmp_path / "traffic.jsonl").read_text()
    assert "secret" not in text  # keep_text off: ids only
    back = TrafficBuffer.load(tmp_path, capacity=20, holdout_every=3)
    assert [t.to_dict() for t in back.holdout(10)] == [t.to_dict() for t in buf.holdout(10)]
    assert [t.to_dict() for t in back.training()] == [t.to_dict() for t in buf.training()]
    assert back.stats() == buf.stats()
    back.add([traj(7)])
    assert len(back.holdout(10)) == len(buf.holdout(10))  # the held-out count continues: 8th is not held out
    back.add([traj(8)])
    assert back.holdout(1)[0].prompt_ids == [8]

    kept = TrafficBuffer(capacity=20, keep_text=True)
    kept.add([traj(1)], texts=["hello"])
    kept.save(tmp_path / "k")
    assert "hello" in (tmp_path / "k" / "traffic.jsonl").read_text()
    # Retention: records older than it are dropped at load (and at every read or write).
    lines = [json.loads(x) for x in text.splitlines()]
    for x in lines[:4]:
        x["added_at"] -= 3600
    (tmp_path / "traffic.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    old = TrafficBuffer.load(tmp_path, capacity=20, holdout_every=3, retention_s=60)
    assert old.stats()["trajectories"] == 3 and old.stats()["expired"] == 4
    small = TrafficBuffer.load(tmp_path, capacity=2, holdout_every=3)
    assert small.stats()["trajectories"] == 2


# -- the toy target, its shipped drafter and traffic ----------------------------------------------------------


@pytest.fixture(scope="module")
def toy():
    torch.set_num_threads(1)
    target = load_target("toy", [1, 2, 3])
    tok = load_tokenizer("toy")
    drafter = load_drafter(resolve_drafter_path("toy"), target)
    return target, tok, eos_ids(tok, "toy"), drafter


def serve(target, drafter, eos, prompts, max_new_tokens=32, version=0):
    """Traffic as the server records it: greedy speculative decoding with the serving drafter."""
    return SpeculativeEngine(target, drafter.eval(), eos).generate(
        prompts, SamplingConfig(max_new_tokens, 0.0, K, 0), version
    )


def random_drafter(drafter, target, seed=0):
    d = clone_drafter(drafter, target)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.05)
    return d


@pytest.fixture(scope="module")
def thinking_traffic(toy):
    target, tok, eos, drafter = toy
    return serve(target, drafter, eos, encode_chats(tok, toy_prompts("held_out", 12, seed=1)))


# -- the guard -----------------------------------------------------------------------------------------------


def test_t_quantile_matches_students_table():
    for df, want in ((4, 2.132), (10, 1.812), (30, 1.697)):
        assert abs(t_quantile(0.95, df) - want) < 0.01 * want


def test_guard_refuses_random_weights_and_promotes_the_trained_drafter_over_them(toy, thinking_traffic):
    target, _, eos, drafter = toy
    rand = random_drafter(drafter, target)
    bad = judge(rand, drafter, target, eos, thinking_traffic, K)
    assert not bad.promote and bad.ratio < 0.6 and "ratio" in bad.reason, bad.reason
    assert bad.n == len(thinking_traffic) and len(bad.taus_candidate) == bad.n and bad.seconds > 0
    good = judge(drafter, rand, target, eos, thinking_traffic, K)
    assert good.promote and good.ratio > 1.5 and good.lower > 0, good.reason
    assert json.dumps(good.evidence())  # plain numbers, ready for a log line
    same = judge(clone_drafter(drafter, target), drafter, target, eos, thinking_traffic, K)
    assert not same.promote and same.ratio == 1.0  # equal drafters: no margin, no promotion


def test_guard_refuses_nonfinite_weights_and_errors(toy, thinking_traffic):
    target, _, eos, drafter = toy
    nan = clone_drafter(drafter, target)
    with torch.no_grad():
        next(p for p in nan.parameters() if p.requires_grad)[0, 0] = float("nan")
    v = judge(nan, drafter, target, eos, thinking_traffic, K)
    assert not v.promote and "non-finite" in v.reason
    broken = [Trajectory([10**6], [1, 2], [], policy_version=0)] * 10  # a token id the target does not have
    v = judge(drafter, clone_drafter(drafter, target), target, eos, broken, K)
    assert not v.promote and v.reason.startswith("error while judging"), v.reason
    v = judge(drafter, random_drafter(drafter, target), target, eos, thinking_traffic[:3], K)
    assert not v.promote and "too few" in v.reason


# -- the versions --------------------------------------------------------------------------------------------


def test_version_store_saves_loads_and_prunes(toy, tmp_path):
    target, _, _, drafter = toy
    store = VersionStore(tmp_path, keep=2)
    rand = random_drafter(drafter, target)
    for v, d in ((0, drafter), (1, rand), (2, drafter)):
        store.save(d, v, {"reason": f"v{v}"})
    assert [v for v, _ in store.list()] == [1, 2] and store.latest()[0] == 2
    assert store.previous(2)[0] == 1 and store.previous(1) is None
    assert store.evidence(1) == {"version": 1, "reason": "v1"}
    back = store.load(1, target)
    assert all(torch.equal(back.state()[k], v) for k, v in rand.state().items())


# -- the learner ---------------------------------------------------------------------------------------------


class Log:
    """The learner's log and proposals, collected (the server writes them to MLflow and pushes them)."""

    def __init__(self):
        self.rows, self.proposed = [], []

    def __call__(self, row, step):
        self.rows.append(dict(row, step=step))

    def propose(self, drafter, verdict):
        self.proposed.append((drafter, verdict))

    def events(self, name):
        return [r for r in self.rows if r["event"] == name]


def wait_for(cond, timeout):
    end = time.time() + timeout
    while not cond() and time.time() < end:
        time.sleep(0.05)
    return cond()


@pytest.fixture(scope="module")
def learner_target():
    return load_target("toy", [1, 2, 3])  # the learner's own: a target records hidden states as it runs


def test_learner_improves_tau_on_shifted_traffic_and_the_guard_promotes_it(toy, learner_target):
    target, tok, eos, drafter = toy
    shifted = encode_chats(tok, toy_prompts("train", 160, seed=2), enable_thinking=False)
    buf = TrafficBuffer(capacity=1000, holdout_every=5)
    log = Log()
    s = LearnerSettings(steps_per_1k_tokens=1e6, candidate_every=15, min_holdout=16, holdout_n=32, seed=0)
    learner = ServeLearner(learner_target, load_drafter(resolve_drafter_path("toy"), learner_target), buf, s,
                           log.propose, log, eos)  # fmt: skip
    learner.start()
    buf.add(serve(target, drafter, eos, shifted))  # the traffic arrives after start: its tokens are the budget
    try:
        assert wait_for(lambda: log.proposed or learner.steps >= 90, 150), learner.counters()
    finally:
        learner.stop()
    assert log.proposed, [r["reason"] for r in log.events("verdict")]
    candidate, verdict = log.proposed[0]
    assert verdict.promote and verdict.ratio >= 1.02 and verdict.lower > 0 and verdict.n == 32
    # Independently of the guard: tau on held-out thinking-off prompts no request of the buffer came from.
    fresh = encode_chats(tok, toy_prompts("held_out", 32, seed=3), enable_thinking=False)
    before = acceptance_stats(serve(target, drafter, eos, fresh), K)["tau"]
    after = acceptance_stats(serve(target, clone_drafter(candidate, target), eos, fresh), K)["tau"]
    print(f"thinking-off tau {before:.3f} -> {after:.3f} after {verdict_step(log)} steps; {verdict.reason}")
    assert after > 1.1 * before
    assert learner.counters()["promotions"] == 1 and not learner.alive() and learner.errors == 0
    assert _no_process_group_left()  # the role's group and DeepSpeed's cached groups went with the thread


def _no_process_group_left() -> bool:
    """No torch process group and no DeepSpeed group cached in this process: a later DeepSpeed run here starts clean."""
    from deepspeed.utils import groups

    cached = [n for n, v in vars(groups).items() if n.isupper() and n.endswith("_GROUP") and v]
    return not torch.distributed.is_initialized() and not cached


def test_an_operators_verdict_taken_while_the_learner_steps_is_the_one_it_gets_alone(toy, learner_target):
    """The one-process server has one torch target, the learner's, and it records hidden states as it runs: the
    guard of an operator's push takes the learner's model lock (as ServeSession._vet does), so its verdict taken
    while the learner steps is the one it gets with the learner stopped."""
    target, tok, eos, drafter = toy
    traffic = serve(target, drafter, eos, encode_chats(tok, toy_prompts("held_out", 32, seed=4), enable_thinking=False))
    buf = TrafficBuffer(capacity=1000, holdout_every=2)
    buf.add(traffic)
    held = buf.holdout(16)
    incumbent = load_drafter(resolve_drafter_path("toy"), learner_target)
    operators = random_drafter(incumbent, learner_target, seed=3)
    with torch.no_grad():  # near the incumbent: a verdict with acceptance on both sides
        for p, q in zip(operators.parameters(), incumbent.parameters()):
            p.copy_(q + 0.05 * (p - q))

    def vet():
        v = judge(operators, incumbent, learner_target, eos, held, K, 0.02, 0.95, 64).evidence()
        return {k: x for k, x in v.items() if k != "seconds"}

    alone = vet()
    s = LearnerSettings(steps_per_1k_tokens=1e6, min_traffic=4, candidate_every=10**6, poll_s=0.05)
    learner = ServeLearner(learner_target, incumbent, buf, s, Log().propose, Log(), eos)
    learner.start()
    buf.add(traffic)  # served after start: the learner's budget
    try:
        assert wait_for(lambda: learner.steps >= 1, 60), learner.counters()
        verdicts = []
        for _ in range(3):
            with learner.model_lock:
                verdicts.append(vet())
                mark = learner.steps
            assert wait_for(lambda m=mark: learner.steps > m, 60)  # the learner steps between the verdicts
    finally:
        learner.stop()
    assert learner.errors == 0 and alone["n"] == 16 and alone["tau_incumbent"] > 1.0
    assert verdicts == [alone] * 3


def verdict_step(log):
    return next(r["step"] for r in log.events("verdict") if r["promote"])


def test_learner_keeps_within_its_token_budget(toy, learner_target, thinking_traffic):
    _, _, eos, _ = toy
    buf = TrafficBuffer(capacity=100, holdout_every=50)
    buf.add(thinking_traffic)  # recorded before start: no budget
    s = LearnerSettings(steps_per_1k_tokens=10, min_traffic=4, candidate_every=1000, poll_s=0.05)
    log = Log()
    learner = ServeLearner(learner_target, load_drafter(resolve_drafter_path("toy"), learner_target), buf, s,
                           log.propose, log, eos)  # fmt: skip
    learner.start()
    try:
        time.sleep(0.5)
        assert learner.steps == 0
        buf.add(thinking_traffic[:8])
        tokens = sum(len(t.output_ids) for t in thinking_traffic[:8])
        allowed = tokens * 10 // 1000
        assert allowed >= 2
        assert wait_for(lambda: learner.steps >= allowed, 60)
        time.sleep(0.5)
        assert learner.steps == allowed and [r["step"] for r in log.events("step")] == list(range(1, allowed + 1))
        assert all(r["loss"] > 0 for r in log.events("step"))
    finally:
        learner.stop()


def test_a_slow_learner_guards_a_snapshot_by_step_seconds_before_the_step_count():
    s = LearnerSettings(candidate_every=20, candidate_every_s=60.0)
    assert [n for n in range(1, 41) if candidate_due(s, n, 1.0)] == [20, 40]  # fast steps: the count decides
    assert candidate_due(s, 5, 60.0) and not candidate_due(s, 5, 59.9)  # slow ones: the seconds do


def test_a_learner_tries_a_candidate_after_each_step_once_its_seconds_are_spent(toy, learner_target, thinking_traffic):
    _, _, eos, _ = toy
    buf = TrafficBuffer(capacity=100, holdout_every=50)
    s = LearnerSettings(steps_per_1k_tokens=1e6, min_traffic=4, candidate_every=1000, candidate_every_s=0.0,
                        min_holdout=10**6, poll_s=0.05)  # fmt: skip
    log = Log()
    learner = ServeLearner(learner_target, load_drafter(resolve_drafter_path("toy"), learner_target), buf, s,
                           log.propose, log, eos)  # fmt: skip
    learner.start()
    buf.add(thinking_traffic[:8])
    try:
        assert wait_for(lambda: learner.steps >= 3, 60)
    finally:
        learner.stop()
    waits = [r["step"] for r in log.events("candidate_waits")]
    assert waits[:3] == [1, 2, 3], log.rows  # due after every step although the count (1000) is far


def test_a_failing_learner_logs_retries_and_keeps_running(toy, learner_target):
    _, _, eos, drafter = toy
    buf = TrafficBuffer(capacity=100)
    s = LearnerSettings(steps_per_1k_tokens=1e6, min_traffic=2, retry_s=0.05)
    log = Log()
    learner = ServeLearner(learner_target, drafter, buf, s, log.propose, log, eos)
    learner.start()
    bad = Trajectory([3, 4], [10**6, 5, 6], [VerificationStep(3, [5], [-1.0], [-1.0], 1, [5, 6])], policy_version=0)
    buf.add([bad] * 6)  # token ids the target does not have: every step raises
    try:
        assert wait_for(lambda: learner.errors >= 3, 30), learner.counters()
        assert learner.alive() and learner.steps == 0
        errors = log.events("error")
        assert len(errors) >= 3 and "IndexError" in errors[0]["error"] and learner.last_error
    finally:
        learner.stop()
    assert not learner.alive()


def test_killing_the_learner_leaves_the_caller_and_the_serving_drafter_alone(toy, learner_target, thinking_traffic):
    target, tok, eos, drafter = toy
    served = load_drafter(resolve_drafter_path("toy"), learner_target)
    before = {k: v.clone() for k, v in served.state().items()}
    buf = TrafficBuffer(capacity=100, holdout_every=50)
    s = LearnerSettings(steps_per_1k_tokens=1e6, min_traffic=4, candidate_every=1000)
    log = Log()
    learner = ServeLearner(learner_target, served, buf, s, log.propose, log, eos)
    learner.start()
    buf.add(thinking_traffic)
    assert wait_for(lambda: learner.steps >= 1, 60)
    learner.kill()
    learner._thread.join(10)
    assert not learner.alive() and _no_process_group_left()
    n = len(log.rows)
    time.sleep(0.3)
    assert len(log.rows) == n  # nothing after the kill
    assert all(torch.equal(before[k], v) for k, v in served.state().items())  # it trained a copy
    again = serve(target, drafter, eos, [t.prompt_ids for t in thinking_traffic[:2]])  # serving goes on
    assert [t.output_ids for t in again] == [t.output_ids for t in thinking_traffic[:2]]
