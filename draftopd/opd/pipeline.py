"""The rollout workers' side of the Draft-OPD loop: every decode the driver asks of them, and the rounds it lets
run ahead of the learner.

With `opd.max_policy_lag` L, rollout round q may decode once the learner has learned from the rounds before q - L:
L = 0 is the synchronous loop (a round decodes, then the learner learns from it, then the next round decodes);
L = 1 decodes round r + 1 while the learner learns from rounds up to r, with the drafter published before that
learner phase. One round is in flight at a time: a larger lag would only queue more rounds on the same workers.
A lag moves only where the anchors fall and which version's mistakes are replayed: a rollout is lossless whatever
drafter decoded it.

This is the one place that waits on the workers. While a round is in flight a worker is busy, so a weight sync or
a held-out evaluation the loop asks for then is done when the round comes back, before the next one starts: the
workers stop for the push alone, and nothing waits for an evaluation (its row is logged when it is read).
With nothing in flight (always, at L = 0) both happen at once, as in the synchronous loop.

Per round it also reports what the overlap is for: the share of the interval since the previous round came back in
which the rollout workers and the learner ranks were idle, and the policy lag of the round's trajectories (the
learner's version when it starts learning from them, less the version that decoded them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tqdm import tqdm

from draftopd.eval.acceptance import acceptance_stats
from draftopd.messages import SamplingConfig
from draftopd.opd.weight_sync import StaleWeights


@dataclass
class Decode:
    """One decode on the workers: chunks of one engine batch each, dealt round-robin, and their refs."""

    prompts: list
    indices: list
    sampling: SamplingConfig
    with_drafter: bool
    chunks: list = field(default_factory=list)  # (worker, first prompt) per chunk
    refs: list = field(default_factory=list)
    version: int = -1  # the policy version it was sent with


class RolloutPipeline:
    def __init__(self, s, max_policy_lag: int = 0):
        self.s, self.lag = s, max_policy_lag
        self.rounds: dict[int, Decode] = {}  # rounds in flight, by index
        self.evals: list[Decode] = []  # held-out evaluations in flight
        self.due_sync = self.due_eval = False
        self.spans: list = []  # refs to the workers' busy spans (wall-clock start, end)
        self.begin()

    def begin(self) -> None:
        """Account from now on (the Draft-OPD phase's start): busy seconds and intervals start here."""
        self.started = self.mark = time.time()  # mark: the end of the last interval accounted for
        self.learner_mark = self.s.learner_seconds
        self.rollout_busy = self.learner_busy = 0.0
        self.busy: list[tuple[float, float]] = []  # spans read back

    # -- decoding --------------------------------------------------------------------------------

    def submit(self, prompts, indices, sampling: SamplingConfig, with_drafter: bool) -> Decode:
        s, bs = self.s, self.s.cfg.rollout.batch_size
        d = Decode(prompts, indices, sampling, with_drafter, version=s.state.policy_version if with_drafter else -1)
        n = len(s.workers)
        d.chunks = [(s.workers[j % n], i) for j, i in enumerate(range(0, len(prompts), bs))]
        d.refs = [self._send(d, k) for k in range(len(d.chunks))]
        self.spans += [w.take_spans.remote() for w in {id(w): w for w, _ in d.chunks}.values()]
        return d

    def _send(self, d: Decode, k: int):
        worker, i = d.chunks[k]
        bs = self.s.cfg.rollout.batch_size
        update = self.s.update if d.with_drafter else None
        return worker.generate.remote(d.prompts[i : i + bs], d.indices[i : i + bs], d.sampling, update, bs)

    def wait(self, d: Decode, desc: str = "") -> list:
        """The refs of `d`'s finished chunks. A chunk refused by a worker that missed a collective broadcast (it
        was restarted) runs again after a new publish; one killed mid-call was already retried by Ray on the
        restarted worker."""
        rt, bs = self.s.rt, self.s.cfg.rollout.batch_size
        slot = {ref: k for k, ref in enumerate(d.refs)}
        pending = list(d.refs)
        with tqdm(total=len(d.prompts), desc=desc, unit="prompt", disable=not desc, leave=False) as bar:
            while pending:
                [ref], pending = rt.wait(pending, num_returns=1)
                k = slot[ref]
                try:
                    rt.get(ref)
                except StaleWeights:
                    self.s.sync()
                    d.refs[k] = self._send(d, k)
                    slot[d.refs[k]] = k
                    pending.append(d.refs[k])
                    continue
                bar.update(min(bs, len(d.prompts) - d.chunks[k][1]))
        return d.refs

    def decode(self, prompts, indices, sampling: SamplingConfig, with_drafter: bool, desc: str = "") -> list:
        """Decode now and wait (target responses, synchronous evaluations): the refs of the finished chunks."""
        return self.wait(self.submit(prompts, indices, sampling, with_drafter), desc)

    def submit_eval(self) -> Decode:
        """The held-out evaluation of the drafter the workers are to hold, sent."""
        s = self.s
        return self.submit(s.eval_prompts, list(range(len(s.eval_prompts))), s.eval_sampling(), True)

    # -- rounds ----------------------------------------------------------------------------------

    def _start(self, q: int) -> None:
        s, r = self.s, self.s.cfg.rollout
        n = len(s.train_prompts)
        idx = [(q * r.prompts_per_round + i) % n for i in range(r.prompts_per_round)]
        sampling = SamplingConfig(r.max_new_tokens, r.temperature, r.num_draft_tokens, s.cfg.run.seed + q)
        self.rounds[q] = self.submit([s.train_prompts[i] for i in idx], idx, sampling, True)

    def collect(self, q: int) -> dict:
        """Round q in the buffer (decoded now if it is not in flight); then the sync and evaluation asked for
        meanwhile, and the rounds the lag allows, started. Returns round q's rollout metrics ({} if a drain had
        collected it already)."""
        s = self.s
        metrics = {}
        if q >= s.state.rounds_decoded:
            if q not in self.rounds:
                self._start(q)
            metrics = self._finish(q)
        self._catch_up(q)
        return metrics

    def _finish(self, q: int) -> dict:
        s, k = self.s, self.s.cfg.rollout.num_draft_tokens
        d = self.rounds.pop(q)
        refs = self.wait(d)
        added = s.rt.get([s.buffer.add.remote(ref) for ref in refs])
        s.state.rounds_decoded = q + 1
        trajs = [t for chunk in s.rt.get(refs) for t in chunk]  # small: token lists and step records
        stats = acceptance_stats(trajs, k)
        lags = [s.state.policy_version - t.policy_version for t in trajs if t.policy_version >= 0]
        metrics = {
            "rollout/tau": stats["tau"],
            **{f"rollout/accept_pos_{i}": a for i, a in enumerate(stats.get("acceptance_per_position", []))},
            "rollout/error_states_added": float(sum(added)),
            "rollout/policy_lag_mean": sum(lags) / len(lags) if lags else 0.0,
            "rollout/policy_lag_max": float(max(lags, default=0)),
        }
        decode_s = self._account(metrics)
        tokens = sum(len(t.output_ids) for t in trajs)
        metrics["rollout/tokens_per_s"] = tokens / decode_s if decode_s > 0 else 0.0
        return metrics

    def _account(self, metrics: dict) -> float:
        """The idle shares of both roles over the interval since the last round came back, into `metrics`;
        returns the workers' busy seconds in it (per worker)."""
        s, rt = self.s, self.s.rt
        ready, self.spans = rt.wait(self.spans, num_returns=len(self.spans), timeout=0) if self.spans else ([], [])
        for spans in rt.get(ready):
            self.busy += spans
        now, n = time.time(), max(1, len(s.workers))
        wall = now - self.mark
        rollout = sum(max(0.0, min(b, now) - max(a, self.mark)) for a, b in self.busy) / n
        learner = s.learner_seconds - self.learner_mark
        self.busy = [(a, b) for a, b in self.busy if b > now]  # spans still running on into the next interval
        self.mark, self.learner_mark = now, s.learner_seconds
        self.rollout_busy, self.learner_busy = self.rollout_busy + rollout, self.learner_busy + learner
        if wall > 0:
            metrics["pipeline/rollout_idle_share"] = max(0.0, 1.0 - rollout / wall)
            metrics["pipeline/learner_idle_share"] = max(0.0, 1.0 - learner / wall)
            metrics["pipeline/interval_s"] = wall
        return rollout

    def _catch_up(self, q: int) -> None:
        """With nothing in flight: the sync and evaluation asked for meanwhile, then round q + 1 if the lag lets it
        decode before the learner has learned from round q."""
        if self.rounds:
            return
        self._do_due()
        nxt = q + 1
        if self.lag and nxt < self.s.cfg.opd.num_rounds and nxt >= self.s.state.rounds_decoded:
            self._start(nxt)

    def _do_due(self) -> None:
        if self.due_sync:
            self.s.sync()
            self.due_sync = False
        if self.due_eval:
            self.evals.append(self.submit_eval())
            self.due_eval = False

    # -- what the loop asks for between learner steps -------------------------------------------

    def sync(self) -> float | None:
        """Publish now (returns the seconds), or, with a round in flight, when it comes back (returns None)."""
        if self.rounds:
            self.due_sync = True
            return None
        return self.s.sync()

    def evaluate(self) -> dict:
        """The held-out evaluation now (its metrics), or, with a round in flight, sent after it (read later)."""
        if self.rounds:
            self.due_eval = True
            return {}
        return self.s.evaluate()

    def finished_evals(self, block: bool = False) -> list[tuple[int, dict]]:
        """(policy version, metrics) of the evaluations sent earlier that have finished (all of them if `block`)."""
        out, left = [], []
        for d in self.evals:
            ready, _ = self.s.rt.wait(d.refs, num_returns=len(d.refs), timeout=None if block else 0)
            if len(ready) < len(d.refs):
                left.append(d)
                continue
            out.append((d.version, self.s.eval_metrics(self.s.rt.get(self.wait(d)))))
        self.evals = left
        return out

    def summary(self) -> dict:
        """Since `begin`: the wall-clock and each role's busy seconds (per rollout worker; the learner ranks')."""
        self._account({})
        return {
            "pipeline/phase_s": time.time() - self.started,
            "pipeline/rollout_busy_s": self.rollout_busy,
            "pipeline/learner_busy_s": self.learner_busy,
        }

    def drain(self) -> list[dict]:
        """Everything in flight finished: the rounds into the buffer (their rollout metrics returned), the sync
        and evaluation asked for done; a checkpoint after it holds every decoded round."""
        rows = [self._finish(q) for q in sorted(self.rounds)]
        self._do_due()
        return rows
