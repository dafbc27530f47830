"""The `vllm` backend of `draftopd prepare-data`: the target answers the pool's prompts in stock vLLM.

One stock vLLM job (vllm_backend/stock.py) in its own process, with the
`--vllm-python` given or this Python: one batch per pending shard, seeded by
its first row. The job's process writes a line per finished shard and each
becomes a shard as it appears, so an interrupted run keeps the shards it
finished.
"""

from __future__ import annotations

import sys
from dataclasses import asdict


def generate_vllm(s, target_dir: str, shards: dict[int, list[list[int]]], eos: list[int], on_shard) -> None:
    """Run the job on every pending shard; `on_shard(index, outputs)` as each shard's line arrives."""
    from draftopd.data.sources import PrepareError
    from draftopd.vllm_backend.stock import LlmSettings, VllmJobError, run_job

    llm = LlmSettings(
        target_dir, dtype=s.dtype, seed=s.seed, memory_fraction=s.memory_fraction, enforce_eager=s.vllm_eager
    )
    batches = [
        {
            "index": i,
            "prompts": prompts,
            "temperature": s.temperature,
            "max_new_tokens": s.max_new_tokens,
            "seed": s.seed + i * s.shard_size,
        }
        for i, prompts in shards.items()
    ]
    job = {"llm": asdict(llm), "eos": eos, "batches": batches, "progress": True}

    def on_line(row: dict) -> None:
        if "index" in row:
            on_shard(row["index"], [tuple(o) for o in row["outputs"]])

    print(f"vLLM backend: {len(shards)} shards in {s.vllm_python or sys.executable}")
    try:
        run_job(job, s.vllm_python, on_line=on_line, workdir=s.out, show_log=True)
    except VllmJobError as exc:
        raise PrepareError(
            f"the vLLM backend exited with status {exc.status}; finished shards are kept, rerun to resume"
        ) from None
