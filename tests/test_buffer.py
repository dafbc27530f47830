"""The replay buffer keeps rejected steps, counts every removal, samples as configured and resumes exactly."""

import json

import pytest

from draftopd.messages import Trajectory, VerificationStep
from draftopd.opd.buffer import BufferConfig, ReplayBuffer


def make_traj(accepted: list[int], k: int = 4, version: int = 0, prompt_index: int = 0) -> Trajectory:
    """A consistent trajectory whose step i accepted `accepted[i]` of `k` drafts."""
    prompt, output, steps = [1, 2, 3], [5], []
    for a in accepted:
        drafts = [10 + j for j in range(k)]
        emitted = drafts[:a] + [9]
        steps.append(VerificationStep(len(prompt) + len(output), drafts, [-0.5] * k, [-1.0] * k, a, emitted))
        output.extend(emitted)
    return Trajectory(prompt, output, steps, policy_version=version, num_draft_tokens=k, prompt_index=prompt_index)


def key(state) -> tuple[int, int]:
    return state.trajectory.prompt_index, state.step_index


def held(buf: ReplayBuffer) -> list[tuple[int, int]]:
    return [key(s) for s in buf.sample(len(buf), current_version=0)] if len(buf) else []


def test_rejected_steps_become_error_states():
    buf = ReplayBuffer(BufferConfig(sampling="error_weighted"))
    traj = make_traj([4, 1, 0, 4], version=3)
    assert buf.add([traj]) == 2
    states = buf.sample(2, current_version=3)
    assert sorted(s.step_index for s in states) == [1, 2]
    assert all(s.trajectory is traj and s.policy_version == 3 for s in states)
    assert {s.step_index: s.weight for s in states} == {1: 3.0, 2: 4.0}
    assert states[0].step.rejected


def test_accepted_steps_kept_with_the_option():
    buf = ReplayBuffer(BufferConfig(sampling="error_weighted", include_accepted_steps=True))
    assert buf.add([make_traj([4, 1, 0, 4])]) == 4
    weights = {s.step_index: s.weight for s in buf.sample(4, current_version=0)}
    assert weights == {0: 1.0, 1: 3.0, 2: 4.0, 3: 1.0}


def test_uniform_weights_are_one():
    buf = ReplayBuffer(BufferConfig())
    buf.add([make_traj([0, 2])])
    assert [s.weight for s in buf.sample(2, current_version=0)] == [1.0, 1.0]


def test_target_only_trajectory_adds_nothing():
    buf = ReplayBuffer(BufferConfig(include_accepted_steps=True))
    assert buf.add([Trajectory([1, 2], [3, 4, 5], policy_version=-1)]) == 0
    assert len(buf) == 0 and buf.stats()["num_added"] == 0


def test_steps_without_a_policy_version_raise():
    with pytest.raises(ValueError, match="policy_version"):
        ReplayBuffer(BufferConfig()).add([make_traj([0], version=-1)])


def test_fifo_eviction_is_counted():
    buf = ReplayBuffer(BufferConfig(capacity=3))
    buf.add([make_traj([0, 0], prompt_index=0)])
    buf.add([make_traj([0, 0, 0], prompt_index=1)])
    assert len(buf) == 3
    assert sorted(held(buf)) == [(1, 0), (1, 1), (1, 2)]
    assert buf.add([make_traj([1], prompt_index=2)]) == 1
    assert sorted(held(buf)) == [(1, 1), (1, 2), (2, 0)]
    assert buf.stats() == {
        "size": 3,
        "num_added": 6,
        "num_evicted": 3,
        "num_stale_discarded": 0,
        "num_sampled": 6,
        "num_replayed_once": 4,  # (1, 0..2) in the first look, (2, 0) in the second
        "num_discarded_unreplayed": 2,  # (0, 0) and (0, 1), evicted before anyone looked
        "num_withdrawn": 0,
        "replayed_share": 4 / 6,
    }


def test_one_add_larger_than_capacity_keeps_the_newest():
    buf = ReplayBuffer(BufferConfig(capacity=2))
    assert buf.add([make_traj([0] * 5)]) == 5
    assert sorted(held(buf)) == [(0, 3), (0, 4)]
    assert buf.stats()["num_evicted"] == 3


def test_prune_drops_and_counts_stale_states():
    buf = ReplayBuffer(BufferConfig(max_staleness=1))
    buf.add([make_traj([0], version=v, prompt_index=v) for v in (0, 1, 2)])
    assert buf.prune(current_version=2) == 1  # 2 > 0 + 1; version 1 is exactly at the limit and stays
    assert sorted(s.policy_version for s in buf.sample(2, current_version=2)) == [1, 2]
    assert buf.prune(current_version=3) == 1
    assert len(buf) == 1 and buf.stats()["num_stale_discarded"] == 2


