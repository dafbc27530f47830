"""The engines `draftopd eval` decodes with, chosen by `--backend native|vllm`, one per K (0: the target alone).

Both kinds answer `generate(prompts, sampling)` with the same Trajectory records.
Native engines are cheap views over the loaded torch models. vLLM fixes the
speculator and K when it starts, so each K gets its own `vllm.LLM`, built on
first use and kept for the command's lifetime; they share `memory_fraction`. It stands here, above both
engines, so that the native engine's room (engine/) never imports the vLLM backend built on it.
"""

from __future__ import annotations

BACKENDS = ("native", "vllm")


class EngineSet:
    def __init__(
        self,
        backend: str,
        eos: list[int],
        *,
        target=None,
        drafter=None,
        target_path: str = "",
        drafter_path: str = "",
        num_engines: int = 1,
        dtype: str = "float32",
        memory_fraction: float = 0.2,
        record: str = "stock",
    ):
        """`record`: how a vLLM engine records steps (vllm_backend/engine.py): `stock` (vLLM's per-request
        metrics, enough for tau) or `full` (the recording hook: every drafted token and both models' scores)."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: {', '.join(BACKENDS)}")
        self.backend, self.eos = backend, list(eos)
        self.target, self.drafter = target, drafter
        self.target_path, self.drafter_path, self.dtype = target_path, drafter_path, dtype
        self.memory_fraction = memory_fraction / max(1, num_engines)
        self.record = record
        self.vllm: dict[int, object] = {}

    def get(self, k: int):
        """An engine drafting `k` tokens per step with the drafter, or the target alone for k = 0."""
        if self.backend == "native":
            from draftopd.engine.speculative import SpeculativeEngine

            return SpeculativeEngine(self.target, self.drafter if k else None, self.eos)
        if k not in self.vllm:
            from draftopd.loading import resolve_target_path
            from draftopd.vllm_backend.engine import VllmEngine

            self.vllm[k] = VllmEngine(
                str(resolve_target_path(self.target_path)),
                self.drafter_path if k else None,
                self.eos,
                num_draft_tokens=k or 1,
                dtype=self.dtype,
                memory_fraction=self.memory_fraction,
                record=self.record,
            )
        return self.vllm[k]

    def close(self) -> None:
        for e in self.vllm.values():
            e.shutdown()
        self.vllm.clear()
