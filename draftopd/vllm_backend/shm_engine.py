"""A vLLM weight-transfer engine for CPUs: a drafter pushed through a safetensors file in shared memory.

Registered with vLLM's `WeightTransferEngineFactory` by the general plugin (plugin.py) as `draftopd_shm`, and
driven by vLLM's own worker methods: `start_draft_weight_update` (layerwise reload set up on the draft model,
as vLLM's checkpoint-format engines do), `update_weights` (one chunk: the whole drafter, in checkpoint names,
loaded by the draft model's own `load_weights` in one call) and `finish_weight_update` (vLLM's layerwise
finalize, which redoes the CPU backend's weight repacking). The sender (push.py) writes the file on the same
host (/dev/shm where it exists) and names it in the update info, so the push works over `collective_rpc` and
over a stock `vllm serve`'s HTTP routes alike. Every engine vLLM 0.32 ships is CUDA-only.

What the engine checks, because a wrong push would serve silently:
* the file holds exactly the tensors the update info names, with those shapes and dtypes;
* vLLM's proposer shares the target's embedding (and for some drafters its head) with the draft model: a
  tensor for a shared module must equal the target's and is then dropped (a push never writes the target);
  one that differs is refused before anything is loaded;
* after finish, no parameter of the draft model (nor of the target it shares with) is left on `meta`.

One post-load step is redone here, for a measured reason: DFlash's draft model builds fused copies of its
context K/V projection weights at the end of `load_weights` from `qkv_proj.weight`, but on CPU vLLM packs each
linear weight as soon as its layer is loaded and leaves an empty `weight` behind, so after a reload the fused
copy would be empty (vLLM's first load builds it before any packing). The engine rebuilds it with the model's
own `_build_fused_kv_buffers` from the received q/k/v tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

VERSION_ATTR = "draftopd_version"  # hook.py reads it (the same name there; neither module imports the other)
QKV = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")


class PushRefused(ValueError):
    """A push that would load the wrong tensors, or change the target's shared ones; nothing was loaded."""


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: every update names its own file on this host."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One push. Invariant: `path` is a safetensors file on this host holding exactly `names`, with `shapes`
    and `dtype_names` in the same order."""

    path: str
    names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    version: int | None = None  # the drafter version, left on the draft model for the recording hook


class SharedMemoryWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self._received: dict[str, torch.Tensor] = {}

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._received, self._version = {}, None
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        """vLLM's, without its device synchronisation, which raises where there is no accelerator (a CPU)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from safetensors.torch import load_file

        tensors = load_file(update_info.path, device="cpu")
        _check_manifest(tensors, update_info)
        tensors = _drop_shared(self.model, self._default_model, tensors)
        device = next((p.device for p in self._default_model.parameters() if p.device.type != "meta"), self.device)
        tensors = {k: v.to(device) for k, v in tensors.items()}
        self.model.load_weights(iter(tensors.items()))  # one call with every layer: DFlash's post-load sees all
        self._received.update(tensors)
        self._version = update_info.version

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        _rebuild_dflash_fused_kv(self.model, self._received)
        self._received = {}
        if getattr(self, "_version", None) is not None:
            setattr(self.model, VERSION_ATTR, self._version)
        for who, model in (("draft model", self.model), ("target", self._default_model)):
            left = [n for n, p in model.named_parameters() if p.is_meta]
            if left:
                raise RuntimeError(f"after the push, the {who}'s parameters {left[:4]} are still on meta")

    def shutdown(self) -> None:
        self._received = {}


def _check_manifest(tensors: dict, info: ShmUpdateInfo) -> None:
    if sorted(tensors) != sorted(info.names):
        missing, extra = sorted(set(info.names) - set(tensors)), sorted(set(tensors) - set(info.names))
        raise PushRefused(f"the pushed file lacks {missing[:3]} and has {extra[:3]} beyond the update's names")
    for name, shape, dtype in zip(info.names, info.shapes, info.dtype_names):
        t = tensors[name]
        if list(t.shape) != list(shape) or str(t.dtype).removeprefix("torch.") != dtype:
            raise PushRefused(f"{name}: the file holds {list(t.shape)} {t.dtype}, the update names {shape} {dtype}")


def _shared_prefixes(draft: torch.nn.Module, target: torch.nn.Module) -> list[str]:
    """Names of the draft model's modules whose parameters are the target's (vLLM's proposer shares them)."""
    if draft is target:
        return []
    theirs = {id(p) for p in target.parameters()}
    out = []
    for name, module in draft.named_modules():
        own = list(module.parameters(recurse=False))
        if own and all(id(p) in theirs for p in own):
            out.append(name)
    return out


def _drop_shared(draft, target, tensors: dict) -> dict:
    """The received tensors less those of modules the draft model shares with the target; PushRefused when one
    of them differs from the target's (the push would change the target)."""
    shared = _shared_prefixes(draft, target)
    if not shared:
        return tensors
    params = dict(draft.named_parameters(remove_duplicate=False))
    kept = {}
    for name, t in tensors.items():
        prefix = next((p for p in shared if name.startswith(p + ".") or f"model.{name}".startswith(p + ".")), None)
        if prefix is None:
            kept[name] = t
            continue
        local = params.get(name) if name in params else params.get(f"model.{name}")
        if local is None or local.is_meta or local.shape != t.shape or not torch.equal(local.detach().cpu(), t):
            raise PushRefused(
                f"{name}: vLLM's draft model shares {prefix} with the target, and the pushed tensor differs from "
                "the target's; a drafter push never changes the target (restart the engine on this drafter)"
            )
    return kept


def _rebuild_dflash_fused_kv(model, received: dict) -> None:
    """DFlash on CPU: rebuild the fused context K/V copies from the received q/k/v tensors (module docstring)."""
    inner = getattr(model, "model", None)
    if not hasattr(inner, "_build_fused_kv_buffers"):
        return
    layers = [layer.self_attn for layer in inner.layers]
    if all(a.qkv_proj.weight.numel() > 0 for a in layers):  # weights kept (a GPU): vLLM's own build was right
        return
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in received.items():
        m = QKV.search(name)
        if m:
            parts.setdefault((int(m.group(1)), m.group(3)), {})[m.group(2)] = t
    kept = []
    for i, a in enumerate(layers):
        w = parts.get((i, "weight"), {})
        if set(w) != {"q", "k", "v"}:
            raise RuntimeError(f"DFlash layer {i}: the push lacks its q/k/v projection weights")
        kept.append((a.qkv_proj.weight, getattr(a.qkv_proj, "bias", None)))
        a.qkv_proj.weight = torch.nn.Parameter(torch.cat([w["q"], w["k"], w["v"]]), requires_grad=False)
        b = parts.get((i, "bias"), {})
        if set(b) == {"q", "k", "v"}:
            a.qkv_proj.bias = torch.nn.Parameter(torch.cat([b["q"], b["k"], b["v"]]), requires_grad=False)
    try:
        inner._build_fused_kv_buffers()
    finally:
        for a, (weight, bias) in zip(layers, kept):
            a.qkv_proj.weight = weight
            if bias is not None:
                a.qkv_proj.bias = bias
