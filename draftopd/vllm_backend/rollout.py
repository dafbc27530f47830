"""VllmRollout: what a RolloutWorker holds when `rollout.backend=vllm`.

One vLLM engine at a time: with the current drafter as its EAGLE-3 speculator
for drafted rollouts, or the target alone for target-only calls (the training
responses). vLLM fixes the speculator and K when it starts, so switching
between the two, or changing K, rebuilds the engine; new weights of the same
drafter are pushed into the running engine, which confirms the version.
"""

from __future__ import annotations

import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path

from draftopd.messages import SamplingConfig, Trajectory


@dataclass
class VllmOptions:
    """Engine settings from the recipe's rollout section."""

    dtype: str = "float32"
    memory_fraction: float = 0.2
    max_model_len: int = 2048
    enforce_eager: bool = True
    seed: int = 0


class VllmRollout:
    def __init__(self, target_dir: str, eos: list[int], options: VllmOptions):
        self.target_dir, self.eos, self.options = target_dir, list(eos), options
        self.engine = None
        self.config: dict | None = None
        self.state: dict | None = None
        self.version = -1
        self.engine_version = -1  # the drafter version the running engine confirmed
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

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, with_drafter: bool) -> list[Trajectory]:
        engine = self._engine(with_drafter, sampling.num_draft_tokens)
        return engine.generate(prompts, sampling, self.engine_version if with_drafter else -1)

    def _engine(self, with_drafter: bool, k: int):
        e = self.engine
        if e is not None and e.has_drafter == with_drafter and (not with_drafter or e.num_draft_tokens == k):
            return e
        from draftopd.drafters import write_checkpoint
        from draftopd.vllm_backend.engine import VllmEngine

        self._shutdown()
        drafter_dir = None
        if with_drafter:
            if self.state is None:
                raise RuntimeError("a drafted rollout was asked for before any drafter weights arrived")
            drafter_dir = write_checkpoint(self.config, self.state, self.workdir / f"drafter-v{self.version:06d}")
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
        )
        self.engine_version = self.version if with_drafter else -1
        return self.engine

    def _shutdown(self) -> None:
        if self.engine is None:
            return
        self.engine.shutdown()
        self.engine = None
        gc.collect()
