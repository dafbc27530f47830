"""FleetLearner: the serving fleet's learner, Draft-OPD's learner role fed by the traffic's records.

Serving is Draft-OPD's rollout at fleet scale: every response is target-verified speculative decoding whose step
counts the router records. So the learner is `opd/`'s: the records' trajectories go into opd's `ReplayBuffer`,
each step is `DraftLearner.opd_step` (the family's Draft-OPD loss, a DeepSpeed step) on a sample of it, and a
candidate's weights come out of `DraftLearner.weights`, as in training. What is serving's own is the guard: every
`candidate_every` steps (or sooner, once they took `candidate_every_s` seconds) a snapshot is judged against the
drafter serving on a held-out slice of the traffic (every `holdout_every`-th trajectory, never trained on), and
only a promoted one is returned to the fleet, which pushes it. Operators' pushes are vetted here too, by the same
guard, so no model object is ever shared between threads: this object lives in one process (the fleet's learner
actor) and its calls run one at a time.

A step's cost does not grow with the prompt beyond what the loss needs: a trajectory keeps at most `context_tokens`
of its prompt before the response (the target re-runs over the row on every step), with its steps' positions moved
to match, and a family that `scores_rows` (DFlash, PARD) runs the drafter on the response's rows alone (opd's
`replay_forward`). The window is the family's `learner_context` unless told: 256 tokens for the drafters that read
the target's states, the serving length for PARD, which reads its own tokens alone and, trained on cut prompts,
gets worse at the whole prompts it serves (docs/serving.md). The held-out slice is cut the same way.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque

from draftopd.messages import Trajectory
from draftopd.serve.guard import judge
from draftopd.serve.learner import LearnerSettings, candidate_due


def clip_context(traj: Trajectory, keep: int) -> Trajectory:
    """`traj` with at most `keep` prompt tokens (its last ones) and its steps' positions moved to match."""
    cut = max(len(traj.prompt_ids) - keep, 0)
    if not cut:
        return traj
    steps = [dataclasses.replace(s, position=s.position - cut) for s in traj.steps]
    return dataclasses.replace(traj, prompt_ids=traj.prompt_ids[cut:], steps=steps)


