"""VllmRollout: what a RolloutWorker holds when `rollout.backend=vllm`.

One vLLM engine at a time: with the current drafter as its EAGLE-3 speculator
for drafted rollouts, or the target alone for target-only calls (the training
responses). vLLM fixes the speculator and K when it starts, so switching
between the two, or changing K, rebuilds the engine; new weights of the same
drafter are pushed into the running engine, which confirms the version.

Two ways in for those weights, both vLLM's weight-transfer calls: `set_drafter`
(CPU tensors from the object-store and gloo transports, pushed through shared
memory into draftopd's engine, push.py) and, on GPUs, `receive` (NCCL from the
learner's GPU, transfer.py), where this process never holds the weights. An
engine for NCCL pushes is started and warmed up by `prepare_transfer` before the
group forms (vLLM's trainer rendezvous waits five minutes at most: a join only
joins); one rebuilt later starts from a placeholder drafter and refuses drafted
calls with `NeedsWeights` until the driver pushes again.

Nothing here imports draftopd's training side (opd/): the refusal is this
module's own error, which the rollout worker turns into the driver's.
"""

from __future__ import annotations

import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path

from draftopd.messages import SamplingConfig, Trajectory


class NeedsWeights(RuntimeError):
    """The engine was restarted (another K): its drafter needs the weights pushed again."""


@dataclass
class VllmOptions:
    """Engine settings from the recipe's rollout section."""

    dtype: str = "float32"
    memory_fraction: float = 0.2
    max_model_len: int = 2048
    enforce_eager: bool = True
    seed: int = 0
    num_draft_tokens: int = 4  # K of a drafter engine started for a weight-transfer group (the rollout's)
    record: str = "stock"  # how steps are recorded: vLLM's per-request metrics, or `full` (the hook)


