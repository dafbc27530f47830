"""Weight sync: the drafter of learner rank 0 reaches every rollout worker under a new `policy_version`.

Two transports behind one interface (the recipe's `sync.backend` picks one):

* `ObjectStoreSync` (`object_store`, the CPU default): rank 0 puts tensor copies
  of the weights (in their own dtype) in Ray's object store and every generate call carries the
  reference, so a worker that was restarted picks the weights up on its first
  call. Works on any cluster; costs a copy per publish.
* `CollectiveSync` (`nccl` on GPUs, `gloo` as its CPU twin): a process group of
  its own (own TCPStore; torch's default group belongs to DeepSpeed) joins
  learner rank 0 with every worker, and rank 0 broadcasts each tensor straight
  into the workers' drafters. Nothing goes through the object store. A worker
  that was restarted is not in the group, so it refuses a generate call with
  `StaleWeights`; the driver publishes again (which rebuilds the group) and
  re-runs that call.

With vLLM rollout workers on GPUs, `nccl` goes through vLLM's own weight-transfer
engine instead (draftopd/vllm_backend/transfer.py): learner rank 0 broadcasts from
its GPU straight into each engine's draft model, and the rollout actor itself
opens no CUDA context and no process group.

Every group fails cleanly: each operation has the group's timeout, a member that
fails closes its end, and `publish` raises `WeightSyncError` naming the group
and the members that failed once every call of the round has ended (a killed
worker, a timeout). The next publish forms a new group; each member closes its
old group before it joins one.

Under ZeRO-3 every learner rank takes part in gathering the parameters, so
publish always calls all ranks.
"""

from __future__ import annotations

import datetime
import itertools
import time

import torch

from draftopd.messages import WeightUpdate


class StaleWeights(RuntimeError):
    """A rollout worker was asked to generate with weights it does not hold and cannot fetch."""


class WeightSyncError(RuntimeError):
    """A collective weight sync did not complete (a member died, or an operation passed the group's timeout).

    The member that raises it has closed its end of the group; the next publish forms a new one.
    """


DEFAULT_TIMEOUT_S = 300.0  # per operation: joining, and each tensor of a broadcast


# -- the two ends of a collective group (used inside learner and worker actors) --------------------


def join_group(backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A process group over its own TCPStore (rank 0 hosts the store); never touches torch's default group.

    Both backends get the timeout: gloo in its constructor, NCCL in its options (without it NCCL waits for
    its watchdog, ten minutes by default, and then takes the whole process down).
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"unknown collective backend {backend!r} (gloo or nccl)")


def close_group(group) -> None:
    """End a group now, whatever state its peers are in (abort, not a collective shutdown that waits for them)."""
    try:
        group.abort()
    except RuntimeError:  # a backend without abort: dropping the last reference closes it
        pass


def manifest(state: dict[str, torch.Tensor]) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype name) of every tensor in broadcast order: what a receiver allocates."""
    return [(k, tuple(state[k].shape), str(state[k].dtype).removeprefix("torch.")) for k in sorted(state)]


def broadcast_state(group, backend: str, items: list, state: dict | None, timeout=None) -> dict:
    """Broadcast from group rank 0 (which passes `state`) to the others (which pass None and get CPU tensors).

    bool buffers travel as uint8 (neither gloo nor NCCL reduces bools); NCCL needs CUDA tensors. Each tensor
    waits at most `timeout`, then raises.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    timeout = timeout or datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    out = {}
    for name, shape, dtype_name in items:
        dtype = getattr(torch, dtype_name)
        wire = torch.uint8 if dtype == torch.bool else dtype
        if state is not None:
            t = state[name].to(device=device, dtype=wire).contiguous()
        else:
            t = torch.empty(shape, dtype=wire, device=device)
        group.broadcast(t, 0).wait(timeout)  # an explicit timeout makes NCCL's wait block, and raise, too
        if state is None:
            out[name] = t.to("cpu", dtype=dtype)
    return out


class TorchGroup:
    """One member's end of a torch weight-sync group (gloo or NCCL)."""

    def __init__(self, name: str, backend: str, group, timeout_s: float):
        self.name, self.backend, self.group = name, backend, group
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def send(self, state: dict, items: list) -> None:
        broadcast_state(self.group, self.backend, items, state, self.timeout)

    def receive(self, items: list) -> dict:
        return broadcast_state(self.group, self.backend, items, None, self.timeout)

    def close(self) -> None:
        close_group(self.group)


def sync_failure(who: str, name: str, exc: BaseException) -> WeightSyncError:
    """The error a member raises when its part of a round fails: it names the member, the group and the cause."""
    return WeightSyncError(f"{who} left weight-sync group {name!r} after: {_first_line(exc)}")


# -- the driver's side ----------------------------------------------------------------------------


class WeightSync:
    """Publishes rank 0's drafter to every worker; returns the update each later generate call carries.

    `rt` is the session's runtime (opd/runtime.py): Ray, or the roles in the driver's process.
    """

    def __init__(self, rt):
        self.rt = rt

    def publish(self, learners: list, workers: list, drafter_config: dict, version: int) -> WeightUpdate:
        raise NotImplementedError


