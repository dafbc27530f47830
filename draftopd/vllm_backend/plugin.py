"""draftopd's vLLM general plugin: registers the CPU weight-transfer engine with vLLM's own factory.

vLLM loads every `vllm.general_plugins` entry point (pyproject.toml) in its engine and worker processes
(`vllm/plugins/__init__.py::load_general_plugins`), so an engine built by draftopd and a stock `vllm serve` on
the same host both know `weight_transfer_config={"backend": "draftopd_shm"}`. Every weight-transfer engine vLLM
0.32 ships is CUDA-only; this one moves a drafter through shared memory on one host (shm_engine.py). Plugins
may be loaded more than once per process: registering again is a no-op. This module imports vLLM only inside
`register` and nothing of draftopd's training side.
"""

from __future__ import annotations

BACKEND = "draftopd_shm"
ENGINE_MODULE = "draftopd.vllm_backend.shm_engine"
ENGINE_CLASS = "SharedMemoryWeightTransferEngine"


def register() -> None:
    """The entry point: `WeightTransferEngineFactory.register_engine` under BACKEND, lazily (by module path)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError:  # already registered in this process (plugins load once per process, sometimes twice)
        pass
