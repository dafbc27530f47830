"""Finding and loading targets and tokenizers, with errors a user can act on (drafters: draftopd.drafters)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftopd.schema import TOY_TARGET

ASSETS = Path(__file__).parent / "assets"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class LoadError(ValueError):
    """A model path that does not hold what it should."""


def resolve_target_path(path: str) -> Path:
    p = ASSETS / "toy-target" if path == TOY_TARGET else Path(path)
    if not p.exists():  # a hub name (Qwen/Qwen3-8B) lands here too: targets are read from disk, never downloaded
        raise LoadError(
            f"target {path}: no such directory (a target is read from a local copy, never downloaded: "
            f"`hf download NAME --local-dir DIR`, then pass DIR)"
        )
    if not (p / "config.json").is_file():
        raise LoadError(f"target {path}: no config.json in {p}")
    return p


TOY_DRAFTERS = {"toy": "toy-eagle3", "toy-plateau": "toy-eagle3-plateau", "toy-driftfix": "toy-eagle3-driftfix"}


def resolve_drafter_path(path: str) -> str:
    """`toy` names the shipped SFT drafter of the toy target (EAGLE-3), `toy-plateau` the same drafter trained on
    until held-out acceptance stopped improving (`draftopd bench sft-plateau`), `toy-driftfix` the SFT drafter
    with both attention-drift fixes; anything else is a directory."""
    return str(ASSETS / TOY_DRAFTERS[path]) if path in TOY_DRAFTERS else path


def resolve_draft_lm(path: str) -> str:
    """`toy` names the shipped toy draft LM (`draftopd make-toy-draft-lm`: PARD's autoregressive starting point
    for the toy target); anything else is a Hugging Face Llama directory."""
    return str(ASSETS / "toy-draft-lm") if path == "toy" else path


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