class ObjectStoreSync(WeightSync):
    def publish(self, learners, workers, drafter_config, version):
        ref = [learner.weights.remote() for learner in learners][0]  # every rank: ZeRO-3 gathers collectively
        update = WeightUpdate(version, drafter_config, state_ref=ref)
        held = self.rt.get([w.apply_update.remote(update) for w in workers])
        assert held == [version] * len(workers), held
        return update


class CollectiveSync(WeightSync):
    """`transport`: gloo or nccl (torch groups), or vllm (NCCL into vLLM's weight-transfer engine)."""

    def __init__(self, rt, transport: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(rt)
        self.transport, self.timeout_s = transport, timeout_s
        self.group, self.items = "", []
        self._names = (f"weights-{i}" for i in itertools.count())

    def _form_group(self, learners: list, workers: list, drafter_config: dict) -> None:
        """A fresh group: learner rank 0 is rank 0 and hosts the store, on its own node; workers follow."""
        self.group = ""
        self.items = self.rt.get([learner.weight_manifest.remote() for learner in learners])[0]
        host, port = self.rt.get(learners[0].free_port.remote())
        name, n = next(self._names), len(workers) + 1
        args = (self.transport, host, port, n, self.timeout_s)
        layout = (drafter_config, self.items)  # what a vLLM worker starts its drafter engine from, if it has none
        # engines start (and warm up) before any member joins: vLLM's rendezvous gives the others five minutes
        prepares = [w.prepare_weight_group.remote(self.transport, layout) for w in workers]
        self._round(name, prepares, [f"rollout worker {i}" for i in range(len(workers))])
        joins = [learners[0].join_weight_group.remote(name, 0, *args)]
        joins += [w.join_weight_group.remote(name, r + 1, *args, layout) for r, w in enumerate(workers)]
        self._round(name, joins, ["learner rank 0"] + [f"rollout worker {i}" for i in range(len(workers))])
        self.group = name

    def publish(self, learners, workers, drafter_config, version):
        get = self.rt.get
        if not self.group or get([w.weight_group.remote() for w in workers]) != [self.group] * len(workers):
            self._form_group(learners, workers, drafter_config)
        update = WeightUpdate(version, drafter_config, group=self.group)
        sends = [learner.broadcast_weights.remote(self.group, self.items) for learner in learners]
        receives = [w.receive_weights.remote(update, self.items) for w in workers]
        who = [f"learner rank {r}" for r in range(len(learners))] + [f"rollout worker {i}" for i in range(len(workers))]
        held = self._round(self.group, sends + receives, who)[len(sends) :]
        assert held == [version] * len(workers), held
        return update

    def _round(self, name: str, refs: list, who: list[str], grace_s: float = 2.0) -> list:
        """Every call of one round. When one fails, the others get `grace_s` more to report (peers of a member
        that failed see their connections close), then one error names the group and every member that failed.
        The group is forgotten, so the next publish forms a new one; calls still running end within the
        group's timeout, before the members' next calls (a new group's joins) start."""
        errors, values = {}, {}
        pending, deadline = list(refs), None
        while pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = self.rt.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:  # silent past the grace: restarting after a crash, or frozen
                silent = TimeoutError(f"no answer {grace_s:g} s after the first failure")
                errors.update({refs.index(r): silent for r in pending})
                break
            k = refs.index(ready[0])
            try:
                values[k] = self.rt.get(ready[0])
            except Exception as exc:  # a member's WeightSyncError, or Ray's word that its actor died
                errors[k] = exc
                deadline = deadline or time.monotonic() + grace_s
        if errors:
            self.group = ""
            for k, e in errors.items():
                if who[k].startswith("learner") and isinstance(e, self.rt.ActorDied):
                    raise e  # a dead learner ends the job (the session says so); a sync cannot heal it
            lines = "; ".join(_member_line(who[k], e) for k, e in sorted(errors.items()))
            raise WeightSyncError(f"weight sync over group {name!r} failed: {lines}")
        return [values[k] for k in range(len(refs))]


def _member_line(who: str, exc: BaseException) -> str:
    line = _first_line(exc)
    return line if line.startswith(who) else f"{who}: {line}"


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """A failed remote call's own message (Ray wraps it in a traceback whose first line names only the call)."""
    cause = getattr(exc, "cause", None) or exc
    line = next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def make_weight_sync(backend: str, rt, rollout_backend: str = "native", timeout_s: float = DEFAULT_TIMEOUT_S):
    """`sync.backend` -> transport; NCCL to vLLM rollout workers goes through vLLM's weight-transfer engine."""
    if backend == "object_store":
        return ObjectStoreSync(rt)
    if backend == "nccl" and rollout_backend == "vllm":
        return CollectiveSync(rt, "vllm", timeout_s)
    if backend in ("gloo", "nccl"):
        return CollectiveSync(rt, backend, timeout_s)
    raise ValueError(f"unknown sync.backend {backend!r}: object_store, gloo or nccl")
