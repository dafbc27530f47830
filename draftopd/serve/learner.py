"""ServeLearner: trains the drafter on the traffic it serves, beside the server, and proposes better versions.

Serving is already Draft-OPD's rollout: every request is target-assisted speculative decoding whose
verification steps the recording hook keeps. The learner replays those trajectories with the family's Draft-OPD
loss (`opd_loss` over `build_replay_batch`, a whole trajectory per row, the recipe defaults of
`LearnerConfig`) on a private copy of the drafter, in a daemon thread of the server's process, one
optimizer step at a time within a budget: at most `steps_per_1k_tokens` steps per 1,000 output tokens served
since it started, on `threads` torch threads. Every `candidate_every` steps a snapshot goes to the guard
against the serving drafter on the buffer's held-out slice; a promoted snapshot is handed to `propose` (the
server pushes it live and calls `set_incumbent`). Every verdict and every error goes to `log`.

A learner never takes serving down: an exception inside the loop is logged, counted and retried after a pause,
and `kill()` ends the thread at once from outside. Note that torch's thread count is process-wide: `threads`
sets it for the whole process (the API server's, whose engine core runs in a process of its own).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import random
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftopd.drafters import family
from draftopd.messages import ErrorState
from draftopd.opd.replay import build_replay_batch, opd_loss, opd_loss_config, target_to_draft_index
from draftopd.schema import LearnerConfig
from draftopd.serve.guard import Verdict, judge
from draftopd.serve.traffic import TrafficBuffer


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


def clone_drafter(drafter, target):
    """An independent copy of `drafter` (its own tensors), bound to `target` as a loaded one is."""
    fam = family(drafter.kind)
    state = {k: v.detach().clone() for k, v in drafter.state().items()}
    return fam.from_state(fam.read_config(drafter.config()), state, target)


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
        self._drafter = None  # the private copy, made in the thread (start() stays cheap)
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

    def _loop(self) -> None:
        torch.set_num_threads(self.s.threads)
        torch.manual_seed(self.s.seed)
        self._rng = random.Random(self.s.seed)
        while not self._stop.is_set():
            try:
                worked = self._tick()
            except Exception as exc:  # logged and retried: the learner must never take serving down
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                trace = traceback.format_exc(limit=4)
                self._emit({"event": "error", "error": self.last_error, "traceback": trace})
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
            fresh, self._reset = self._drafter is None or self._reset, False
        with self.model_lock:
            if fresh:
                self._start_copy()
            metrics = self._step()
            self.steps += 1
            self._emit({"event": "step", **metrics})
            self._since_s += metrics.get("seconds", 0.0)
            if candidate_due(self.s, self.steps, self._since_s):
                self._since_s = 0.0
                self._candidate()
        return True

    def _start_copy(self) -> None:
        with self._lock:
            incumbent = self._incumbent
        self._drafter = clone_drafter(incumbent, self.target)
        self._loss_cfg = opd_loss_config(dataclasses.replace(LearnerConfig(), **self.s.loss))
        self._decay = self.s.loss.get("decay", LearnerConfig().decay)
        params = [p for p in self._drafter.parameters() if p.requires_grad]
        self._opt = torch.optim.AdamW(params, lr=self.s.lr, betas=(0.9, 0.95))
        self._t2d = target_to_draft_index(self._drafter.draft_to_target_ids(), self.target.vocab_size)

    def _step(self) -> dict:
        """One Draft-OPD step on a uniform sample of the training slice (whole trajectories)."""
        trajs = self.traffic.train_sample(self.s.batch_size, self._rng)
        cfg, depth = self._loss_cfg, self.s.num_draft_tokens
        states = [ErrorState(t, 0, t.policy_version) for t in trajs]
        batch = build_replay_batch(
            states,
            self._t2d,
            depth,
            self._decay,
            self.s.max_seq_len,
            accepted_rows=cfg.accepted_rows,
            unit="trajectory",
            rejected_offsets=cfg.rejected_offsets,
        )
        t0 = time.perf_counter()
        self._drafter.train()
        loss, m = opd_loss(self._drafter, self.target, batch, cfg)
        value = loss.item()
        if not math.isfinite(value):
            return {"loss": value, "skipped_nonfinite": 1}
        self._opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self._drafter.parameters(), 1.0)
        self._opt.step()
        return {"loss": value, "grad_norm": float(norm), "seconds": time.perf_counter() - t0, **_numbers(m)}

    def _candidate(self) -> None:
        """Guard a snapshot against the serving drafter; propose it when promoted."""
        held = self.traffic.holdout(self.s.holdout_n)
        if len(held) < self.s.min_holdout:
            self._emit({"event": "candidate_waits", "holdout": len(held), "min_holdout": self.s.min_holdout})
            return
        with self._lock:
            incumbent = self._incumbent
        snapshot = clone_drafter(self._drafter, self.target).eval()
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


def _numbers(m: dict) -> dict:
    return {k: float(v) for k, v in m.items() if isinstance(v, (int, float)) or torch.is_tensor(v) and v.numel() == 1}
