"""RolloutWorker: target-assisted speculative generation with the current drafter.

One rollout backend per engine behind one protocol (`RolloutBackend`): `NativeRollout` (draftopd's
plain-torch engine, the CPU default, here) and `VllmRollout` (stock vLLM, draftopd/vllm_backend/rollout.py);
both return the same Trajectory records. The worker owns what is the same for both: which weights a call
needs, the weight-sync group, chunking and prompt indices. A plain class; the Ray actor is a thin wrapper
(opd/actors.py). Every call that generates names the drafter it must use (a `WeightUpdate`), so a worker that
was restarted after a crash either fetches the weights on its first call (object store) or refuses the call for
the driver to publish again (collective sync).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from draftopd.messages import SamplingConfig, Trajectory, WeightUpdate
from draftopd.opd.weight_sync import StaleWeights


class RolloutBackend(Protocol):
    """What a rollout worker decodes with. `set_drafter` makes those weights the drafter (returns the version);
    `generate` decodes with the drafter (or the target alone) and returns one Trajectory per prompt, in order."""

    def set_drafter(self, config: dict, state: dict, version: int) -> int: ...

    def holds_drafter(self) -> bool: ...

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, with_drafter: bool) -> list: ...

    def weights(self) -> dict | None: ...


class NativeRollout:
    """draftopd's plain-torch engine: the target loaded on first use, the drafter built from its config."""

    def __init__(self, target_path: str, aux_layer_ids: list[int], dtype: str, eos: list[int], num_threads: int):
        self.target_path, self.aux_layer_ids, self.dtype = target_path, aux_layer_ids, dtype
        self.eos, self.num_threads = eos, num_threads
        self.target = self.drafter = None
        self.version = -1

    def setup(self) -> None:
        if self.target is not None:
            return
        from draftopd.loading import load_target

        torch.set_num_threads(self.num_threads)
        self.target = load_target(self.target_path, self.aux_layer_ids, self.dtype)

    def set_drafter(self, config: dict, state: dict, version: int) -> int:
        from draftopd.drafters import detect_kind, family, load_state

        self.setup()
        if self.drafter is None or self.drafter.config() != config:
            self.drafter = family(detect_kind(config)).from_state(config, state, self.target)
        else:
            load_state(self.drafter, state)
        self.drafter.eval()
        self.version = version
        return version

    def holds_drafter(self) -> bool:
        return self.drafter is not None

    def generate(self, prompts, sampling: SamplingConfig, with_drafter: bool) -> list[Trajectory]:
        from draftopd.engine.speculative import SpeculativeEngine

        self.setup()
        drafter = self.drafter if with_drafter else None
        version = self.version if drafter is not None else -1
        return SpeculativeEngine(self.target, drafter, self.eos).generate(prompts, sampling, policy_version=version)

    def weights(self) -> dict | None:
        return self.drafter.state() if self.drafter is not None else None


