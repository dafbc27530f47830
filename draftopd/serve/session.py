"""ServeSession: what `draftopd serve` keeps beside vLLM's server, and the swaps it makes.

One object on the server's event loop: the drafter version serving and those before it, the traffic buffer,
live tau, the learner (when learning is on) and the MLflow run. Its background task takes finished requests'
records (stock: from the responses, through tap.py; full: the hook's, from vLLM's worker), turns them into
trajectories off the event loop, and hands them to the buffer;
failures there are logged and counted, never raised into a request. A swap (`promote`, `rollback`) saves the
version first, pushes its weights into the running engine as the offline engine does (vLLM's
`start_draft_weight_update` / `update_weights` / `finish_weight_update` into draftopd's weight-transfer engine,
vllm_backend/push.py), labels them with vLLM's weight version, then resets the prefix cache, retried
in the background while requests hold blocks (vLLM refuses the reset while any run). Requests in flight keep
running through a swap (paused for the push itself, vLLM's `pause_generation(mode="keep")`): verification is
by the target, so their output does not change; the steps after it are
drafted by the new weights, and such a request's trajectory (drafted by two versions) is left out of training
and live tau.

The engine is anything with vLLM's `AsyncLLM` methods `collective_rpc`, `pause_generation`,
`resume_generation`, `update_weight_version` and `reset_prefix_cache`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draftopd.serve.records import LiveTau, RecordSkipped, from_hook, from_response, traffic_domain
from draftopd.serve.settings import ServeSettings, serving_dtype

log = logging.getLogger(__name__)


class SwapError(RuntimeError):
    """A swap that cannot be made (no previous version, a family vLLM cannot take live weights for)."""


class StoredDrafter:
    """A drafter as a checkpoint holds it (config.json dict, tensors in checkpoint names): what the version store
    saves and a push sends, without building the model."""

    def __init__(self, config: dict, tensors: dict):
        self._config, self._tensors = config, tensors

    @classmethod
    def read(cls, path: str | Path) -> StoredDrafter:
        from draftopd.drafters import read_raw, read_tensors

        return cls(read_raw(path)[1], read_tensors(path))

    def config(self) -> dict:
        return self._config

    def state(self) -> dict:
        return self._tensors


class ServeSession:
    def __init__(self, settings: ServeSettings, kind: str, method: str, store, buffer, version: int, history: list):
        self.settings, self.kind, self.method = settings, kind, method
        self.store, self.buffer = store, buffer
        self.version, self.history = version, list(history)  # history: versions served, oldest first, this last
        self.start_version = version  # what vLLM started with (the hook says None until a reload)
        self.live = LiveTau(settings.rollback_window)
        self.counts = {"requests": 0, "skipped": 0, "mixed": 0, "record_errors": 0, "promotions": 0}
        self.counts["rollbacks"] = 0
        self.engine = self.loop = self.tokenizer = self.learner = self.tracker = None
        self.watch: tuple[int, int, float] | None = None  # (new version, previous, previous's live tau)
        self.reset_pending = False
        self.last_verdict: dict = {}
        self.target_dir, self.eos = settings.target, []  # set by the server once vLLM has resolved the target
        self._native_pair = None  # (version, target, drafter) in torch, for the guard of operators' pushes
        self.model_lock = threading.Lock()  # the learner's steps and the operators' guard take turns on the target
        self._swap = asyncio.Lock()
        self._work = ThreadPoolExecutor(1, thread_name_prefix="draftopd-records")  # conversion, buffer, disk
        self._tracking = ThreadPoolExecutor(1, thread_name_prefix="draftopd-mlflow")  # MLflow off the loop
        self._tasks: list[asyncio.Task] = []
        self.tap = None  # the ResponseTap stock recording reads the responses with (set by the server)

    # -- the background task -------------------------------------------------------------------------

    def start(self, engine, tokenizer, tracker=None) -> None:
        """Begin recording (when on) on the running event loop."""
        self.engine, self.tokenizer, self.tracker = engine, tokenizer, tracker
        self.loop = asyncio.get_running_loop()
        self._tasks.append(self.loop.create_task(self._background()))

    async def _background(self) -> None:
        s = self.settings
        saved = logged = time.monotonic()
        while True:
            await asyncio.sleep(s.poll_s)
            try:
                if s.record != "off":
                    await self.collect()
                if self.reset_pending:
                    self.reset_pending = not await self.engine.reset_prefix_cache()
                now = time.monotonic()
                if now - saved >= s.save_every_s:
                    saved = now
                    await self.loop.run_in_executor(self._work, self.save_buffer)
                if now - logged >= s.log_every_s:
                    logged = now
                    self.track_live()
            except asyncio.CancelledError:
                raise
            except Exception:  # recording is best effort: serving goes on
                if getattr(self.engine, "errored", False):  # the engine stopped (shutting down): nothing to take
                    return
                self.counts["record_errors"] += 1
                log.exception("draftopd: taking the records of finished requests failed (serving is unaffected)")

    async def collect(self) -> int:
        """Take finished requests' records (the tap's, or with full recording the hook's from vLLM's worker), into
        the buffer and live tau; returns how many."""
        if self.settings.record == "full":
            records = list(((await self.engine.collective_rpc("draftopd_take_finished"))[0] or {}).items())
        else:
            records = [(None, r) for r in self.tap.take()]
        if not records:
            return 0
        done = await self.loop.run_in_executor(self._work, self._convert, records)
        for f in done:
            self.live.add(f)
        self.counts["requests"] += len(records)
        self.counts["mixed"] += sum(f.mixed for f in done)
        self.counts["skipped"] += len(records) - len(done)
        await self._judge_new_version()
        return len(records)

    def _convert(self, records: list) -> list:
        """Worker thread: (request id or None, record) -> Finished (skipped ones logged), unmixed ones into the
        buffer."""
        done = []
        k = self.settings.num_draft_tokens
        convert = from_hook if self.settings.record == "full" else from_response
        for rid, rec in records:
            domain = traffic_domain(self._text(rec.get("prompt_ids") or []))
            try:
                done.append(convert(rec, self.start_version, k, domain))
            except RecordSkipped as exc:
                log.warning("draftopd: request %s not recorded: %s", rid or "(stock)", exc)
        keep = [f for f in done if not f.mixed and f.steps]
        if keep and self.buffer is not None:
            texts = [self._text(f.trajectory.full_ids) for f in keep] if self.settings.keep_text else None
            self.buffer.add([f.trajectory for f in keep], [f.domain for f in keep], texts)
        return done

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    # -- swaps ---------------------------------------------------------------------------------------

    def next_version(self) -> int:
        known = [v for v, _ in self.store.list()] if self.store is not None else []
        return max([*known, *self.history, self.version]) + 1

    async def promote(self, drafter, version: int | None = None, evidence: dict | None = None) -> int:
        """Save `drafter` as a new version, push it into the engine, make it the one serving; returns it."""
        self._check_pushable()
        async with self._swap:
            version = self.next_version() if version is None else version
            evidence = dict(evidence or {})
            await self.loop.run_in_executor(self._work, self.store.save, drafter, version, evidence)
            previous = self.version
            await self._push(drafter.state(), version)
            self.history.append(version)
            self.counts["promotions"] += 1
            tau, n = self.live.recent_tau(previous)
            # judged later against the previous version's live tau, when that rests on a full window
            self.watch = (version, previous, tau) if n >= self.live.window else None
            self._write_serving()
            self.track_event("promotion", {"version": version, "previous": previous, **_numbers(evidence)})
            await self._tell_learner()
            log.warning("draftopd: drafter version %d serving (was %d)", version, previous)
            return version

    async def rollback(self, reason: str = "requested") -> int:
        """Push the version served before this one; returns it. SwapError when there is none."""
        self._check_pushable()
        async with self._swap:
            if len(self.history) < 2:
                raise SwapError(f"drafter version {self.version} is the first of this run: nothing to roll back to")
            current, previous = self.history[-1], self.history[-2]
            path = version_path(self.store, previous)
            drafter = await self.loop.run_in_executor(self._work, StoredDrafter.read, path)
            await self._push(drafter.state(), previous)
            self.history.pop()
            self.counts["rollbacks"] += 1
            self.watch = None
            self._write_serving()
            self.track_event("rollback", {"version": previous, "from": current}, {"reason": reason})
            await self._tell_learner()
            log.warning("draftopd: rolled back to drafter version %d from %d (%s)", previous, current, reason)
            return previous

    async def _push(self, state: dict, version: int) -> None:
        from draftopd.vllm_backend.push import push_async

        reset = await push_async(self.engine, state, version)  # vLLM's weight-transfer calls (push.py)
        self.version = version
        self.reset_pending = not reset  # cached blocks hold the old drafter's KV; retried while requests hold them

    def _check_pushable(self) -> None:
        from draftopd.drafters import family

        if not family(self.kind).live_push:
            raise SwapError(
                f"a '{self.kind}' drafter takes no live weight pushes in vLLM (vLLM method {self.method}): restart "
                "the server on the new checkpoint instead"
            )

    async def _judge_new_version(self) -> None:
        """Automatic rollback: once the new version has served a window of requests, its live tau must not fall
        below the previous version's (over that one's last window before the swap) by the margin."""
        if self.watch is None:
            return
        new, old, old_tau = self.watch
        tau, n = self.live.recent_tau(new)
        if n < self.live.window or self.version != new:
            return
        self.watch = None
        if tau < old_tau * (1 - self.settings.rollback_margin):
            await self.rollback(f"live tau {tau:.3f} of version {new} fell below {old_tau:.3f} of version {old}")

    async def vet(self, path: str):
        """The guard's verdict (guard.Verdict) on a drafter directory against the drafter serving, on the newest
        held-out traffic, as the learner's candidates get it; off the event loop (seconds: shadow decodes)."""
        return await self.loop.run_in_executor(None, self._vet, path)

    def _vet(self, path: str):
        from draftopd.drafters import load_drafter
        from draftopd.serve.guard import judge

        ls = self.learner_settings()
        with self.model_lock:  # the learner's target: its step, or this verdict, never both at once
            target, incumbent = self._native()
            candidate = load_drafter(path, target)
            held = self.buffer.holdout(ls.holdout_n)
            k, margin, limit = ls.num_draft_tokens, ls.margin, ls.guard_max_new_tokens
            return judge(candidate, incumbent, target, self.eos, held, k, margin, ls.confidence, limit)

    def _native(self):
        """(target, drafter serving) as torch models in this process, for the guard: the learner's target when it
        runs, else loaded on first use; the drafter reloaded when the version serving changed."""
        from draftopd.drafters import family, load_drafter, read_raw
        from draftopd.loading import load_target

        path = version_path(self.store, self.version)
        cached = self._native_pair
        if cached is None or cached[0] != self.version:
            target = cached[1] if cached else self.learner.target if self.learner is not None else None
            if target is None:
                kind, config = read_raw(path)
                ids = self.settings.aux_layer_ids or family(kind).target_layers(config)
                target = load_target(self.target_dir, ids or None, serving_dtype(self.settings))
            self._native_pair = cached = (self.version, target, load_drafter(path, target).eval())
        return cached[1], cached[2]

    def preload_native(self) -> None:
        """Load the torch target and serving drafter now (seconds), e.g. while vLLM starts, so that the learner
        starting later finds them."""
        self._native()

    def start_learner(self) -> bool:
        """(Any thread but the loop's: it loads models.) The learner on its own thread, training a copy of the
        serving drafter on the buffer; its proposals are pushed on the server's loop (`propose`). A learner that
        cannot start is logged and left off: serving goes on. Returns whether one runs."""
        from draftopd.serve.learner import ServeLearner

        try:
            self._check_pushable()
            target, drafter = self._native()
            self.learner = ServeLearner(
                target,
                drafter,
                self.buffer,
                self.learner_settings(),
                self.propose,
                self.learner_log,
                self.eos,
                self.model_lock,
            )
            self.learner.start()
        except Exception:
            log.exception("draftopd serve: the learner did not start (serving goes on without it)")
            self.learner = None
        return self.learner is not None

    def control_learner(self, action: str) -> None:
        """start, stop (after its current step) or kill (at once) the learner; serving is not touched."""
        if action == "start":
            self._check_pushable()
            if self.learner is None or not self.learner.alive():
                self.start_learner()
        elif self.learner is not None:
            self.learner.kill() if action == "kill" else self.learner.stop()
            self.track_event(f"learner_{action}", {"steps": self.learner.steps})

    def learner_settings(self):
        from draftopd.serve.learner import LearnerSettings
        from draftopd.serve.settings import learner_loss

        told = {"num_draft_tokens": self.settings.num_draft_tokens, **self.settings.learner}
        return LearnerSettings(**told | {"loss": learner_loss(self.settings)})

    def propose(self, drafter, verdict) -> None:
        """The learner's callback (its own thread): promote on the server's loop, waiting for the push."""
        evidence = verdict.evidence() if hasattr(verdict, "evidence") else _as_dict(verdict)
        future = asyncio.run_coroutine_threadsafe(self.promote(drafter, evidence=evidence), self.loop)
        future.result()

    def learner_log(self, row: dict, step: int) -> None:
        """The learner's log (its own thread): numbers to MLflow at its step; verdicts (with their evidence) and
        errors also as JSON lines in learner.jsonl."""
        row = _as_dict(row)
        event = str(row.get("event", ""))
        if event != "step":
            if event == "verdict":
                self.last_verdict = row
            with (Path(self.settings.run_dir) / "learner.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), **row}, default=str) + "\n")
        if self.tracker is not None:
            prefix = "learner" if event == "step" else f"learner/{event}"
            metrics = {f"{prefix}/{k}": v for k, v in _numbers(row).items()}
            self._tracking.submit(_quietly, self.tracker.log_metrics, metrics, step)

    async def _tell_learner(self) -> None:
        """The learner's incumbent is now the drafter serving (as a torch model, loaded from its version)."""
        if self.learner is not None:
            self.learner.set_incumbent((await self.loop.run_in_executor(None, self._native))[1])

    # -- state, disk, MLflow -------------------------------------------------------------------------

    def status(self) -> dict:
        learner = self.learner.counters() if self.learner is not None else {}
        return {
            "version": self.version,
            "versions": [v for v, _ in self.store.list()] if self.store is not None else [self.version],
            "history": list(self.history),
            "recording": self.settings.record,
            "buffer": self.buffer.stats() if self.buffer is not None else {},
            "requests": dict(self.counts) | self._tap_counts(),
            "learner": {
                "on": self.learner is not None,
                "alive": bool(learner.get("alive", False)),
                "steps": int(learner.get("steps", 0)),
                "candidates": int(learner.get("candidates", 0)),
                "promotions": self.counts["promotions"],  # the learner's and operators' (POST /draftopd/promote)
                "rejections": int(learner.get("rejections", 0)),
                "errors": int(learner.get("errors", 0)),
                "last_error": learner.get("last_error", ""),
                "last_verdict": self.last_verdict,
            },
            **self.live.summary(),
        }

    def _tap_counts(self) -> dict:
        """Records the tap dropped (the session fell behind) or could not read; zeros without a tap."""
        tap = self.tap
        return {"dropped": tap.dropped if tap else 0, "unread": tap.errors if tap else 0}

    def _write_serving(self) -> None:
        """serving.json: the version serving and those before it, what a restart resumes."""
        path = Path(self.settings.run_dir) / "serving.json"
        path.write_text(json.dumps({"version": self.version, "history": self.history}) + "\n")

    def save_buffer(self) -> None:
        if self.buffer is not None:
            self.buffer.save(Path(self.settings.run_dir) / "traffic")

    def track_live(self) -> None:
        if self.tracker is None:
            return
        metrics = {"live/version": float(self.version), "live/requests": float(self.counts["requests"])}
        tau, n = self.live.recent_tau(self.version)
        if n:
            metrics["live/tau"] = tau
        for v, t in self.live.versions.items():
            metrics[f"live/tau_v{v}"] = t.tau
        for d, t in self.live.domains.items():
            metrics[f"live/tau_{d.replace('/', '_')}"] = t.tau
        if self.buffer is not None:
            metrics.update({f"buffer/{k}": v for k, v in _numbers(self.buffer.stats()).items()})
        self._tracking.submit(_quietly, self.tracker.log_metrics, metrics, self.counts["requests"])

    def track_event(self, name: str, numbers: dict, tags: dict | None = None) -> None:
        """A promotion or rollback: numbers as metrics at this many requests, the whole row in events.jsonl."""
        row = {"event": name, "requests": self.counts["requests"], "time": time.time(), **numbers, **(tags or {})}
        with (Path(self.settings.run_dir) / "events.jsonl").open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        if self.tracker is not None:
            metrics = {f"{name}/{k}": float(v) for k, v in numbers.items()}
            self._tracking.submit(_quietly, self.tracker.log_metrics, metrics, self.counts["requests"])

    async def close(self) -> None:
        """Stop the background task and the learner; save the buffer; end the MLflow run."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.learner is not None:
            await self.loop.run_in_executor(None, self.learner.stop)
        await self.loop.run_in_executor(self._work, self.save_buffer)
        if self.tracker is not None:
            self.track_live()
            self._tracking.submit(_quietly, self.tracker.end)
        self._tracking.shutdown(wait=True)
        self._work.shutdown(wait=True)


def version_path(store, version: int) -> Path:
    """The directory the version store keeps `version` in; SwapError when it is not kept (pruned)."""
    kept = [v for v, _ in store.list()]
    if version not in kept:
        raise SwapError(f"drafter version {version} is not in the run directory (kept: {kept})")
    return Path(store.path(version))


def _numbers(row: dict) -> dict:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _as_dict(obj) -> dict:
    from dataclasses import asdict, is_dataclass

    if is_dataclass(obj):
        return asdict(obj)
    return dict(obj) if isinstance(obj, dict) else {"value": str(obj)}


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # tracking never stops serving
        log.exception("draftopd: MLflow logging failed")
