"""The serving fleet: stock vLLM replicas behind draftopd's router, one learner on a device of its own, and guarded
pushes to every replica. This module reads as the fleet, as opd/driver.py reads as the training loop:

    place the replicas (Ray actors owning vLLM's server) and the learner (opd's learner role, an actor)
    serve:  clients -> router -> a replica in rotation -> the response, and its record into a bounded queue
    learn:  records -> trajectories -> the learner's replay buffer; its steps; a guarded candidate
    push:   a promoted version, saved, then to each replica in turn (drained, pushed, back in rotation)
    watch:  a replica that died or missed a push is out of rotation until it serves the fleet's version

Serving never waits on the learner: records wait in the router's bounded queue, and the learner's calls are
awaited beside the router on one event loop. Versions live in the run directory's VersionStore, as with the
single-process server, so a replica restarted from disk starts at the serving version.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from draftopd.serve.records import LiveTau, RecordSkipped, from_response
from draftopd.serve.router import FleetRouter
from draftopd.serve.settings import ServeSettings, serving_dtype

log = logging.getLogger(__name__)


def served_form(kind: str, config: dict, state: dict, num_draft_tokens: int) -> tuple[dict, dict]:
    """A learner's drafter as vLLM serves it: the family's vLLM export (PARD's drops `target_proj`, which the
    target-independent model vLLM runs has no parameter for), so pushes load and stored versions restart."""
    from draftopd.drafters import family

    return family(kind).export(config, state, "vllm", num_draft_tokens=num_draft_tokens)


@dataclass
class FleetSettings:
    """What a fleet adds to one server's settings."""

    replicas: int = 2  # vLLM replicas (Ray actors, each owning one vLLM server)
    learner_device: str = "cpu"  # cpu: the learner on a core of its own; gpu: on a GPU of its own
    learning: bool = True  # the learner trains on the traffic and proposes guarded versions
    replica_cpus: float = 1.0  # Ray CPUs each replica's actor holds (vLLM's own processes run under it)
    learner_cpus: float = 1.0
    work_s: float = 5.0  # one learner call's length (records reach it between calls)
    push_timeout_s: float = 60.0  # a push to one replica taking longer fails it (out of rotation, re-synced)
    drain_s: float = 30.0  # wait for a replica's requests in flight before pushing to it
    watch_s: float = 2.0  # how often replicas' health and missed pushes are checked
    ready_timeout_s: float = 600.0
    env: dict = field(default_factory=lambda: {"OMP_NUM_THREADS": "1"})  # vLLM's environment on each replica
    attach: list[str] = field(default_factory=list)  # URLs of vLLM servers someone else runs: the replicas instead


