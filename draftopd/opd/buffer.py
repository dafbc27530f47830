"""Replay buffer of verification-exposed error states, the learner's input in Draft-OPD.

Rollout workers produce trajectories whose verification steps show where the
drafter was wrong; the learner replays the drafter's own block at those places.
Rollout and learning run at different paces, so states are kept, sampled many
times and retired when the drafter that made them is too old (`max_staleness`
policy versions behind). Every removal (FIFO eviction, staleness) is counted,
so a shrinking buffer is never a mystery on the dashboard, and so is whether a
state was ever replayed: `replayed_share` is the share of recorded states the
learner saw at least once, `num_discarded_unreplayed` those that left unseen
(rollouts outpacing the learner). This is a plain class; the Ray actor that
hosts it is a thin wrapper elsewhere.
"""

from __future__ import annotations

import heapq
import random

from draftopd.messages import ErrorState, Trajectory, VerificationStep
from draftopd.schema import CHOICES, BufferConfig

SAMPLINGS = CHOICES["buffer.sampling"]
_STATE_DICT_FORMAT = 2  # 2: per-state sample counts and the replay counters; 1 still loads
_COUNTERS = (
    "num_added",
    "num_evicted",
    "num_stale_discarded",
    "num_sampled",
    "num_replayed_once",  # distinct states sampled at least once
    "num_discarded_unreplayed",  # states evicted or discarded as stale before any sampling
    "num_withdrawn",  # states whose trajectory its source no longer holds (`retain`)
)