def test_sample_prunes_first():
    buf = ReplayBuffer(BufferConfig(max_staleness=2))
    buf.add([make_traj([0, 1], version=0)])
    assert buf.sample(4, current_version=3) == []
    stats = buf.stats()
    assert stats["size"] == 0 and stats["num_stale_discarded"] == 2 and stats["num_sampled"] == 0


def test_stats_staleness():
    buf = ReplayBuffer(BufferConfig(max_staleness=10))
    assert buf.stats(current_version=5)["mean_staleness"] == 0.0
    assert "mean_staleness" not in buf.stats()
    buf.add([make_traj([0], version=v) for v in (0, 1, 3)])
    stats = buf.stats(current_version=4)
    assert stats["mean_staleness"] == pytest.approx(8 / 3) and stats["max_staleness"] == 4.0


def test_sample_does_not_remove():
    buf = ReplayBuffer(BufferConfig())
    buf.add([make_traj([0, 1, 2])])
    first = buf.sample(3, current_version=0)
    second = buf.sample(3, current_version=0)
    assert len(buf) == 3
    assert sorted(map(key, first)) == sorted(map(key, second)) == [(0, 0), (0, 1), (0, 2)]
    assert buf.stats()["num_sampled"] == 6


def test_empty_buffer_samples_nothing():
    assert ReplayBuffer(BufferConfig()).sample(8, current_version=0) == []


def test_uniform_sampling_covers_all():
    buf = ReplayBuffer(BufferConfig(seed=1))
    buf.add([make_traj([0] * 10)])
    assert sorted(s.step_index for s in buf.sample(10, current_version=0)) == list(range(10))
    small = ReplayBuffer(BufferConfig(seed=1))
    small.add([make_traj([0, 1, 2])])
    drawn = small.sample(60, current_version=0)  # more than held: with replacement
    assert len(drawn) == 60 and {s.step_index for s in drawn} == {0, 1, 2}


def _heavy_fraction(sampling: str, n: int, draws: int) -> float:
    """Steps alternate light (1 rejected draft, weight 1) and heavy (4 rejected, weight 4)."""
    buf = ReplayBuffer(BufferConfig(sampling=sampling, seed=0))
    buf.add([make_traj([3, 0] * 10)])
    picked = [s for _ in range(draws) for s in buf.sample(n, current_version=0)]
    return sum(s.step.num_accepted == 0 for s in picked) / len(picked)


def test_error_weighted_sampling_prefers_heavier_states():
    # Without replacement (5 of 20): about 0.75 heavy when weighted, 0.5 when uniform.
    assert _heavy_fraction("error_weighted", n=5, draws=200) > 0.68
    assert 0.44 < _heavy_fraction("uniform", n=5, draws=200) < 0.56
    # With replacement (40 from 20): 0.8 heavy when weighted.
    assert 0.76 < _heavy_fraction("error_weighted", n=40, draws=50) < 0.84
    assert 0.44 < _heavy_fraction("uniform", n=40, draws=50) < 0.56


@pytest.mark.parametrize("sampling", ["uniform", "error_weighted"])
def test_state_dict_round_trip_reproduces_the_next_samples(sampling):
    cfg = BufferConfig(capacity=12, sampling=sampling, max_staleness=3, seed=7)
    buf = ReplayBuffer(cfg)
    buf.add([make_traj([0, 1, 3, 2, 4], version=v, prompt_index=v) for v in range(4)])
    buf.sample(5, current_version=3)
    saved = json.loads(json.dumps(buf.state_dict()))
    assert len(saved["trajectories"]) == 3  # shared trajectories stored once (one was evicted whole)

    loaded = ReplayBuffer(cfg)
    loaded.load_state_dict(saved)
    # Control: the same states with the RNG of a fresh buffer draw differently, so the RNG state is what matters.
    fresh_rng = ReplayBuffer(cfg)
    fresh_rng.load_state_dict({**saved, "rng_state": ReplayBuffer(cfg).state_dict()["rng_state"]})
    control = fresh_rng.sample(5, current_version=3)
    assert loaded.stats(current_version=4) == buf.stats(current_version=4)
    for n, version in [(5, 3), (30, 4), (2, 5)]:  # without and with replacement, then after pruning
        expected = buf.sample(n, current_version=version)
        got = loaded.sample(n, current_version=version)
        assert [key(s) for s in got] == [key(s) for s in expected]
        assert [s.trajectory.to_dict() for s in got] == [s.trajectory.to_dict() for s in expected]
        assert [(s.policy_version, s.weight) for s in got] == [(s.policy_version, s.weight) for s in expected]
        if n == 5:
            assert [key(s) for s in control] != [key(s) for s in expected]
    assert loaded.stats() == buf.stats()


def test_bad_sampling_name_raises():
    with pytest.raises(ValueError, match="uniform, error_weighted"):
        ReplayBuffer(BufferConfig(sampling="weighted"))


