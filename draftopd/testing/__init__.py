"""Tiny random models for tests and for checking the engine's maths on a small vocabulary."""

from __future__ import annotations

import torch

from draftopd.drafters import new_drafter
from draftopd.models.target import TargetModel
from draftopd.schema import DrafterConfig


def tiny_target(
    vocab: int = 16, hidden: int = 32, layers: int = 4, seed: int = 0, dtype=torch.float64, sharpness: float = 3.0
) -> TargetModel:
    """A random Llama with a small vocabulary; `sharpness` scales its head so distributions are peaked."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return TargetModel(model.to(dtype))


# Per family: drafter options the tiny tests need, and the layers scaled to sharpen its draft distributions.
# Block families: blocks of 8 (the engine tests draft up to 7); row 0 (pad) as the mask token; their head is the
# target's own, so they sharpen through their final norm. PARD: a random Llama draft LM (no base_lm).
TINY = {
    "eagle3": ({}, lambda d: [d.lm_head]),
    "dflash": ({"block_size": 8, "mask_token_id": 0}, lambda d: [d.norm]),
    "d2sd": ({"block_size": 8, "mask_token_id": 0}, lambda d: [d.first.norm, d.vp.norm]),
    "pard": ({"mask_token_id": 0}, lambda d: [d.lm_head]),
}


def tiny_drafter(target: TargetModel, draft_vocab: int | None = None, seed: int = 1, kind: str = "eagle3", **opts):
    """A random drafter of family `kind` for `target`; with `draft_vocab` < vocab it covers the lowest ids.

    `opts` are `drafter` config fields (norm_output, fc_norm, head_dim, ...); heads are scaled up so that
    draft distributions are peaked.
    """
    torch.manual_seed(seed)
    h = target.hidden_size
    opts = {**TINY[kind][0], **opts}
    cfg = DrafterConfig(kind=kind, intermediate_size=2 * h, num_attention_heads=4, num_key_value_heads=2, **opts)
    drafter = new_drafter(cfg, target, torch.arange(draft_vocab or target.vocab_size))
    with torch.no_grad():
        for layer in TINY[kind][1](drafter):
            layer.weight.mul_(4.0)
    return drafter


TINY_TRAINING = {"pard": {"ttt_depth": 8}, "d2sd": {"num_anchors": 24}}


def train_tiny_drafter(target: TargetModel, steps: int = 60, k_depth: int = 3, seed: int = 0, **opts):
    """A drafter trained briefly (seconds) on the tiny target's own samples, so that drafts get accepted."""
    from draftopd.engine.speculative import SpeculativeEngine
    from draftopd.messages import SamplingConfig
    from draftopd.schema import SFTConfig
    from draftopd.sft.trainer import SFTExample, SFTTrainer

    g = torch.Generator().manual_seed(seed)
    v = target.vocab_size
    prompts = [torch.randint(2, v, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (64,), generator=g)]
    trajs = SpeculativeEngine(target, None, [1]).generate(prompts, SamplingConfig(max_new_tokens=40, temperature=1.0))
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs]
    drafter = tiny_drafter(target, seed=seed + 1, **opts)
    # Block families train every offset of the block; PARD K = 8 copies (up to 7 masks, as many drafts per pass
    # as the engine tests ask for); D²SD trains at random anchors (its variable-prefix rows need them).
    k_depth = drafter.max_drafts(drafter) or TINY_TRAINING.get(drafter.kind, {}).get("ttt_depth", k_depth)
    anchors = TINY_TRAINING.get(drafter.kind, {}).get("num_anchors", 0)
    cfg = SFTConfig(epochs=max(1, steps // 4), batch_size=16, lr=3e-3, ttt_depth=k_depth, num_anchors=anchors)
    trainer = SFTTrainer(drafter, target, examples, cfg, seed)
    for _ in trainer.run():
        if trainer.step >= steps:
            break
    return drafter.eval()


def in_process_session(cfg, learner, trajectories):
    """A Session's learner-facing half over one plain learner object and a buffer holding `trajectories`, in
    process and without Ray: enough to call `Session.opd_step(s, version, ...)` and read what it logs."""
    from types import SimpleNamespace

    from draftopd.opd.buffer import ReplayBuffer
    from draftopd.opd.runtime import InProcessHandle, InProcessRuntime
    from draftopd.opd.session import DriverState, Session

    buffer = ReplayBuffer(cfg.buffer)
    buffer.add(trajectories)
    s = SimpleNamespace(cfg=cfg, rt=InProcessRuntime(), buffer=InProcessHandle(buffer), state=DriverState())
    s.learners, s.nonfinite_in_a_row, s.num_skipped_stale = [InProcessHandle(learner)], 0, 0
    s.learner_seconds = 0.0
    for name in ("_learner_call", "count_step", "_learners_get", "opd_lr"):
        setattr(s, name, getattr(Session, name).__get__(s))
    return s


def pard_like_target(target: TargetModel, mask_token_id: int) -> DrafterConfig:
    """A PARD draft LM's shape: one layer shaped as the target's (its heads, head_dim and MLP width)."""
    tc = target.model.config
    return DrafterConfig(
        kind="pard",
        mask_token_id=mask_token_id,
        num_hidden_layers=1,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        intermediate_size=tc.intermediate_size,
    )


def save_target_for_vllm(target: TargetModel, out):
    """`target` saved under `out` with the toy tokenizer beside it (prompts and outputs are token ids), as vLLM
    starts on it; returns `out`."""
    import shutil
    from pathlib import Path

    from draftopd.loading import ASSETS

    out = Path(out)
    target.model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSETS / "toy-target" / name, out / name)
    return out