class ReplayBuffer:
    """Error states in insertion order, with counters for everything that enters or leaves.

    Invariant: `_times_sampled` has an entry for exactly the held states that were sampled (keyed by `id`,
    stable while the buffer holds the state); `num_replayed_once` counts a state at its first sampling, and a
    state leaving without an entry counts in `num_discarded_unreplayed`.
    """

    def __init__(self, cfg: BufferConfig):
        if cfg.sampling not in SAMPLINGS:
            raise ValueError(f"unknown buffer sampling {cfg.sampling!r}; expected one of {', '.join(SAMPLINGS)}")
        if cfg.capacity < 1:
            raise ValueError(f"buffer capacity must be at least 1, got {cfg.capacity}")
        self.cfg = cfg
        self._states: list[ErrorState] = []
        self._rng = random.Random(cfg.seed)
        self._times_sampled: dict[int, int] = {}
        for name in _COUNTERS:
            setattr(self, name, 0)

    def __len__(self) -> int:
        return len(self._states)

    # -- in and out ----------------------------------------------------------

    def add(self, trajectories: list[Trajectory]) -> int:
        """Keep the error states of `trajectories`; returns how many were added (evictions aside)."""
        new = [state for traj in trajectories for state in self._error_states(traj)]
        self._states.extend(new)
        self.num_added += len(new)
        self._evict_overflow()
        return len(new)

    def prune(self, current_version: int) -> int:
        """Drop states too stale for `current_version`; returns how many."""
        keep, stale = [], []
        for s in self._states:
            (keep if current_version - s.policy_version <= self.cfg.max_staleness else stale).append(s)
        self._states = keep
        self._forget(stale)
        self.num_stale_discarded += len(stale)
        return len(stale)

    def retain(self, keep) -> int:
        """Keep only the states whose trajectory `keep(trajectory)` accepts (a source that drops or expires
        trajectories, as serving's store does, withdraws them here); returns how many left."""
        kept, gone = [], []
        for s in self._states:
            (kept if keep(s.trajectory) else gone).append(s)
        self._states = kept
        self._forget(gone)
        self.num_withdrawn += len(gone)
        return len(gone)

    def sample(self, n: int, current_version: int) -> list[ErrorState]:
        """`n` states (after pruning), without replacement when enough are held; they stay in the buffer."""
        self.prune(current_version)
        if n <= 0 or not self._states:
            return []
        weighted = self.cfg.sampling == "error_weighted"
        if len(self._states) < n:
            weights = [s.weight for s in self._states] if weighted else None
            picked = self._rng.choices(self._states, weights=weights, k=n)
        elif weighted:
            picked = self._weighted_without_replacement(n)
        else:
            picked = self._rng.sample(self._states, n)
        self._count_sampled(picked)
        return picked

    def sample_trajectories(self, n: int, current_version: int) -> list[ErrorState]:
        """The held states of `n` distinct trajectories (after pruning; all of them when fewer are held), drawn
        uniformly or, with `error_weighted` sampling, by their states' total weight. They stay in the buffer.

        The replay unit of a whole trajectory: the learner replays every verification step of each."""
        self.prune(current_version)
        groups: dict[int, list[ErrorState]] = {}
        for s in self._states:
            groups.setdefault(id(s.trajectory), []).append(s)
        held = list(groups.values())
        if n <= 0 or not held:
            return []
        if len(held) <= n:
            picked = held
        elif self.cfg.sampling == "error_weighted":
            keys = [self._rng.random() ** (1.0 / sum(s.weight for s in g)) for g in held]
            picked = [held[i] for i in heapq.nlargest(n, range(len(keys)), key=keys.__getitem__)]
        else:
            picked = self._rng.sample(held, n)
        out = [s for g in picked for s in g]
        self._count_sampled(out)
        return out

    def stats(self, current_version: int | None = None) -> dict:
        """Counters, `replayed_share` (states sampled at least once / states added), and with `current_version`
        the mean and max staleness of the held states."""
        out = {"size": len(self._states), **{name: getattr(self, name) for name in _COUNTERS}}
        out["replayed_share"] = self.num_replayed_once / self.num_added if self.num_added else 0.0
        if current_version is not None:
            ages = [current_version - s.policy_version for s in self._states]
            out["mean_staleness"] = sum(ages) / len(ages) if ages else 0.0
            out["max_staleness"] = float(max(ages)) if ages else 0.0
        return out

    # -- helpers -------------------------------------------------------------

    def _error_states(self, traj: Trajectory) -> list[ErrorState]:
        if traj.steps and traj.policy_version < 0:
            # A drafter made these steps, but which one is unknown: staleness would be meaningless.
            raise ValueError("trajectory has verification steps but policy_version < 0 (no drafter version)")
        keep = self.cfg.include_accepted_steps
        return [
            ErrorState(traj, i, policy_version=traj.policy_version, weight=self._weight(step))
            for i, step in enumerate(traj.steps)
            if keep or step.rejected
        ]

    def _weight(self, step: VerificationStep) -> float:
        if self.cfg.sampling != "error_weighted":
            return 1.0
        return float(max(1, step.num_drafted - step.num_accepted))

    def _evict_overflow(self):
        overflow = len(self._states) - self.cfg.capacity
        if overflow > 0:
            self._forget(self._states[:overflow])
            del self._states[:overflow]
            self.num_evicted += overflow

    def _count_sampled(self, picked: list[ErrorState]):
        self.num_sampled += len(picked)
        for s in picked:
            if id(s) not in self._times_sampled:
                self.num_replayed_once += 1
            self._times_sampled[id(s)] = self._times_sampled.get(id(s), 0) + 1

    def _forget(self, leaving: list[ErrorState]):
        """Bookkeeping of states that leave the buffer: their sample counts go, the unsampled ones are counted."""
        for s in leaving:
            if self._times_sampled.pop(id(s), 0) == 0:
                self.num_discarded_unreplayed += 1

    def _weighted_without_replacement(self, n: int) -> list[ErrorState]:
        # Efraimidis-Spirakis: key u^(1/w) per state, keep the n largest.
        keys = [self._rng.random() ** (1.0 / s.weight) for s in self._states]
        top = heapq.nlargest(n, range(len(keys)), key=keys.__getitem__)
        return [self._states[i] for i in top]

    # -- checkpointing -------------------------------------------------------

    def state_dict(self) -> dict:
        """Held states (with how often each was sampled), counters and RNG state as JSON-serialisable plain data;
        shared trajectories stored once."""
        index: dict[int, int] = {}
        trajectories = []
        states = []
        for s in self._states:
            if id(s.trajectory) not in index:
                index[id(s.trajectory)] = len(trajectories)
                trajectories.append(s.trajectory.to_dict())
            times = self._times_sampled.get(id(s), 0)
            states.append([index[id(s.trajectory)], s.step_index, s.policy_version, s.weight, times])
        version, internal, gauss = self._rng.getstate()
        return {
            "format": _STATE_DICT_FORMAT,
            "trajectories": trajectories,
            "states": states,
            "counters": {name: getattr(self, name) for name in _COUNTERS},
            "rng_state": [version, list(internal), gauss],
        }

    def load_state_dict(self, d: dict):
        """Restore what `state_dict` saved (also after a JSON round trip); the config stays this buffer's.

        A format-1 state (saved before sample counts were kept) loads with its held states counted as unsampled and
        the replay counters at zero, so `replayed_share` counts replays from the load on.
        """
        if d.get("format") not in (1, _STATE_DICT_FORMAT):
            raise ValueError(
                f"unsupported replay buffer state format {d.get('format')!r} (this draftopd reads formats 1 and "
                f"{_STATE_DICT_FORMAT}); it was written by a newer draftopd"
            )
        trajectories = [Trajectory.from_dict(t) for t in d["trajectories"]]
        self._states, self._times_sampled = [], {}
        for t, step_index, version, weight, *times in d["states"]:
            state = ErrorState(trajectories[t], step_index, policy_version=version, weight=weight)
            self._states.append(state)
            if times and times[0] > 0:
                self._times_sampled[id(state)] = int(times[0])
        for name in _COUNTERS:
            setattr(self, name, int(d["counters"].get(name, 0)))
        version, internal, gauss = d["rng_state"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._evict_overflow()  # a smaller capacity than the saved buffer's: counted like any eviction