def test_replayed_share_counts_each_state_once():
    buf = ReplayBuffer(BufferConfig(seed=11))
    buf.add([make_traj([0] * 10)])
    first = {key(s) for s in buf.sample(3, current_version=0)}
    second = {key(s) for s in buf.sample(3, current_version=0)}
    stats = buf.stats()
    assert stats["num_sampled"] == 6
    assert stats["num_replayed_once"] == len(first | second) < 6  # seed 11 draws two states twice
    assert stats["replayed_share"] == len(first | second) / 10
    buf.sample(40, current_version=0)  # with replacement, every state many times: each still counts once
    assert buf.stats()["num_replayed_once"] == 10 and buf.stats()["replayed_share"] == 1.0
    assert ReplayBuffer(BufferConfig()).stats()["replayed_share"] == 0.0


def test_whole_trajectory_draws_count_as_replays():
    buf = ReplayBuffer(BufferConfig(seed=0))
    buf.add([make_traj([0, 1, 2], prompt_index=i) for i in range(4)])
    drawn = buf.sample_trajectories(2, current_version=0)
    assert len({id(s.trajectory) for s in drawn}) == 2 and len(drawn) == 6
    assert buf.stats()["num_replayed_once"] == 6 and buf.stats()["replayed_share"] == 6 / 12
    buf.sample_trajectories(4, current_version=0)  # all four: two are new
    assert buf.stats()["num_replayed_once"] == 12 and buf.stats()["num_sampled"] == 18


def test_states_leaving_unsampled_are_counted():
    buf = ReplayBuffer(BufferConfig(capacity=4, max_staleness=1))
    buf.add([make_traj([0, 0], version=0, prompt_index=0)])
    assert {key(s) for s in buf.sample(2, current_version=0)} == {(0, 0), (0, 1)}
    buf.add([make_traj([0, 0], version=0, prompt_index=1)])  # held: (0, 0) (0, 1) sampled, (1, 0) (1, 1) not
    buf.add([make_traj([0], version=1, prompt_index=2)])  # evicts (0, 0): it was sampled
    assert buf.stats()["num_discarded_unreplayed"] == 0
    buf.add([make_traj([0], version=1, prompt_index=3)])  # evicts (0, 1): sampled too
    assert buf.stats()["num_discarded_unreplayed"] == 0
    assert buf.prune(current_version=2) == 2  # (1, 0) and (1, 1): stale, never sampled
    stats = buf.stats()
    assert stats["num_discarded_unreplayed"] == 2 and stats["num_replayed_once"] == 2
    assert stats["num_evicted"] + stats["num_stale_discarded"] == 4


def test_sample_counts_survive_a_checkpoint():
    cfg = BufferConfig(capacity=3, seed=5)
    buf = ReplayBuffer(cfg)
    buf.add([make_traj([0, 0, 0])])
    buf.sample(2, current_version=0)
    saved = json.loads(json.dumps(buf.state_dict()))
    assert saved["format"] == 2
    assert sorted(row[4] for row in saved["states"]) == [0, 1, 1]
    loaded = ReplayBuffer(cfg)
    loaded.load_state_dict(saved)
    loaded.sample(3, current_version=0)  # all three: only the one not sampled before is new
    assert loaded.stats()["num_replayed_once"] == 3
    loaded.add([make_traj([0], prompt_index=1)])  # evicts (0, 0), sampled before the checkpoint or after it
    assert loaded.stats()["num_discarded_unreplayed"] == 0
    unsampled = ReplayBuffer(cfg)
    unsampled.load_state_dict(saved)
    unsampled.add([make_traj([0, 0, 0], prompt_index=1)])  # evicts all three: one was never sampled
    assert unsampled.stats()["num_discarded_unreplayed"] == 1


def test_format_1_states_load_and_newer_formats_are_refused():
    buf = ReplayBuffer(BufferConfig())
    buf.add([make_traj([0, 1])])
    buf.sample(2, current_version=0)
    saved = buf.state_dict()
    old = {
        **saved,
        "format": 1,
        "states": [row[:4] for row in saved["states"]],
        "counters": {
            k: saved["counters"][k] for k in ("num_added", "num_evicted", "num_stale_discarded", "num_sampled")
        },
    }
    loaded = ReplayBuffer(BufferConfig())
    loaded.load_state_dict(old)
    assert len(loaded) == 2 and loaded.stats()["num_sampled"] == 2
    assert loaded.stats()["num_replayed_once"] == 0  # unknown before the load: replays count from here
    loaded.sample(2, current_version=0)
    assert loaded.stats()["num_replayed_once"] == 2
    with pytest.raises(ValueError, match="format 3 .*newer draftopd"):
        ReplayBuffer(BufferConfig()).load_state_dict({**saved, "format": 3})