class RolloutWorker:
    """Holds one rollout backend; it is built on first use so the constructor stays cheap."""

    def __init__(
        self,
        target_path: str,
        aux_layer_ids: list[int],
        dtype: str,
        eos: list[int],
        num_threads: int = 1,
        index: int = 0,
        backend: str = "native",
        vllm_options=None,
    ):
        self.target_path, self.aux_layer_ids, self.dtype = target_path, aux_layer_ids, dtype
        self.eos, self.num_threads, self.index = eos, num_threads, index
        self.backend, self.vllm_options = backend, vllm_options
        self._engine = None
        self.policy_version = -1
        self.group = None  # (name, transport, process group) of a collective weight sync
        self.spans: list[tuple[float, float]] = []  # wall-clock (start, end) of each generate call, until taken

    @property
    def engine(self) -> RolloutBackend:
        if self._engine is None:
            self._engine = self._build()
        return self._engine

    def _build(self) -> RolloutBackend:
        if self.backend == "native":
            return NativeRollout(self.target_path, self.aux_layer_ids, self.dtype, self.eos, self.num_threads)
        if self.backend == "vllm":
            from draftopd.loading import resolve_target_path
            from draftopd.vllm_backend.rollout import VllmOptions, VllmRollout

            opts = self.vllm_options or VllmOptions(dtype=self.dtype)
            return VllmRollout(str(resolve_target_path(self.target_path)), self.eos, opts)
        raise ValueError(f"unknown rollout backend {self.backend!r}: native or vllm")

    def load_weights(self, drafter_config: dict, state: dict[str, torch.Tensor], version: int) -> int:
        """Switch to the given drafter weights (between requests); returns the version now in use."""
        if version == self.policy_version and self.engine.holds_drafter():
            return version
        self.policy_version = self.engine.set_drafter(drafter_config, state, version)
        return self.policy_version

    def apply_update(self, update: WeightUpdate) -> int:
        """Make `update` the drafter in use; returns the version now held. See WeightUpdate for the rules."""
        if update.policy_version == self.policy_version and self.engine.holds_drafter():
            return self.policy_version
        if update.state_ref is None:
            raise StaleWeights(
                f"rollout worker {self.index} holds policy version {self.policy_version}, not "
                f"{update.policy_version} (broadcast over group {update.group!r} before it joined)"
            )
        from draftopd.opd.runtime import resolve

        return self.load_weights(update.drafter_config, resolve(update.state_ref), update.policy_version)

    # -- the receiving end of a collective weight sync (opd/weight_sync.py) -------------------------

    def prepare_weight_group(self, transport: str, layout=None) -> None:
        """Before a group forms: with the `vllm` transport, a drafter engine for `layout` (drafter config,
        manifest) started and warmed up now, so that the join itself only joins (vLLM's rendezvous waits five
        minutes at most for every member)."""
        if transport == "vllm":
            self.engine.prepare_transfer(*layout)

    def join_weight_group(
        self, name: str, rank: int, transport: str, host: str, port: int, size: int, timeout_s, layout=None
    ):
        """Leave the old group (a worker that was not restarted is still in it), then join `name` as `rank`.

        With the `vllm` transport the engine itself joins (vLLM's weight-transfer engine), with the engine
        `prepare_weight_group` started for `layout`."""
        self.leave_weight_group()
        if transport == "vllm":
            self.engine.join_transfer(name, host, port, rank, size, timeout_s, *layout)
            self.group = (name, transport, None)
            return
        from draftopd.opd.weight_sync import TorchGroup, join_group

        group = TorchGroup(name, transport, join_group(transport, host, port, rank, size, timeout_s), timeout_s)
        self.group = (name, transport, group)

    def leave_weight_group(self) -> None:
        old, self.group = self.group, None
        if old is None:
            return
        if old[1] == "vllm":
            self.engine.leave_transfer()
        else:
            old[2].close()

    def weight_group(self) -> str:
        if self.group and self.group[1] == "vllm" and not self.engine.in_transfer(self.group[0]):
            self.group = None  # the engine was rebuilt (another K, target-only): it left the group
        return self.group[0] if self.group else ""

    def receive_weights(self, update: WeightUpdate, items: list) -> int:
        """This worker's end of a broadcast. A worker restarted since the group formed is not in it: it says so
        at once (the driver's publish then fails and forms a new group) instead of waiting for tensors."""
        from draftopd.opd.weight_sync import WeightSyncError, sync_failure

        who = f"rollout worker {self.index}"
        if self.weight_group() != update.group:
            raise WeightSyncError(f"{who} is not in weight-sync group {update.group!r} (restarted since it formed?)")
        name, transport, group = self.group
        try:
            if transport == "vllm":
                self.policy_version = self.engine.receive(update.drafter_config, items, update.policy_version)
                return self.policy_version
            state = group.receive(items)
        except Exception as exc:
            self.leave_weight_group()
            raise sync_failure(who, name, exc) from None
        return self.load_weights(update.drafter_config, state, update.policy_version)

    def weights(self) -> dict | None:
        """The drafter weights this worker decodes with (tensors), None before the first publish."""
        return self._engine.weights() if self._engine is not None else None

    def generate(
        self,
        prompts: list[list[int]],
        prompt_indices: list[int],
        sampling: SamplingConfig,
        update: WeightUpdate | None,
        batch_size: int = 8,
    ) -> list[Trajectory]:
        """Decode `prompts` with the drafter named by `update` (None: the target alone), `batch_size` at a time
        (for vLLM, which batches by itself, chunks keep the seeds per chunk)."""
        start = time.time()
        if update is not None:
            self.apply_update(update)
        out: list[Trajectory] = []
        for i in range(0, len(prompts), batch_size):
            chunk = self._generate(prompts[i : i + batch_size], sampling, update is not None)
            for t, idx in zip(chunk, prompt_indices[i : i + batch_size]):
                t.prompt_index = idx
            out.extend(chunk)
        self.spans.append((start, time.time()))
        return out

    def take_spans(self) -> list[tuple[float, float]]:
        """The busy spans since the last call (the driver's idle shares: opd/pipeline.py)."""
        spans, self.spans = self.spans, []
        return spans

    def _generate(self, prompts, sampling, with_drafter: bool) -> list[Trajectory]:
        from draftopd.vllm_backend.rollout import NeedsWeights  # light: vLLM is imported only by its engine

        try:
            return self.engine.generate(prompts, sampling, with_drafter)
        except NeedsWeights as exc:  # a new engine (weights by transfer) left the group: the driver publishes again
            self.policy_version, self.group = -1, None
            raise StaleWeights(str(exc)) from None

    def pid(self) -> int:
        import os

        return os.getpid()
