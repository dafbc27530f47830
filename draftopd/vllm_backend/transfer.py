"""Drafter pushes on GPUs through vLLM's weight-transfer engine: NCCL from learner rank 0 into each draft model.

vLLM 0.32 ships the receiving end (`weight_transfer_config={"backend": "nccl"}`;
the worker methods `init_weight_transfer_engine`, `start_draft_weight_update`,
`update_weights`, `finish_weight_update`, reached here with `collective_rpc`) and
the trainer's helpers (`nccl_common.trainer_init`, the packed broadcast). The
weights go from the learner's GPU into the draft model vLLM's runner returns from
`get_draft_model` (either model runner), with no CPU copy, and the rollout actor
itself opens no CUDA context: only vLLM's own worker process touches the GPU.

The packed buffer holds the whole drafter, so vLLM unpacks it into one
`load_weights` call: DFlash's draft model rebuilds its fused context K/V weights at
the end of each call, and must see every layer loaded by then.

GPU only (NCCL); the CPU twin is draftopd's shared-memory weight-transfer engine
(shm_engine.py, push.py), fed by the gloo or object-store transports, through the
same three worker calls. Every wait has the group's timeout; a push
that times out leaves the engine unusable, and the worker then drops it.
"""

from __future__ import annotations

import threading

import torch

NUM_BUFFERS = 2


def buffer_bytes(items: list) -> int:
    """The drafter's size in bytes (manifest: name, shape, dtype name), rounded up to a MiB: one packed chunk."""
    total = 0
    for _, shape, dtype_name in items:
        numel = 1
        for d in shape:
            numel *= d
        total += numel * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
    mib = 2**20
    return max(mib, -(-total // mib) * mib)


def init_info(host: str, port: int, rank: int, size: int, items: list) -> dict:
    """What an engine's workers join with: trainer at rank 0, this engine's (tensor-parallel 1) worker at `rank`."""
    return {
        "master_address": host,
        "master_port": port,
        "rank_offset": rank,
        "world_size": size,
        "packed": True,
        "packed_buffer_size_bytes": buffer_bytes(items),
        "packed_num_buffers": NUM_BUFFERS,
    }


def update_info(items: list) -> dict:
    """vLLM's NCCL update info: names, dtype names and shapes in broadcast order (the manifest's)."""
    return {
        "names": [n for n, _, _ in items],
        "dtype_names": [d for _, _, d in items],
        "shapes": [list(s) for _, s, _ in items],
    }


def with_deadline(fn, timeout_s: float, what: str, on_timeout=None):
    """`fn()`, or TimeoutError after `timeout_s` (after `on_timeout()`, which should unblock it: an NCCL abort).

    NCCL waits on a GPU stream without a timeout of its own: a peer that died would hold the caller forever.
    """
    result, error = [], []

    def run():
        try:
            result.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        if on_timeout is not None:
            on_timeout()
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s")
    if error:
        raise error[0]
    return result[0] if result else None


# -- learner rank 0's end ------------------------------------------------------------------------


class TrainerGroup:
    """Learner rank 0 in a transfer group: vLLM's trainer-side NCCL communicator on this rank's GPU."""

    def __init__(self, name: str, comm, timeout_s: float):
        self.name, self.comm, self.timeout_s = name, comm, timeout_s

    @classmethod
    def join(cls, name: str, host: str, port: int, size: int, timeout_s: float) -> TrainerGroup:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        rendezvous = {"master_address": host, "master_port": port, "world_size": size}
        comm = with_deadline(lambda: trainer_init(rendezvous, rank=0), timeout_s, f"joining group {name!r}")
        return cls(name, comm, timeout_s)

    def send(self, state: dict, items: list) -> None:
        """The packed broadcast vLLM's workers unpack (same buffer size on both ends), from the GPU tensors."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        pairs = ((name, state[name].contiguous()) for name, _, _ in items)

        def run():
            packed_nccl_broadcast_producer(
                iterator=pairs,
                group=self.comm,
                src=0,
                post_iter_func=lambda item: item[1],
                buffer_size_bytes=buffer_bytes(items),
                num_buffers=NUM_BUFFERS,
            )
            torch.cuda.current_stream().synchronize()

        with_deadline(run, self.timeout_s, f"broadcast over group {self.name!r}", self.close)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()  # ncclCommAbort: returns even when a peer is gone
            self.comm = None


# -- an engine's end (called in the rollout actor, on its `vllm.LLM`) --------------------------------


def join(llm, info: dict, timeout_s: float) -> None:
    llm.collective_rpc("init_weight_transfer_engine", timeout=timeout_s, kwargs={"init_info": info})


def receive(llm, items: list, timeout_s: float, version: int) -> None:
    """One push into the engine's draft model (vLLM's layerwise reload around it), labelled `version` (vLLM's
    weight version, which every output then carries), then a fresh prefix cache."""
    llm.collective_rpc("start_draft_weight_update", timeout=timeout_s)
    llm.collective_rpc("update_weights", timeout=timeout_s, kwargs={"update_info": update_info(items)})
    llm.collective_rpc("finish_weight_update", timeout=timeout_s)
    llm.llm_engine.set_weight_version(str(version))
    llm.reset_prefix_cache()  # cached blocks hold states the old drafter consumed


def leave(llm) -> None:
    llm.collective_rpc("shutdown_weight_transfer_engine", timeout=60)
