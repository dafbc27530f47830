"""ServeLearner: trains the drafter on the traffic it serves, beside the server, and proposes better versions.

Serving is already Draft-OPD's rollout: every request is target-assisted speculative decoding whose
verification steps are recorded. So the learner is `opd/`'s learner role, as the fleet's is: the traffic's
training slice feeds opd's `ReplayBuffer` (whole trajectories sampled uniformly; what the traffic buffer drops or
expires is withdrawn from it too), and each step is `DraftLearner.opd_step` (the family's Draft-OPD loss, the
recipe defaults of `LearnerConfig`, a DeepSpeed step of world size 1) on a copy of the serving drafter, in a
daemon thread of the server's process, over the server's torch target, one step at a time within a budget: at
most `steps_per_1k_tokens` steps per 1,000 output tokens served since it started, on `threads` torch threads.
Every `candidate_every` steps a snapshot goes to the guard against the serving drafter on the buffer's held-out
slice; a promoted snapshot is handed to `propose` (the server pushes it live and calls `set_incumbent`). Every
verdict and every error goes to `log`. The fleet runs the same role in a process of its own (fleet_learner.py).

A learner never takes serving down: an exception inside the loop is logged, counted and retried after a pause,
and `kill()` ends the thread at once from outside. Note that torch's thread count is process-wide: `threads`
sets it for the whole process (the API server's, whose engine core runs in a process of its own).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftopd.opd.replay import opd_loss_config
from draftopd.schema import LearnerConfig
from draftopd.serve.guard import Verdict, judge
from draftopd.serve.traffic import TrafficBuffer

# the rendezvous variables a learner role's process group is set up with (opd/learner.py)
RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class LearnerSettings:
    """How hard the serving learner works and when it proposes; defaults fit one CPU thread beside the toy target."""

    steps_per_1k_tokens: float = 50.0
    """Learner steps allowed per 1,000 output tokens served (the budget grows with traffic; 0: no training)."""
    batch_size: int = 8
    """Trajectories replayed per step."""
    lr: float = 5e-4
    """AdamW learning rate (betas 0.9, 0.95; gradients clipped at norm 1): the recipes' Draft-OPD rate."""
    candidate_every: int = 20
    """Guard a snapshot every this many learner steps."""
    candidate_every_s: float = 60.0
    """... or once the steps since the last candidate took this many seconds, whichever comes first: a learner
    slowed by long prompts still proposes within minutes (on short prompts the step count comes first)."""
    min_traffic: int = 16
    """Trainable trajectories (with a verification step) in the buffer before the first step."""
    min_holdout: int = 16
    """Held-out trajectories in the buffer before a snapshot is guarded (fewer: the candidate waits)."""
    holdout_n: int = 48
    """Newest held-out trajectories the guard re-decodes."""
    margin: float = 0.02
    """A candidate's tau must reach (1 + margin) x the serving drafter's."""
    confidence: float = 0.95
    """One-sided confidence of the paired tau difference's lower bound (> 0 to promote)."""
    guard_max_new_tokens: int = 256
    """The guard re-decodes each held-out request up to its recorded length or this many tokens."""
    threads: int = 1
    """torch threads (process-wide)."""
    num_draft_tokens: int = 4
    """K the guard decodes with: the server's."""
    max_seq_len: int = 384
    """Tokens kept per replayed trajectory (the one-process server's learner; the fleet's keeps `context_tokens`
    and `response_tokens`)."""
    context_tokens: int = 0
    """The fleet's learner keeps at most this many prompt tokens before a trajectory's response, its last ones (its
    step cost stays flat on long prompts); 0: the family's `learner_context` (256; PARD 2048)."""
    response_tokens: int = 512
    """... and at most this many response tokens after them."""
    poll_s: float = 0.5
    """Pause when there is no budget or traffic yet."""
    retry_s: float = 5.0
    """Pause after an error before trying again."""
    seed: int = 0
    loss: dict = field(default_factory=dict)
    """Overrides of LearnerConfig's loss fields (decay, rej_coef, rejection_loss, ...)."""


def candidate_due(settings: LearnerSettings, steps: int, seconds_since: float) -> bool:
    """Whether a snapshot is guarded after learner step `steps`, `seconds_since` seconds of stepping after the
    last candidate: every `candidate_every` steps, or sooner once those steps took `candidate_every_s`."""
    return steps % settings.candidate_every == 0 or seconds_since >= settings.candidate_every_s