class Fleet:
    def __init__(self, s: ServeSettings, fs: FleetSettings):
        from draftopd.serve.server import open_session

        self.s, self.fs = s, fs
        session, self.first_dir = open_session(s)  # the run directory, version store and resume point
        self.store, self.kind, self.version = session.store, session.kind, session.version
        self.history = list(session.history)
        self.router = FleetRouter(s.api_key, s.buffer_capacity)
        self.router.status_extra, self.router.control = self.status, self.control
        self.live = LiveTau(s.rollback_window)
        self.pending: deque = deque(maxlen=s.buffer_capacity)  # trajectories waiting for the learner
        self.counts = {"records": 0, "skipped": 0, "mixed": 0, "promotions": 0, "rollbacks": 0, "push_failures": 0}
        self.counts["pending_dropped"] = 0
        self.counts["no_steps"] = 0  # answered within the prefill: no verification step, so not in live tau
        self.learner = self.learner_state = None
        self.learner_counters: dict = {}
        self.replicas: dict[int, object] = {}
        self.pids: dict[str, int] = {"router": os.getpid()}  # each role's process (a replica's: its vLLM server)
        self.timeline: list[dict] = []  # every replica's version over time (the load run's figure)
        self._swap = asyncio.Lock()

    # -- the fleet -------------------------------------------------------------------------------------

    async def run(self, started: asyncio.Event | None = None) -> None:
        """Serve until cancelled: the router listens at once (503 until a replica is in rotation)."""
        import uvicorn

        from draftopd.loading import resolve_target_path

        self.target_dir = str(resolve_target_path(self.s.target).resolve())
        self.eos = self._eos()  # here, before any thread: transformers' lazy imports race between threads
        config = uvicorn.Config(self.router.app(), host=self.s.host, port=self.s.port, log_level="warning")
        self._server = server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        count = len(self.fs.attach) or self.fs.replicas
        for i in range(count):
            self.replicas[i] = self._place_replica(i)
        await asyncio.gather(*(self._bring_up(i) for i in range(count)))
        tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._watch())]
        if self.fs.learning:
            tasks.append(asyncio.create_task(self._learn()))
        log.warning("draftopd fleet: %d replicas serving drafter version %d", count, self.version)
        if started is not None:
            started.set()
        try:
            await serving
        finally:
            for t in tasks:
                t.cancel()
            await self.close()

    def stop(self) -> None:
        """(On the fleet's loop.) Stop listening; `run` then stops the replicas and the learner."""
        self._server.should_exit = True

    async def close(self) -> None:
        import ray

        stops = [asyncio.wait_for(actor.stop.remote(), 60) for actor in self.replicas.values()]
        for i, result in zip(self.replicas, await asyncio.gather(*stops, return_exceptions=True)):
            if isinstance(result, BaseException):
                log.warning("draftopd fleet: stopping replica %d: %s", i, result)
        for actor in self.replicas.values():
            ray.kill(actor)
        if self.learner is not None:
            ray.kill(self.learner)

    # -- replicas --------------------------------------------------------------------------------------

    def _place_replica(self, i: int):
        import ray

        from draftopd.serve.replica import AttachedReplica, Replica, ReplicaSpec

        local = ServeSettings(**{**self.s.__dict__, "dtype": serving_dtype(self.s)})
        spec = ReplicaSpec(local, self.target_dir, self.kind, dict(self.fs.env))
        if self.fs.attach:  # someone else's server: an actor of no CPUs that only calls it
            return ray.remote(AttachedReplica).options(num_cpus=0, max_restarts=0).remote(spec, i, self.fs.attach[i])
        actor = ray.remote(Replica).options(num_cpus=self.fs.replica_cpus, max_restarts=0)
        logs = Path(self.s.run_dir) / "replicas" / f"replica-{i}.log"
        return actor.remote(spec, i, str(logs))

    async def _bring_up(self, i: int) -> None:
        """Start replica `i` from the serving version's directory and admit it once it answers: it takes traffic
        at the fleet's version, never before."""
        from draftopd.serve.session import version_path

        version = self.version
        self.router.hold(i, "starting", f"vLLM starting at version {version}")
        url = await self.replicas[i].start.remote(str(version_path(self.store, version)), version)
        self.router.join(i, url, version)
        seconds = await self.replicas[i].wait_ready.remote(self.fs.ready_timeout_s)
        pid = await self.replicas[i].pid.remote()
        if pid is not None:
            self.pids[f"replica-{i}"] = pid
        if self.fs.attach or version != self.version:  # someone else's server, or a promotion landed meanwhile
            await self._push_one(i, url, self.version)
            return
        self.router.admit(i, url, version)
        self._mark(i, version, f"ready in {seconds:.1f} s")

    async def _push_one(self, i: int, url: str, version: int, state_ref=None) -> bool:
        """Drain replica `i`, push `version` into it, put it back in rotation; False (held out) on failure."""
        import ray

        from draftopd.serve.session import StoredDrafter, version_path

        self.router.hold(i, "syncing", f"push of version {version}")
        await self.router.drain(i, self.fs.drain_s)
        if state_ref is None:
            state_ref = ray.put(StoredDrafter.read(version_path(self.store, version)).state())
        self.router.begin_push(i)
        try:
            res = await asyncio.wait_for(self.replicas[i].push.remote(state_ref, version), self.fs.push_timeout_s)
        except Exception as exc:
            self.counts["push_failures"] += 1
            why = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
            self.router.hold(i, "out", f"push of version {version} failed: {why}"[:300])
            log.warning("draftopd fleet: replica %d missed version %d (%s); held out until re-synced", i, version, why)
            return False
        self.router.admit(i, url, version)
        self._mark(i, version, f"pushed in {res['seconds']:.2f} s")
        return True

    def _mark(self, i: int, version: int, note: str) -> None:
        self.timeline.append({"time": time.time(), "replica": i, "version": version, "note": note})

    async def _watch(self) -> None:
        """Replicas whose vLLM died are restarted at the serving version; those that missed a push re-synced."""
        while True:
            await asyncio.sleep(self.fs.watch_s)
            for i, m in list(self.router.members.items()):
                if m.state in ("starting", "syncing") or self._swap.locked():
                    continue
                try:
                    alive = await asyncio.wait_for(self.replicas[i].alive.remote(), 30)
                except Exception:
                    alive = False
                if not alive and self.fs.attach:  # not ours to restart: out until it answers, then re-synced
                    if m.state != "down":
                        self._mark(i, -1, "down")
                        self.router.hold(i, "down", "not answering /health")
                elif not alive:
                    self._mark(i, -1, "down")
                    self.router.hold(i, "starting", "restarting: vLLM's process ended")
                    asyncio.create_task(self._restart(i))
                elif m.state in ("out", "down") or m.version != self.version:  # missed a push, or a failed call
                    async with self._swap:
                        await self._push_one(i, m.url, self.version)

    async def _restart(self, i: int) -> None:
        import ray

        try:
            if not await self._actor_alive(i):
                self.replicas[i] = self._place_replica(i)
            await self._bring_up(i)
        except Exception as exc:
            self.router.hold(i, "down", f"restart failed: {type(exc).__name__}: {exc}"[:300])
            log.warning("draftopd fleet: replica %d did not restart: %s", i, exc)
            if isinstance(exc, ray.exceptions.RayActorError):
                self.replicas[i] = self._place_replica(i)

    async def _actor_alive(self, i: int) -> bool:
        try:
            await asyncio.wait_for(self.replicas[i].pid.remote(), 30)
            return True
        except Exception:
            return False

    # -- versions --------------------------------------------------------------------------------------

    async def promote(self, config: dict, state: dict, evidence: dict) -> int:
        """Save the new version, then push it to each replica in turn (the others keep serving)."""
        import ray

        from draftopd.serve.session import StoredDrafter

        config, state = served_form(self.kind, config, state, self.s.num_draft_tokens)
        async with self._swap:
            version = max(v for v, _ in self.store.list()) + 1
            await asyncio.to_thread(self.store.save, StoredDrafter(config, state), version, evidence)
            await self._roll_out(version, ray.put(state))
            self.history.append(version)
            self.counts["promotions"] += 1
        await self._tell_learner(config, state, version)
        return version

    async def rollback(self, reason: str = "requested") -> int:
        """The fleet serves the version before the current one again, on every replica."""
        import ray

        from draftopd.serve.session import StoredDrafter

        async with self._swap:
            prev = self.store.previous(self.version)
            if prev is None:
                raise ValueError(f"no version before {self.version} to roll back to")
            stored = StoredDrafter.read(prev[1])
            await self._roll_out(prev[0], ray.put(stored.state()))
            self.history.append(prev[0])
            self.counts["rollbacks"] += 1
            log.warning("draftopd fleet: rolled back to version %d (%s)", prev[0], reason)
        await self._tell_learner(stored.config(), stored.state(), prev[0])
        return prev[0]

    async def _roll_out(self, version: int, state_ref) -> None:
        self.version = version  # replicas that miss it are re-synced to it by the watcher
        for i, m in list(self.router.members.items()):
            if m.state in ("serving", "out"):
                await self._push_one(i, m.url, version, state_ref)

    async def _tell_learner(self, config: dict, state: dict, version: int) -> None:
        if self.learner is not None:
            try:
                await self.learner.served.remote(config, state, version)
            except Exception:
                log.exception("draftopd fleet: telling the learner about version %d", version)

    async def control(self, action: str, body: dict) -> tuple[int, dict]:
        """/draftopd/rollback and /draftopd/promote {"path": drafter dir} (vetted by the learner's guard)."""
        try:
            if action == "rollback":
                return 200, {"version": await self.rollback(body.get("reason", "requested"))}
            if action == "promote":
                return await self._operator_push(str(body.get("path", "")))
        except ValueError as exc:
            return 409, {"error": str(exc)}
        return 404, {"error": f"unknown action {action!r}: rollback or promote"}

    async def _operator_push(self, path: str) -> tuple[int, dict]:
        from draftopd.serve.session import StoredDrafter

        stored = await asyncio.to_thread(StoredDrafter.read, path)
        if self.learner is None:
            return 409, {"error": "no learner to vet the drafter with: it is pushed only when the guard can judge it"}
        verdict = await self.learner.vet.remote(stored.config(), stored.state())
        if not verdict.get("promote"):
            return 409, {"error": f"refused by the guard: {verdict.get('reason')}", "verdict": verdict}
        version = await self.promote(stored.config(), stored.state(), {"source": path, **verdict})
        return 200, {"version": version, "verdict": verdict}

    # -- records and the learner -----------------------------------------------------------------------

    async def _pump(self) -> None:
        """Records -> trajectories (live tau per version) -> the learner's inbox, every half second."""
        while True:
            await asyncio.sleep(self.s.poll_s)
            for record in self.router.records.take():
                self._record(record)

    def _record(self, record: dict) -> None:
        self.counts["records"] += 1
        if record.get("mixed"):
            self.counts["mixed"] += 1
        try:
            f = from_response(record, record["versions"][0], self.s.num_draft_tokens)
        except RecordSkipped:
            self.counts["skipped"] += 1
            return
        self.live.add(f)
        self.counts["no_steps"] += not f.steps
        if not f.mixed and f.steps:
            if len(self.pending) == self.pending.maxlen:
                self.counts["pending_dropped"] += 1
            self.pending.append(f.trajectory)

    async def _learn(self) -> None:
        """The learner's loop: hand it what arrived, let it work `work_s`, push what its guard promoted."""
        try:
            await self._start_learner()
        except Exception as exc:
            self.learner_state = f"failed to start: {type(exc).__name__}: {exc}"[:300]
            log.exception("draftopd fleet: the learner did not start; serving goes on without it")
            return
        while True:
            try:
                batch = list(self.pending)
                self.pending.clear()
                if batch:
                    await self.learner.add.remote(batch)
                out = await self.learner.work.remote(self.fs.work_s)
            except Exception as exc:  # the learner died: serving goes on, records wait (bounded)
                self.learner_state = f"down: {type(exc).__name__}"
                log.warning("draftopd fleet: the learner failed (%s); serving goes on", exc)
                self.learner = None
                return
            self.learner_counters = {k: v for k, v in out.items() if k != "candidate"}
            cand = out.get("candidate")
            if cand is not None:
                await self.promote(cand["config"], cand["state"], {"verdict": cand["verdict"]})
            elif not batch and not out.get("last_step"):
                await asyncio.sleep(self.s.poll_s)

    async def _start_learner(self) -> None:
        import ray

        from draftopd.serve.fleet_learner import FleetLearner

        spec, settings = self._learner_spec()
        gpus = 1 if self.fs.learner_device == "gpu" else 0
        actor = ray.remote(FleetLearner).options(num_cpus=self.fs.learner_cpus, num_gpus=gpus, max_restarts=0)
        self.learner = actor.remote(spec, settings, self.eos)
        self.learner_state = "starting"
        info = await self.learner.setup.remote(self.version)
        self.pids["learner"] = info["pid"]
        self.learner_state = f"learning on {info['device']}"

    def _learner_spec(self):
        """opd's LearnerSpec for the serving drafter (the learner starts from it) and serving's learner knobs."""
        from draftopd.drafters import family, read_raw
        from draftopd.opd.learner import LearnerSpec
        from draftopd.schema import DrafterConfig
        from draftopd.serve.learner import LearnerSettings
        from draftopd.serve.session import version_path
        from draftopd.serve.settings import learner_loss

        path = version_path(self.store, self.version)
        kind, raw = read_raw(path)
        settings = LearnerSettings(**{k: v for k, v in self.s.learner.items() if k != "loss"})
        settings.loss, settings.num_draft_tokens = learner_loss(self.s), self.s.num_draft_tokens
        layers = self.s.aux_layer_ids or list(family(kind).target_layers(raw) or [])
        spec = LearnerSpec(self.target_dir, layers, serving_dtype(self.s), DrafterConfig(kind=kind), str(path))
        spec.lr, spec.num_threads, spec.seed = settings.lr, settings.threads, settings.seed
        return spec, settings

    def _eos(self) -> list[int]:
        from draftopd.loading import eos_ids, load_tokenizer

        return eos_ids(load_tokenizer(self.target_dir), self.target_dir)

    # -- what /draftopd/status shows -------------------------------------------------------------------

    def status(self) -> dict:
        return {
            "version": self.version,
            "history": self.history,
            "kind": self.kind,
            "counts": dict(self.counts),
            "pids": dict(self.pids),
            "timeline": self.timeline[-200:],  # each replica's version changes (time, replica, version, note)
            # promotions: the learner's and operators' (POST /draftopd/promote), as the one-process server counts them
            "learner": {"state": self.learner_state, **self.learner_counters, "promotions": self.counts["promotions"]},
            **self.live.summary(),
        }


def serve_fleet(s: ServeSettings, fs: FleetSettings) -> None:
    """`draftopd serve --replicas N`: Ray (a cluster's, or one started here) and the fleet until interrupted."""
    import ray
    import uvloop

    from draftopd.vllm_backend.engine import check_install

    check_install()
    if not ray.is_initialized():
        ray.init(address="auto" if _cluster() else None, num_cpus=None if _cluster() else _local_cpus(fs))
    uvloop.run(Fleet(s, fs).run())


def _cluster() -> bool:
    import os

    return bool(os.environ.get("RAY_ADDRESS"))


def _local_cpus(fs: FleetSettings) -> int:
    """Logical CPUs for a one-machine fleet: every replica's and the learner's reservation, whatever the cores."""
    import math

    return math.ceil(fs.replicas * fs.replica_cpus + fs.learner_cpus) + 1
