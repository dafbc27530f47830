"""Finding and loading targets, tokenizers and drafters, with errors a user can act on."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftopd.config import TOY_TARGET, DrafterConfig

ASSETS = Path(__file__).parent / "assets"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class LoadError(ValueError):
    """A model path that does not hold what it should."""


def resolve_target_path(path: str) -> Path:
    p = ASSETS / "toy-target" if path == TOY_TARGET else Path(path)
    if not (p / "config.json").is_file():
        raise LoadError(f"target {path}: no config.json in {p}")
    return p


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_target_path(path)))


def load_target(path: str, aux_layer_ids: list[int] | None = None, dtype: str = "float32"):
    from draftopd.models.target import TargetModel

    if dtype not in DTYPES:
        raise LoadError(f"unknown dtype '{dtype}' (choose from {sorted(DTYPES)})")
    return TargetModel.load(resolve_target_path(path), aux_layer_ids or None, DTYPES[dtype])


def eos_ids(tokenizer, target_path: str) -> list[int]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = resolve_target_path(target_path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def load_drafter(path: str, target):
    """An EAGLE-3 checkpoint bound to `target`'s embedding; checks that the two fit together."""
    from draftopd.models.eagle3 import Eagle3Config, Eagle3Drafter
    from draftopd.models.formats import FormatError, read_config

    p = Path(path)
    if not (p / "config.json").is_file():
        raise LoadError(f"drafter {path}: no config.json")
    try:
        cfg = Eagle3Config.from_hf(read_config(p))  # the vllm or the speculators layout
    except FormatError as exc:
        raise LoadError(f"drafter {path}: {exc}") from None
    if cfg.vocab_size != target.vocab_size:
        raise LoadError(
            f"drafter {path} was built for a vocabulary of {cfg.vocab_size} tokens, the target has {target.vocab_size}"
        )
    if cfg.hidden_size != target.hidden_size or cfg.target_hidden_size != target.hidden_size:
        raise LoadError(
            f"drafter {path} expects target hidden size {cfg.target_hidden_size} (own {cfg.hidden_size}), "
            f"the target has {target.hidden_size}"
        )
    if cfg.aux_layer_ids and cfg.aux_layer_ids != target.aux_layer_ids:
        raise LoadError(f"drafter {path} reads target layers {cfg.aux_layer_ids}, target set to {target.aux_layer_ids}")
    return Eagle3Drafter.load(p, target.embed_tokens().weight)


def rope_theta(config) -> float:
    """RoPE base of a HF config (transformers 5 keeps it in `rope_parameters`)."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def new_drafter(cfg: DrafterConfig, target, draft_to_target: torch.Tensor):
    """A freshly initialised drafter for `target` over the given draft vocabulary (sorted target ids)."""
    from draftopd.models.eagle3 import Eagle3Config, Eagle3Drafter

    hidden = cfg.hidden_size or target.hidden_size
    if hidden != target.hidden_size:
        raise LoadError("the EAGLE-3 drafter shares the target's embedding, so its hidden size must match the target's")
    ecfg = Eagle3Config(
        hidden_size=hidden,
        intermediate_size=cfg.intermediate_size or 3 * hidden,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        vocab_size=target.vocab_size,
        draft_vocab_size=len(draft_to_target),
        target_hidden_size=target.hidden_size,
        aux_layer_ids=list(target.aux_layer_ids),
        rms_norm_eps=getattr(target.model.config, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta(target.model.config),
        max_position_embeddings=getattr(target.model.config, "max_position_embeddings", 2048),
        norm_output=cfg.norm_output,
        fc_norm=cfg.fc_norm,
    )
    d2t = draft_to_target - torch.arange(len(draft_to_target))
    return Eagle3Drafter(ecfg, target.embed_tokens().weight, d2t=d2t).to(target.dtype)