class ServeLearner:
    """The learner thread. `target` is the learner's own TargetModel: it records hidden states as it runs, so no
    other thread may run it without holding `model_lock`. `log(record, step)` receives dicts with an `event` key
    (step, verdict, error, candidate_waits). `eos`: the guard's stop tokens (without them a shadow decode runs to
    the recorded length, which at T = 0 is the same text)."""

    def __init__(
        self,
        target,
        incumbent_drafter,
        traffic: TrafficBuffer,
        settings: LearnerSettings,
        propose: Callable[[object, Verdict], None],
        log: Callable[[dict, int], None],
        eos: list[int] | None = None,
        model_lock: threading.Lock | None = None,
    ):
        self.target, self.traffic, self.s = target, traffic, settings
        # held for each step and each verdict: whoever else runs the target (the server's guard of operators'
        # pushes) takes it too, so no two threads ever run the models at once
        self.model_lock = model_lock or threading.Lock()
        self.propose, self.log, self.eos = propose, log, list(eos or [])
        self._incumbent = incumbent_drafter
        self._role = None  # opd's DraftLearner over a copy of the incumbent, made in the thread (start() stays cheap)
        self._replay = None  # opd's ReplayBuffer, fed from the traffic's training slice
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._killed = self._reset = False
        self.steps = self.candidates = self.promotions = self.rejections = self.errors = 0
        self._since_s = 0.0  # step seconds since the last candidate
        self.last_error = ""
        self.last_verdict: Verdict | None = None

    # -- control, from the server's side --------------------------------------------------------------

    def start(self) -> None:
        self._mark = self.traffic.tokens_recorded
        self._thread = threading.Thread(target=self._run, name="draftopd-serve-learner", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def set_incumbent(self, drafter, reset: bool = False) -> None:
        """The drafter now serving (after a promotion or a rollback); `reset`: train on from it as well."""
        with self._lock:
            self._incumbent = drafter
            self._reset = self._reset or reset  # taken at the next step, never in the middle of one

    def stop(self, timeout: float | None = 60.0) -> None:
        """Ask the thread to finish its current step or verdict and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def kill(self) -> None:
        """End the thread now: no further step, verdict or proposal (an exception is raised inside it at its
        next Python instruction); returns without waiting."""
        self._killed = True
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(SystemExit))

    def counters(self) -> dict:
        return {
            "steps": self.steps,
            "alive": self.alive(),
            "candidates": self.candidates,
            "promotions": self.promotions,
            "rejections": self.rejections,
            "errors": self.errors,
            "last_error": self.last_error,
        }

    # -- the thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except SystemExit:  # kill(): the thread ends where it was
            pass
        finally:
            self._close_role()

    def _close_role(self) -> None:
        """Undo the role's process group and DeepSpeed's cached groups: the server's process is left as found (an
        engine restarted in it, or a later learner, would otherwise trip over a destroyed group)."""
        role, self._role = self._role, None
        if role is not None:
            with rendezvous_env_kept():
                role.close()

    def _loop(self) -> None:
        torch.set_num_threads(self.s.threads)
        torch.manual_seed(self.s.seed)
        while not self._stop.is_set():
            try:
                worked = self._tick()
            except Exception as exc:  # logged and retried: the learner must never take serving down
                self.last_error = f"{type(exc).__name__}: {exc}"
                trace = traceback.format_exc(limit=4)
                self._emit({"event": "error", "error": self.last_error, "traceback": trace})
                self.errors += 1  # after the row: a reader that sees the count finds the error logged
                self._stop.wait(self.s.retry_s)
                continue
            if not worked:
                self._stop.wait(self.s.poll_s)

    def _emit(self, record: dict) -> None:
        if self._killed:
            return
        try:
            self.log(record, self.steps)
        except Exception:  # a broken logger must not stop learning either
            pass

    def _budget(self) -> int:
        """Steps the traffic served since start() allows in all."""
        return int(self.traffic.new_tokens_since(self._mark) * self.s.steps_per_1k_tokens / 1000)

    def _tick(self) -> bool:
        """One learner step when budget and traffic allow it, then a guarded candidate when it is time."""
        if self.steps >= self._budget() or self.traffic.num_trainable() < self.s.min_traffic:
            return False
        with self._lock:
            fresh, self._reset = self._role is None or self._reset, False
        with self.model_lock:
            if fresh:
                self._start_role()
            metrics = self._step()
            self.steps += 1
            self._emit({"event": "step", **metrics})
            self._since_s += metrics.get("seconds", 0.0)
            if candidate_due(self.s, self.steps, self._since_s):
                self._since_s = 0.0
                self._candidate()
        return True

    def _start_role(self) -> None:
        """opd's learner role on this thread: a DraftLearner of world size 1 over the server's target, starting from
        the serving drafter (again after a reset), and the replay buffer it samples (made once)."""
        from draftopd.opd.buffer import ReplayBuffer
        from draftopd.opd.learner import DraftLearner, LearnerSpec
        from draftopd.ports import free_port
        from draftopd.schema import BufferConfig, DrafterConfig

        with self._lock:
            incumbent = self._incumbent
        self._close_role()  # a reset starts a new role: the old one's group goes first
        spec = LearnerSpec("", list(self.target.aux_layer_ids), "", DrafterConfig(kind=incumbent.kind))
        spec.lr, spec.num_threads, spec.seed = self.s.lr, self.s.threads, self.s.seed
        role = DraftLearner(spec, 0, 1, "127.0.0.1", free_port())
        with rendezvous_env_kept():  # the server's environment stays vLLM's (an engine restarted later inherits it)
            role.setup(micro_batch=self.s.batch_size, target=self.target, initial=incumbent)
        self._role = role
        cfg = dataclasses.replace(LearnerConfig(), **self.s.loss)
        self._loss_cfg, self._decay = opd_loss_config(cfg), cfg.decay
        if self._replay is None:
            # every step of every trajectory, never stale (serving's versions are not policy versions to retire);
            # its capacity is the traffic buffer's, which bounds it through `feed`
            size = BufferConfig(capacity=10**9, max_staleness=10**9, include_accepted_steps=True, seed=self.s.seed)
            self._replay, self._cursor, self._gone = ReplayBuffer(size), 0, -1

    def _step(self) -> dict:
        """One Draft-OPD step (opd's role) on a uniform sample of whole trajectories of the training slice."""
        self._cursor, self._gone = feed(self._replay, self.traffic, self._cursor, self._gone)
        states = self._replay.sample_trajectories(self.s.batch_size, 0)
        s, t0 = self.s, time.perf_counter()
        m = self._role.opd_step(states, s.num_draft_tokens, self._decay, s.max_seq_len, self._loss_cfg, s.lr)
        return {**_numbers(m), "seconds": time.perf_counter() - t0}

    def _candidate(self) -> None:
        """Guard a snapshot against the serving drafter; propose it when promoted."""
        held = self.traffic.holdout(self.s.holdout_n)
        if len(held) < self.s.min_holdout:
            self._emit({"event": "candidate_waits", "holdout": len(held), "min_holdout": self.s.min_holdout})
            return
        with self._lock:
            incumbent = self._incumbent
        snapshot = self._role.snapshot()
        self.candidates += 1
        k, s = self.s.num_draft_tokens, self.s
        verdict = judge(
            snapshot, incumbent, self.target, self.eos, held, k, s.margin, s.confidence, s.guard_max_new_tokens
        )
        self.last_verdict = verdict
        if self._killed:
            return
        self._emit({"event": "verdict", "candidate": self.candidates, **verdict.evidence()})
        if not verdict.promote:
            self.rejections += 1
            return
        self.propose(snapshot, verdict)
        self.promotions += 1


def feed(replay, traffic: TrafficBuffer, cursor: int, gone: int) -> tuple[int, int]:
    """The traffic's training trajectories recorded since arrival number `cursor` into opd's `replay` buffer, after
    withdrawing from it those the traffic buffer no longer holds (dropped for room or expired) when its count of
    them is no longer `gone`; returns the (cursor, gone) to call with next."""
    now_gone = traffic.num_gone()
    if now_gone != gone:
        held = {id(t) for t in traffic.training()}
        replay.retain(lambda t: id(t) in held)
    new, cursor = traffic.train_since(cursor)
    replay.add([t for t in new if t.steps])
    return cursor, now_gone


@contextlib.contextmanager
def rendezvous_env_kept():
    """Restore the process's rendezvous variables (RENDEZVOUS_ENV) as they were once the block ends."""
    before = {k: os.environ.get(k) for k in RENDEZVOUS_ENV}
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _numbers(m: dict) -> dict:
    return {k: float(v) for k, v in m.items() if isinstance(v, (int, float)) or torch.is_tensor(v) and v.numel() == 1}
