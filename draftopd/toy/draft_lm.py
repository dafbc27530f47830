"""Build the toy draft LM: a small autoregressive Llama with the toy target's tokenizer, trained on the toy corpus.

PARD converts an existing autoregressive draft model (Llama-3.2-1B for
Llama-3.1-8B) into a parallel drafter; starting from random weights would change
that premise. This is the toy target's counterpart: same tokenizer and corpus,
a fraction of the width and depth, trained with plain next-token loss
(`draftopd make-toy-draft-lm`). The directory is a plain Hugging Face Llama that
`drafter.base_lm` points a `pard` recipe at.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from draftopd.toy.corpus import Sample, build_corpus
from draftopd.toy.target import _pack, held_out_loss, render, train_for


@dataclass
class ToyDraftLMSpec:
    """Shape and training budget of the toy draft LM (the toy target is 4 x 256 wide)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 256
    batch_size: int = 32
    lr: float = 3e-3
    minutes: float = 20.0
    num_arithmetic: int = 60000
    seed: int = 0


def make_toy_draft_lm(
    out_dir: str | Path,
    target: str = "toy",
    spec: ToyDraftLMSpec | None = None,
    corpus: tuple[list[Sample], list[Sample]] | None = None,
) -> dict:
    """Train the draft LM on `corpus` (train, held-out; default the toy corpus) in `target`'s tokenizer for
    `spec.minutes`, save it; returns the report."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftopd.loading import load_tokenizer

    spec = spec or ToyDraftLMSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    tokenizer = load_tokenizer(target)
    train, held = corpus or build_corpus(spec.num_arithmetic, spec.seed)
    train = list(train)
    encode = lambda samples: tokenizer([render(tokenizer, s) for s in samples], add_special_tokens=False).input_ids  # noqa: E731
    random.Random(spec.seed).shuffle(train)
    train_rows = _pack(encode(train), spec.seq_len, tokenizer.pad_token_id)
    held_rows = _pack(encode(held), spec.seq_len, tokenizer.pad_token_id)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    steps = train_for(model, train_rows, spec.batch_size, spec.lr, spec.minutes, spec.seed, "toy draft LM")
    report = {
        "held_out_loss_nats_per_token": held_out_loss(model, held_rows),
        "uniform_loss_nats_per_token": math.log(config.vocab_size),
        "train_steps": steps,
        "train_tokens": steps * spec.batch_size * spec.seq_len,
        "minutes": spec.minutes,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "toy_draft_lm_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