class FleetLearner:
    """`spec`: opd's LearnerSpec (target, drafter, optimizer); `settings`: serving's learner knobs (batch, guard,
    context). `setup` does the heavy work (DeepSpeed, the target copy on this role's device)."""

    def __init__(self, spec, settings: LearnerSettings, eos: list[int], holdout_every: int = 5):
        self.spec, self.s, self.eos = spec, settings, list(eos)
        self.holdout_every = holdout_every
        self.role = self.buffer = self.incumbent = None
        self.held: deque = deque(maxlen=max(settings.holdout_n * 4, 64))
        self.version = 0  # the drafter version serving (the incumbent)
        self.num_added = self.num_skipped = self.steps = self.candidates = self.rejections = 0
        self.step_seconds = 0.0
        self._since_s = 0.0  # step seconds since the last candidate
        # what the steps carried: rows' tokens (the passes' length) and the loss's supervised (position, depth)
        # cells; a long prompt makes steps slower but its long response makes each carry more
        self.replayed_tokens = self.supervised = 0
        self.context = settings.context_tokens  # the prompt tokens kept (0 until setup: the family's own)

    def setup(self, version: int = 0) -> dict:
        """Build the DeepSpeed learner (world size 1) and the buffer; the incumbent is the initial drafter."""
        from draftopd.drafters import clone_drafter
        from draftopd.opd.buffer import ReplayBuffer
        from draftopd.opd.learner import DraftLearner
        from draftopd.opd.replay import opd_loss_config
        from draftopd.ports import free_port
        from draftopd.schema import BufferConfig, LearnerConfig

        port = free_port()
        self.role = DraftLearner(self.spec, 0, 1, "127.0.0.1", port)
        self.role.setup(micro_batch=self.s.batch_size)
        cap = max(self.s.batch_size * 64, 1024)
        self.buffer = ReplayBuffer(BufferConfig(capacity=cap, max_staleness=10**6, include_accepted_steps=True))
        cfg = dataclasses.replace(LearnerConfig(), **self.s.loss)
        self.loss_cfg, self.decay = opd_loss_config(cfg), cfg.decay
        self.incumbent = clone_drafter(self.role.engine.module, self.role.target).eval()
        self.version = version
        self.context = self.s.context_tokens or type(self.incumbent).learner_context
        return {"device": str(self.role.device), "pid": self.role.pid(), "context_tokens": self.context}

    def add(self, trajs: list[Trajectory]) -> dict:
        """Traffic in: every `holdout_every`-th trajectory to the held-out slice, the rest to the replay buffer."""
        for t in trajs:
            t = clip_context(t, self.context)
            self.num_added += 1
            if self.num_added % self.holdout_every == 0:
                self.held.append(t)
            else:
                self.buffer.add([t])
        return self.counters()

    def work(self, seconds: float) -> dict:
        """Learner steps for about `seconds` (at least one when the buffer allows); returns the counters and,
        when a snapshot passed the guard, `candidate` = {config, state, verdict}."""
        out: dict = {}
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds and len(self.buffer) >= self.s.min_traffic:
            out["last_step"] = self._step()
            if candidate_due(self.s, self.steps, self._since_s):
                self._since_s = 0.0
                cand = self._candidate()
                if cand is not None:
                    out["candidate"] = cand
                    break
        return {**out, **self.counters()}

    def _step(self) -> dict:
        states = self.buffer.sample(self.s.batch_size, self.version)
        t = time.monotonic()
        s = self.s
        max_len = self.context + s.response_tokens
        m = self.role.opd_step(states, s.num_draft_tokens, self.decay, max_len, self.loss_cfg, s.lr)
        dt = time.monotonic() - t
        self.step_seconds += dt
        self._since_s += dt
        self.steps += 1
        self.replayed_tokens += int(m.get("num_tokens", 0))
        self.supervised += int(m.get("num_accepted_tokens", 0)) + int(m.get("num_rejected_tokens", 0))
        return {k: float(v) for k, v in m.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}

    def _candidate(self) -> dict | None:
        held = list(self.held)[-self.s.holdout_n :]
        if len(held) < self.s.min_holdout:
            return None
        snapshot = self.role.snapshot()
        self.candidates += 1
        verdict = self._judge(snapshot, held)
        self.last_verdict = verdict.evidence()
        if not verdict.promote:
            self.rejections += 1
            return None
        return {"config": self.role.drafter_config(), "state": snapshot.state(), "verdict": verdict.evidence()}

    def _judge(self, candidate, held: list[Trajectory]):
        s = self.s
        k = s.num_draft_tokens
        target, limit = self.role.target, s.guard_max_new_tokens
        return judge(candidate, self.incumbent, target, self.eos, held, k, s.margin, s.confidence, limit)

    def vet(self, config: dict, state: dict) -> dict:
        """An operator's drafter judged against the serving one on the held-out slice (the learner's own guard)."""
        from draftopd.drafters import family

        fam = family(config.get("kind") or self.role.engine.module.kind)
        drafter = fam.from_state(fam.read_config(config), state, self.role.target).eval()
        held = list(self.held)[-self.s.holdout_n :]
        return self._judge(drafter, held).evidence()

    def served(self, config: dict, state: dict, version: int) -> None:
        """The fleet now serves `version` (a promotion, a rollback, an operator's push): the guard's incumbent. The
        learner trains on from its own weights."""
        from draftopd.drafters import family

        fam = family(config.get("kind") or self.role.engine.module.kind)
        self.incumbent = fam.from_state(fam.read_config(config), state, self.role.target).eval()
        self.version = version

    def counters(self) -> dict:
        return {
            "steps": self.steps,
            "candidates": self.candidates,
            "rejections": self.rejections,
            "added": self.num_added,
            "buffer": len(self.buffer) if self.buffer is not None else 0,
            "held_out": len(self.held),
            "step_seconds": self.step_seconds,
            "replayed_tokens": self.replayed_tokens,
            "supervised": self.supervised,
            "version": self.version,
            "context_tokens": self.context,
        }