class VllmRollout:
    def __init__(self, target_dir: str, eos: list[int], options: VllmOptions):
        self.target_dir, self.eos, self.options = target_dir, list(eos), options
        self.engine = None
        self.config: dict | None = None
        self.state: dict | None = None
        self.version = -1
        self.engine_version = -1  # the drafter version the running engine confirmed
        self.transfer = ""  # the weight-transfer group the running engine joined (GPU pushes)
        self.pushed = False  # weights arrive by transfer: no CPU copy here, engines start from a placeholder
        self.timeout_s = 300.0
        self.items: list = []  # the drafter's manifest, for a placeholder checkpoint
        self.workdir = Path(tempfile.mkdtemp(prefix="draftopd-vllm-"))

    def set_drafter(self, config: dict, state: dict, version: int) -> int:
        """Hold these weights; push them into a running drafter engine of the same shape right away."""
        same_shape = self.config == config
        self.config, self.state, self.version = config, state, version
        if self.engine is not None and self.engine.has_drafter:
            if same_shape:
                self.engine_version = self.engine.load_drafter_state(state, version)
            else:
                self._shutdown()
        return version

    def weights(self) -> dict | None:
        """The drafter weights held here (None when they arrive by NCCL transfer, or before any)."""
        return self.state

    def holds_drafter(self) -> bool:
        return self.state is not None or (self.pushed and self.engine_version >= 0)

    # -- GPU pushes through vLLM's weight-transfer engine (transfer.py) ------------------------------

    def prepare_transfer(self, config: dict, items: list) -> None:
        """Before a transfer group forms: a drafter engine of this shape running (started and warmed up here,
        at the running engine's K or the rollout's), ready to join."""
        self.pushed, self.items = True, items
        if not self._ready_for_nccl(config):
            self.config, self.state = config, None
            k = self.engine.num_draft_tokens if self.engine else self.options.num_draft_tokens
            self._start(True, k)
            self._warm_up()

    def join_transfer(self, name, host, port, rank, size, timeout_s, config: dict, items: list) -> None:
        """Join a transfer group with the engine `prepare_transfer` started; starts nothing."""
        from draftopd.vllm_backend import transfer

        if not self._ready_for_nccl(config):
            raise RuntimeError("no drafter engine of this shape is running: prepare_transfer comes before a join")
        self.timeout_s, self.items = timeout_s, items
        transfer.join(self.engine.llm, transfer.init_info(host, port, rank, size, items), timeout_s)
        self.transfer = name

    def _ready_for_nccl(self, config: dict) -> bool:
        e = self.engine
        return e is not None and e.has_drafter and e.transfer == "nccl" and self.config == config

    def _warm_up(self) -> None:
        """One short drafted decode through the new engine (its first steps allocate and, on GPUs, compile)."""
        from draftopd.messages import SamplingConfig

        self.engine.generate([[self.eos[0]]], SamplingConfig(2, 0.0, self.engine.num_draft_tokens))

    def receive(self, config: dict, items: list, version: int) -> int:
        """This engine's end of one push; an engine stuck in a failed push is shut down (a new one is started
        for the next group)."""
        from draftopd.vllm_backend import transfer

        try:
            transfer.receive(self.engine.llm, items, self.timeout_s, version)
            self.engine.version = version
        except BaseException:
            self.transfer = ""
            self._shutdown()
            raise
        self.config, self.version, self.engine_version = config, version, version
        return version

    def leave_transfer(self) -> None:
        from draftopd.vllm_backend import transfer

        if self.engine is not None and self.transfer:
            transfer.leave(self.engine.llm)
        self.transfer = ""

    def in_transfer(self, name: str) -> bool:
        return self.engine is not None and self.transfer == name

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, with_drafter: bool) -> list[Trajectory]:
        engine = self._engine(with_drafter, sampling.num_draft_tokens)
        return engine.generate(prompts, sampling, self.engine_version if with_drafter else -1)

    def _engine(self, with_drafter: bool, k: int):
        e = self.engine
        if e is not None and e.has_drafter == with_drafter and (not with_drafter or e.num_draft_tokens == k):
            return e
        if with_drafter and self.pushed:
            self._start(True, k)  # ready for the next push, which the refusal below asks the driver for
            raise NeedsWeights(f"the vLLM engine was restarted for K={k}: its drafter needs the weights pushed again")
        if with_drafter and self.state is None:
            raise RuntimeError("a drafted rollout was asked for before any drafter weights arrived")
        return self._start(with_drafter, k)

    def _start(self, with_drafter: bool, k: int):
        """A new engine: the held weights' checkpoint (or a zero placeholder when weights arrive by transfer)."""
        from draftopd.drafters import write_checkpoint
        from draftopd.vllm_backend.engine import VllmEngine

        self._shutdown()
        drafter_dir = None
        if with_drafter:
            state = self.state if self.state is not None else _placeholder(self.items)
            drafter_dir = write_checkpoint(self.config, state, self.workdir / f"drafter-v{self.version:06d}")
        o = self.options
        self.engine = VllmEngine(
            self.target_dir,
            str(drafter_dir) if drafter_dir else None,
            self.eos,
            num_draft_tokens=k,
            dtype=o.dtype,
            max_model_len=o.max_model_len,
            memory_fraction=o.memory_fraction,
            seed=o.seed,
            enforce_eager=o.enforce_eager,
            record=o.record,
            transfer="nccl" if with_drafter and self.pushed else "shm",
            version=self.version if with_drafter and self.state is not None else -1,
        )
        self.transfer = ""
        self.engine_version = self.version if with_drafter and self.state is not None else -1
        return self.engine

    def _shutdown(self) -> None:
        if self.engine is None:
            return
        self.engine.shutdown()
        self.engine, self.transfer = None, ""
        gc.collect()


def _placeholder(items: list) -> dict:
    """Zero tensors of the drafter's manifest: what an engine starts from before its first push."""
    import torch

    return {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, shape, dtype in items}
