"""What `draftopd inspect` says about an EAGLE-3 checkpoint: layout, conventions, shapes, fit to a target."""

from __future__ import annotations

import torch

from draftopd.drafters.eagle3_formats import IDS, detect_layout, id_convention, import_state, read_config

OPTIONS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias")


def _target_fit(cfg, tensors: dict, target) -> list[str]:
    """Reasons the drafter (`cfg`: its Eagle3Config) does not fit `target` (empty: it does)."""
    bad = []
    if cfg.vocab_size != target.vocab_size:
        bad.append(f"vocabulary {cfg.vocab_size} != the target's {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size or cfg.hidden_size != target.hidden_size:
        h = f"hidden size {cfg.hidden_size} (reads {cfg.target_hidden_size})"
        bad.append(f"{h} != the target's {target.hidden_size}")
    if cfg.aux_layer_ids and max(cfg.aux_layer_ids) > target.num_layers:
        bad.append(f"reads layer {max(cfg.aux_layer_ids)} of a {target.num_layers}-layer target")
    return bad


def _embedding(tensors: dict, target) -> str:
    own = tensors.get("embed_tokens.weight")
    if own is None:
        return "embedding: none saved (the target's is used)"
    if target is None:
        return f"embedding: saved {tuple(own.shape)} (compare with --target)"
    same = own.shape == target.embed_tokens().weight.shape and torch.equal(
        own, target.embed_tokens().weight.detach().to(own.dtype)
    )
    return (
        "embedding: saved, equal to the target's (dropped on import)"
        if same
        else ("embedding: saved, differs from the target's (kept as the drafter's own on import)")
    )


def describe(cfg, raw: dict, tensors: dict, target=None) -> list[str]:
    """`cfg` is the checkpoint's Eagle3Config, parsed by eagle3.py (which imports this module, not the reverse)."""
    cfg_dict = read_config(raw)
    tensors = import_state(tensors)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()})
    rope = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) if cfg.rope_scaling else "default"
    lines = [
        f"layout: {detect_layout(raw)} ({', '.join(raw.get('architectures') or []) or 'no architectures'})",
        f"layer: {cfg.model_type}, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
        f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} x {cfg.head_dim}, "
        f"rope theta {cfg.rope_theta:g} ({rope})",
        "options: " + (", ".join(k for k in OPTIONS if getattr(cfg, k)) or "none"),
        f"aux layers: {cfg_dict.get(IDS) or 'target default'} in vLLM's convention; read from {id_convention(raw)}",
        f"weights: {len(tensors)} tensors, {'/'.join(dtypes)}; fc {tuple(tensors['fc.weight'].shape)}, "
        f"lm_head {tuple(tensors['lm_head.weight'].shape)}",
        f"draft vocabulary: {cfg.draft_vocab_size} of {cfg.vocab_size} target tokens "
        f"({100 * cfg.draft_vocab_size / cfg.vocab_size:.1f}%)",
        _embedding(tensors, target),
    ]
    if target is not None:
        bad = _target_fit(cfg, tensors, target)
        lines.append("matches the target: " + ("yes" if not bad else "no: " + "; ".join(bad)))
    return lines
