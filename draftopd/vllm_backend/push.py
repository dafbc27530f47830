"""The sender's end of a drafter push on one host, through vLLM's weight-transfer calls (shm_engine.py).

A push is vLLM's three worker calls, `start_draft_weight_update`, `update_weights` (one chunk naming a
safetensors file in shared memory) and `finish_weight_update`, then the version label vLLM attaches to every
output (`set_weight_version`, read back per request from `CompletionOutput.weight_versions`) and a fresh
prefix cache (cached blocks hold states the old drafter consumed). Before anything is written, the drafter is
checked against the one the engine started with: same tensor names, shapes and dtypes (so a drafter for
another vocabulary or shape is refused in one line). Only the drafter's own tensors are sent: its checkpoint
holds no copy of the target's embedding or head, and the engine drops any shared one that equals the target's.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from draftopd.vllm_backend.plugin import BACKEND

CONFIG = {"backend": BACKEND}  # vLLM's weight_transfer_config for an engine that takes pushes on CPU


class PushMismatch(ValueError):
    """A drafter whose tensors are not the running engine's drafter's (another vocabulary or shape)."""


def manifest(tensors: dict) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype name) of every tensor, by name."""
    return [(k, tuple(tensors[k].shape), str(tensors[k].dtype).removeprefix("torch.")) for k in sorted(tensors)]


def check_same_drafter(expected: list, tensors: dict) -> None:
    """PushMismatch, in one line, unless `tensors` has exactly the manifest `expected`."""
    got = manifest(tensors)
    if got == expected:
        return
    want, have = dict((n, (s, d)) for n, s, d in expected), dict((n, (s, d)) for n, s, d in got)
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    differ = [n for n in sorted(set(want) & set(have)) if want[n] != have[n]]
    if differ:
        n = differ[0]
        why = f"{n} is {list(have[n][0])} {have[n][1]}, the engine's drafter has {list(want[n][0])} {want[n][1]}"
    else:
        why = f"tensors missing {missing[:3]}, unknown {extra[:3]}"
    raise PushMismatch(f"refused before sending: this drafter is not the running engine's ({why})")


def shm_dir() -> Path:
    """Where push files go: /dev/shm when this host has it (memory, not disk), else the temporary directory."""
    return (
        Path("/dev/shm")
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else Path(tempfile.gettempdir())
    )


def write_push(tensors: dict, version: int | None = None) -> tuple[Path, dict]:
    """The push file and the `update_info` that names it (the file is the caller's to remove)."""
    from safetensors.torch import save_file

    fd, name = tempfile.mkstemp(prefix="draftopd-push-", suffix=".safetensors", dir=shm_dir())
    os.close(fd)
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(cpu, name)
    items = manifest(cpu)
    info = {"path": name, "names": [n for n, _, _ in items], "shapes": [list(s) for _, s, _ in items]}
    info["dtype_names"], info["version"] = [d for _, _, d in items], version
    return Path(name), info


def push(llm, tensors: dict, version: int, timeout_s: float | None = None) -> None:
    """One push into an offline `vllm.LLM` (its workers run shm_engine's engine), labelled `version`."""
    path, info = write_push(tensors, version)
    try:
        llm.collective_rpc("start_draft_weight_update", timeout=timeout_s)
        try:
            llm.collective_rpc("update_weights", timeout=timeout_s, kwargs={"update_info": info})
        finally:
            llm.collective_rpc("finish_weight_update", timeout=timeout_s)  # ends the update session either way
    finally:
        path.unlink(missing_ok=True)
    llm.llm_engine.set_weight_version(str(version))
    llm.reset_prefix_cache()


async def push_async(engine, tensors: dict, version: int) -> bool:
    """The same into vLLM's `AsyncLLM` (the server's engine), whose requests keep arriving: generation is paused
    around the three calls (vLLM's `pause_generation(mode="keep")`: requests in flight freeze and resume after,
    as vLLM's RL weight updates do; the draft model is mid-reload between the calls), the version label is set
    while paused. Returns whether the prefix cache was reset (vLLM refuses while requests hold blocks: the
    caller retries)."""
    import asyncio

    path, info = await asyncio.get_running_loop().run_in_executor(None, write_push, tensors, version)
    await engine.pause_generation(mode="keep", clear_cache=False)
    try:
        await engine.collective_rpc("start_draft_weight_update")
        try:
            await engine.collective_rpc("update_weights", kwargs={"update_info": info})
        finally:
            await engine.collective_rpc("finish_weight_update")
        await engine.update_weight_version(str(version))
    finally:
        await engine.resume_generation()
        path.unlink(missing_ok=True)
    return bool(await engine.reset_prefix_cache())
