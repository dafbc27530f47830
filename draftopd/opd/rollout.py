"""RolloutWorker: target-assisted speculative generation with the current drafter.

Two engines behind one interface: `native` (draftopd's plain-torch engine, the
CPU default) and `vllm` (stock vLLM with the recording hook, see
draftopd/vllm_backend); both return the same Trajectory records. A plain
class; the Ray actor is a thin wrapper (opd/actors.py). Every call that
generates names the drafter it must use (a `WeightUpdate`), so a worker that was
restarted after a crash either fetches the weights on its first call (object
store) or refuses the call for the driver to publish again (collective sync).
"""

from __future__ import annotations

import torch

from draftopd.engine.speculative import SpeculativeEngine
from draftopd.messages import SamplingConfig, Trajectory, WeightUpdate
from draftopd.opd.weight_sync import StaleWeights


class RolloutWorker:
    """Holds the target and a drafter; `setup` loads models lazily so the constructor stays cheap."""

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
        self.vllm = None  # VllmRollout, built on the first call with backend vllm
        self.target = None
        self.drafter = None
        self.policy_version = -1
        self.group = None  # (name, backend, process group) of a collective weight sync

    def setup(self) -> None:
        if self.target is not None:
            return
        from draftopd.loading import load_target

        torch.set_num_threads(self.num_threads)
        self.target = load_target(self.target_path, self.aux_layer_ids, self.dtype)

    def load_weights(self, drafter_config: dict, state: dict[str, torch.Tensor], version: int) -> int:
        """Switch to the given drafter weights (between requests); returns the version now in use."""
        if version == self.policy_version and self._has_drafter():
            return version
        if self.backend == "vllm":
            self.policy_version = self._vllm().set_drafter(drafter_config, state, version)
            return self.policy_version
        from draftopd.drafters import detect_kind, family, load_state

        self.setup()
        if self.drafter is None or self.drafter.config() != drafter_config:
            cls = family(detect_kind(drafter_config))
            self.drafter = cls.from_state(drafter_config, state, self.target)
        else:
            load_state(self.drafter, state)
        self.drafter.eval()
        self.policy_version = version
        return version

    def apply_update(self, update: WeightUpdate) -> int:
        """Make `update` the drafter in use; returns the version now held. See WeightUpdate for the rules."""
        if update.policy_version == self.policy_version and self._has_drafter():
            return self.policy_version
        if update.state_ref is None:
            raise StaleWeights(
                f"rollout worker {self.index} holds policy version {self.policy_version}, not "
                f"{update.policy_version} (broadcast over group {update.group!r} before it joined)"
            )
        from draftopd.opd.runtime import resolve

        return self.load_weights(update.drafter_config, resolve(update.state_ref), update.policy_version)

    # -- the receiving end of a collective weight sync (opd/weight_sync.py) -------------------------

    def join_weight_group(
        self, name: str, rank: int, transport: str, host: str, port: int, size: int, timeout_s, layout=None
    ):
        """Leave the old group (a worker that was not restarted is still in it), then join `name` as `rank`.

        With the `vllm` transport the engine itself joins (vLLM's weight-transfer engine); `layout`
        (drafter config, manifest) starts a drafter engine for it when there is none yet.
        """
        self.leave_weight_group()
        if transport == "vllm":
            self._vllm().join_transfer(name, host, port, rank, size, timeout_s, *layout)
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
            self.vllm.leave_transfer()
        else:
            old[2].close()

    def weight_group(self) -> str:
        if self.group and self.group[1] == "vllm" and not self.vllm.in_transfer(self.group[0]):
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
                self.policy_version = self.vllm.receive(update.drafter_config, items, update.policy_version)
                return self.policy_version
            state = group.receive(items)
        except Exception as exc:
            self.leave_weight_group()
            raise sync_failure(who, name, exc) from None
        return self.load_weights(update.drafter_config, state, update.policy_version)

    def weights(self) -> dict | None:
        """The drafter weights this worker decodes with (tensors), None before the first publish."""
        if self.backend == "vllm":
            return self.vllm.state if self.vllm is not None else None
        return self.drafter.state() if self.drafter is not None else None

    def _has_drafter(self) -> bool:
        return self.vllm.holds_drafter() if self.backend == "vllm" and self.vllm else self.drafter is not None

    def _vllm(self):
        if self.vllm is None:
            from draftopd.loading import resolve_target_path
            from draftopd.vllm_backend.rollout import VllmOptions, VllmRollout

            opts = self.vllm_options or VllmOptions(dtype=self.dtype)
            self.vllm = VllmRollout(str(resolve_target_path(self.target_path)), self.eos, opts)
        return self.vllm

    def generate(
        self,
        prompts: list[list[int]],
        prompt_indices: list[int],
        sampling: SamplingConfig,
        update: WeightUpdate | None,
        batch_size: int = 8,
    ) -> list[Trajectory]:
        """Decode `prompts` with the drafter named by `update` (None: the target alone)."""
        if update is not None:
            self.apply_update(update)
        if self.backend == "vllm":
            return self._generate_vllm(prompts, prompt_indices, sampling, update is not None, batch_size)
        self.setup()
        drafter = self.drafter if update is not None else None
        engine = SpeculativeEngine(self.target, drafter, self.eos)
        version = self.policy_version if drafter is not None else -1
        out: list[Trajectory] = []
        for i in range(0, len(prompts), batch_size):
            chunk = engine.generate(prompts[i : i + batch_size], sampling, policy_version=version)
            for t, idx in zip(chunk, prompt_indices[i : i + batch_size]):
                t.prompt_index = idx
            out.extend(chunk)
        return out

    def _generate_vllm(self, prompts, prompt_indices, sampling, with_drafter: bool, batch_size: int):
        out: list[Trajectory] = []
        for i in range(0, len(prompts), batch_size):  # vLLM batches by itself; chunks keep the seeds per chunk
            try:
                chunk = self._vllm().generate(prompts[i : i + batch_size], sampling, with_drafter)
            except StaleWeights:  # a new engine (weights by transfer) left the group: the driver publishes again
                self.policy_version, self.group = -1, None
                raise
            for t, idx in zip(chunk, prompt_indices[i : i + batch_size]):
                t.prompt_index = idx
            out.extend(chunk)
        return out

    def pid(self) -> int:
        import os

        return os.getpid()
