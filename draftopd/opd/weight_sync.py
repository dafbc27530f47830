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

Under ZeRO-3 every learner rank takes part in gathering the parameters, so
publish always calls all ranks.
"""

from __future__ import annotations

import datetime
import itertools

import torch

from draftopd.messages import WeightUpdate


class StaleWeights(RuntimeError):
    """A rollout worker was asked to generate with weights it does not hold and cannot fetch."""


# -- the two ends of a collective group (used inside learner and worker actors) --------------------


def join_group(backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0):
    """A process group over its own TCPStore (rank 0 hosts the store); never touches torch's default group."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"unknown collective backend {backend!r} (gloo or nccl)")


def manifest(state: dict[str, torch.Tensor]) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype name) of every tensor in broadcast order: what a receiver allocates."""
    return [(k, tuple(state[k].shape), str(state[k].dtype).removeprefix("torch.")) for k in sorted(state)]


def broadcast_state(group, backend: str, items: list[tuple[str, tuple, str]], state: dict | None) -> dict:
    """Broadcast from group rank 0 (which passes `state`) to the others (which pass None); returns CPU tensors.

    bool buffers travel as uint8 (neither gloo nor NCCL reduces bools); NCCL needs CUDA tensors.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    out = {}
    for name, shape, dtype_name in items:
        dtype = getattr(torch, dtype_name)
        wire = torch.uint8 if dtype == torch.bool else dtype
        if state is not None:
            t = state[name].to(device=device, dtype=wire).contiguous()
        else:
            t = torch.empty(shape, dtype=wire, device=device)
        group.broadcast(t, 0).wait()
        out[name] = t.to("cpu", dtype=dtype)
    return out


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
    def __init__(self, rt, backend: str, timeout_s: float = 300.0):
        super().__init__(rt)
        self.backend, self.timeout_s = backend, timeout_s
        self.group, self.items = "", []
        self._names = (f"weights-{i}" for i in itertools.count())

    def _form_group(self, learners: list, workers: list) -> None:
        """A fresh group: learner rank 0 is rank 0 (and hosts the store), workers follow."""
        get = self.rt.get
        self.items = get([learner.weight_manifest.remote() for learner in learners])[0]
        host, port = get(learners[0].free_port.remote())
        name, n = next(self._names), len(workers) + 1
        args = (self.backend, host, port, n, self.timeout_s)
        joins = [learners[0].join_weight_group.remote(name, 0, *args)]
        joins += [w.join_weight_group.remote(name, r + 1, *args) for r, w in enumerate(workers)]
        get(joins)
        self.group = name

    def publish(self, learners, workers, drafter_config, version):
        get = self.rt.get
        if not self.group or get([w.weight_group.remote() for w in workers]) != [self.group] * len(workers):
            self._form_group(learners, workers)
        update = WeightUpdate(version, drafter_config, group=self.group)
        sends = [learner.broadcast_weights.remote(self.group, self.items) for learner in learners]
        held = get([w.receive_weights.remote(update, self.items) for w in workers])
        get(sends)
        assert held == [version] * len(workers), held
        return update


def make_weight_sync(backend: str, rt) -> WeightSync:
    if backend == "object_store":
        return ObjectStoreSync(rt)
    if backend in ("gloo", "nccl"):
        return CollectiveSync(rt, backend)
    raise ValueError(f"unknown sync.backend {backend!r}: object_store, gloo or nccl")
