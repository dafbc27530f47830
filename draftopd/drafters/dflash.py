"""The DFlash drafter: a block of mask tokens filled in one non-causal pass, conditioned on target states.

Architecture and checkpoint layout as published by z-lab (`DFlashDraftModel`) and
served by vLLM's `method: dflash`:

* the target's hidden states at `target_layer_ids` are concatenated, projected by
  `fc` and normed (`hidden_norm`): one context row per committed token;
* Qwen3-style decoder `layers` (q/k RMSNorm per head, SwiGLU MLP), as wide as the
  target; in every layer the queries come from the block only, while keys and
  values are the same `k_proj`/`v_proj` (then k-norm and RoPE) applied to the
  context rows at their token positions and to the block;
* a block is [anchor, mask x (B - 1)] at positions anchor .. anchor + B - 1; it
  sees the context strictly before the anchor and its own block in both
  directions; a final `norm`, then the target's `lm_head`, gives B - 1 drafts.

The token embedding and the head are the target's, frozen and never saved.
`dflash_config.target_layer_ids` follows the published convention, "the output of
layer i" (Hugging Face `hidden_states[i + 1]`), while this project's target
captures id i as `hidden_states[i]`; the two are converted when a config is
written or read, nowhere else.

On the shared (row, depth) grid of drafters/base.py, row t is the block anchored
at token t + 1 (context: target states of tokens 0..t) and depth d its offset
d + 1; the drafter never reads its own drafts, so `depth_tokens` is ignored and a
replayed block is the rollout's block exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from draftopd.drafters.base import Pick, pick_block
from draftopd.models.layers import MLP, RMSNorm, apply_rope, at_least_fp32, rope_cos_sin

ARCHITECTURE = "DFlashDraftModel"
FORMATS = ("vllm",)  # z-lab's layout, which vLLM's `method: dflash` and the `dflash` package both read


@dataclass
class DFlashConfig:
    """Shape of a DFlash drafter; `aux_layer_ids` in this project's convention (models/target.py)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    aux_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    head_dim: int = 0  # 0: hidden_size // num_attention_heads

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    def to_hf(self, dtype: torch.dtype = torch.float32) -> dict:
        """config.json in z-lab's layout (Qwen3 layers plus `block_size` and `dflash_config`)."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "target_layer_ids": [i - 1 for i in self.aux_layer_ids],  # output of layer i - 1
                "mask_token_id": self.mask_token_id,
            },
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    @classmethod
    def from_hf(cls, d: dict) -> DFlashConfig:
        extra = d.get("dflash_config") or {}
        ids = extra.get("target_layer_ids", d.get("target_layer_ids"))
        mask = extra.get("mask_token_id", d.get("mask_token_id"))
        if ids is None or mask is None or "block_size" not in d:
            raise ValueError("a 'dflash' config.json needs block_size and dflash_config (layer ids, mask id)")
        rope = (d.get("rope_parameters") or {}).get("rope_theta") or d.get("rope_theta") or 10000.0
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            vocab_size=d["vocab_size"],
            block_size=int(d["block_size"]),
            mask_token_id=int(mask),
            aux_layer_ids=[int(i) + 1 for i in ids],
            num_target_layers=d.get("num_target_layers", 0),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            head_dim=d.get("head_dim") or 0,
        )


# elements of one chunk's [B, h, rows, Bk, S] score block when training scores many rows (all rows, as Draft-OPD
# does): chunks of rows are recomputed in backward instead of keeping [B, h, R, Bk, S] probabilities, so training
# memory stays linear in the sequence (only the [B, R, S] boolean visibility mask is kept whole)
CHUNK_ELEMENTS = 1 << 26


def block_attention(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk) -> torch.Tensor:
    """Attention of R blocks over the shared context and, bidirectionally, their own block.

    q, k_blk, v_blk [B, h, R, Bk, D]; k_ctx, v_ctx [B, h, S, D]; ctx_visible [B, R, S] (True: attend).
    This is the dense boolean block mask over keys [context | all blocks] with its empty
    cross-block part left out: one softmax over [context ; own block]. Under autograd, rows
    beyond `CHUNK_ELEMENTS` go by checkpointed chunks (each row's numbers are computed alike).
    """
    b, h, r, bk, _ = q.shape
    rows = max(1, CHUNK_ELEMENTS // max(1, b * h * bk * k_ctx.shape[2]))
    if r <= rows or not torch.is_grad_enabled():
        return _block_attention(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk)
    parts = [
        checkpoint(
            _block_attention,
            q[:, :, i : i + rows],
            k_ctx,
            v_ctx,
            ctx_visible[:, i : i + rows],
            k_blk[:, :, i : i + rows],
            v_blk[:, :, i : i + rows],
            use_reentrant=False,
        )
        for i in range(0, r, rows)
    ]
    return torch.cat(parts, dim=2)


def _block_attention(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1])
    s_ctx = torch.einsum("bhrid,bhsd->bhris", q, k_ctx) * scale
    s_ctx = s_ctx.masked_fill(~ctx_visible[:, None, :, None, :], float("-inf"))
    s_blk = torch.einsum("bhrid,bhrjd->bhrij", q, k_blk) * scale
    scores = torch.cat([s_ctx, s_blk], dim=-1)
    probs = torch.softmax(scores.to(at_least_fp32(q.dtype)), dim=-1).to(q.dtype)
    s = k_ctx.shape[2]
    return torch.einsum("bhris,bhsd->bhrid", probs[..., :s], v_ctx) + torch.einsum(
        "bhrij,bhrjd->bhrid", probs[..., s:], v_blk
    )


class Attention(nn.Module):
    """Qwen3 attention projections: per-head RMSNorm on q and k before RoPE."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.cfg.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [B, h, T, D] of rows x [B, T, H], kv heads repeated for GQA."""
        nh, nkv = self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), nkv)), cos, sin)
        v = self._heads(self.v_proj(x), nkv)
        if nkv != nh:
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        return k, v

    def q(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        return apply_rope(self.q_norm(self._heads(self.q_proj(x), self.cfg.num_attention_heads)), cos, sin)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx_kv, ctx_visible, cos, sin) -> torch.Tensor:
        """x [B, R, Bk, H] (blocks); ctx_kv: this layer's context keys and values; cos/sin [B, R * Bk, D]."""
        b, r, bk, hidden = x.shape
        attn = self.self_attn
        h = self.input_layernorm(x).reshape(b, r * bk, hidden)
        q = attn.q(h, cos, sin).unflatten(2, (r, bk))
        k, v = (t.unflatten(2, (r, bk)) for t in attn.kv(h, cos, sin))
        o = block_attention(q, *ctx_kv, ctx_visible, k, v)  # [B, h, R, Bk, D]
        x = x + attn.o_proj(o.permute(0, 2, 3, 1, 4).reshape(b, r, bk, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """DFlash drafter bound to a target's embedding and head (`embed_weight`, `head_weight`: shared, frozen)."""

    def __init__(self, cfg: DFlashConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        for name, w in (("embedding", embed_weight), ("lm_head", head_weight)):
            if w.shape != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(
                    f"target {name} {tuple(w.shape)} does not match the drafter's "
                    f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})"
                )
        if not 0 <= cfg.mask_token_id < cfg.vocab_size:
            raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary of {cfg.vocab_size}")
        if cfg.block_size < 2:
            raise ValueError(f"block_size {cfg.block_size}: a block needs the anchor and at least one mask token")
        # The target's own tensors, not copies and not in the state dict: they are never trained or saved.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("head_weight", head_weight.detach(), persistent=False)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _rope(self, positions: torch.Tensor, dtype):
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, keys and values [B, h, S, D] of context rows (target features [B, S, n_aux * H])."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self._rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def blocks(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv, ctx_visible) -> torch.Tensor:
        """Final-normed states [B, R, Bk, H] of blocks [anchor, mask..] at anchor_pos .. (anchors [B, R])."""
        bk = self.cfg.block_size
        ids = torch.full((*anchors.shape, bk), self.cfg.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        return self.run_blocks(ids, anchor_pos, ctx_kv, ctx_visible)

    def run_blocks(self, ids: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv, ctx_visible) -> torch.Tensor:
        """Final-normed states [B, R, Bk, H] of blocks of any tokens `ids` [B, R, Bk] placed at anchor_pos .. ."""
        x = F.embedding(ids, self.embed_weight)
        positions = anchor_pos[..., None] + torch.arange(ids.shape[-1], device=ids.device)
        cos, sin = self._rope(positions.flatten(1), x.dtype)
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, kv, ctx_visible, cos, sin)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head_weight)

    # ---- the family interface (drafters/base.py) ------------------------------

    kind: ClassVar[str] = "dflash"
    needs: ClassVar[str] = "aux"

    @staticmethod
    def max_drafts(cfg) -> int | None:
        """Drafts per step a block holds: the anchor plus block_size - 1 masks. `cfg`: anything with a
        `block_size` (the recipe's drafter section, a DFlashConfig, a built drafter)."""
        return cfg.block_size - 1

    @staticmethod
    def config_refusal(cfg) -> str:
        """Why a resolved recipe cannot run with this family ('' when it can): nothing DFlash-specific."""
        return ""

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.cfg.aux_layer_ids)

    def draft_to_target_ids(self) -> torch.Tensor:
        """The whole target vocabulary: DFlash drafts through the target's own head."""
        return torch.arange(self.cfg.vocab_size, device=self.head_weight.device)

    def proposer(self) -> DFlashProposer:
        return DFlashProposer(self)

    def features(self, out) -> torch.Tensor:
        return out.aux_hidden.to(self.head_weight.dtype)

    def score(self, input_ids, features, valid, depth: int, depth_tokens=None, rows=None) -> torch.Tensor:
        """Blocks anchored at token t + 1 for rows t (all n, or `rows` [B, R]): logits [B, depth, R, V]."""
        if depth > self.cfg.block_size - 1:
            raise ValueError(f"depth {depth} exceeds the block's {self.cfg.block_size - 1} drafts")
        b, length = input_ids.shape
        if rows is None:
            rows = torch.arange(length - 1, device=input_ids.device).expand(b, -1)
        anchor_pos = rows + 1
        positions = torch.arange(length, device=input_ids.device)
        ctx_kv = self.context(features, positions.expand(b, -1))
        visible = (positions[None, None] < anchor_pos[..., None]) & valid[:, None, :]
        hidden = self.blocks(input_ids.gather(1, anchor_pos), anchor_pos, ctx_kv, visible)
        return self.logits(hidden[:, :, 1 : depth + 1]).transpose(1, 2)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """`score`, so that wrappers such as a DeepSpeed engine can call the module."""
        return self.score(*args, **kwargs)

    def config(self) -> dict:
        return self.cfg.to_hf(dtype=self.fc.weight.dtype)

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())

    @classmethod
    def from_state(cls, config: dict, state: dict[str, torch.Tensor], target) -> DFlashDrafter:
        cfg = DFlashConfig.from_hf(config)
        if cfg.vocab_size != target.vocab_size or cfg.hidden_size != target.hidden_size:
            raise ValueError(
                f"built for vocabulary {cfg.vocab_size} and width {cfg.hidden_size}, "
                f"the target has {target.vocab_size} and {target.hidden_size}"
            )
        if cfg.aux_layer_ids != target.aux_layer_ids:
            raise ValueError(f"reads target layers {cfg.aux_layer_ids}, target set to {target.aux_layer_ids}")
        drafter = cls(cfg, target.embed_tokens().weight, target.lm_head().weight)
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"DFlash weights: missing {missing}, unexpected {unexpected}")
        return drafter.to(target.dtype)

    @staticmethod
    def target_layers(config: dict) -> list[int]:
        return list(DFlashConfig.from_hf(config).aux_layer_ids)

    @staticmethod
    def speculative_config(path, num_draft_tokens: int) -> dict:
        return {"method": "dflash", "model": str(path), "num_speculative_tokens": num_draft_tokens}

    # ---- layouts and construction ------------------------------------------------

    formats: ClassVar[tuple[str, ...]] = FORMATS
    scores_rows: ClassVar[bool] = True  # each block attends to the context alone: a row costs what it reads
    learner_context: ClassVar[int] = 256  # measured to learn from this window (docs/serving.md)
    live_push: ClassVar[bool] = True  # through vLLM's weight-transfer calls (tests/test_dflash.py pushes, decodes)

    @staticmethod
    def read_config(raw: dict) -> dict:
        DFlashConfig.from_hf(raw)  # raises ValueError naming what is missing
        return raw

    @staticmethod
    def export(config: dict, tensors: dict, fmt: str, verifier: str = "", num_draft_tokens: int = 4):
        """(config.json, tensors) in the one layout there is, unchanged."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown DFlash format {fmt!r}: {', '.join(FORMATS)}")
        DFlashConfig.from_hf(config)
        return config, tensors

    @staticmethod
    def describe(raw: dict, tensors: dict, target=None) -> list[str]:
        """What `draftopd inspect` prints about a checkpoint: shape, block, conventions, fit to `target`."""
        cfg = DFlashConfig.from_hf(raw)
        lines = [
            f"layout: z-lab's {ARCHITECTURE} (vLLM method: dflash)",
            f"layers: {cfg.num_hidden_layers} x hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}"
            f"/{cfg.num_key_value_heads} x {cfg.head_dim}, MLP {cfg.intermediate_size}",
            f"block: {cfg.block_size} (up to {cfg.block_size - 1} drafts per step), mask token {cfg.mask_token_id}",
            f"target layers: published ids {[i - 1 for i in cfg.aux_layer_ids]} (output of layer i) "
            f"= draftopd aux ids {cfg.aux_layer_ids}",
            f"parameters: {sum(t.numel() for t in tensors.values()):,} (embedding and head: the target's)",
        ]
        if target is not None:
            fits = cfg.vocab_size == target.vocab_size and cfg.hidden_size == target.hidden_size
            fits = fits and cfg.aux_layer_ids == list(target.aux_layer_ids)
            lines.append(f"fits the target: {'yes' if fits else 'no'}")
        return lines

    @classmethod
    def new(cls, cfg, target, draft_to_target: torch.Tensor) -> DFlashDrafter:
        """A fresh drafter from the recipe's `drafter` section; it drafts over the whole target vocabulary
        (the head is the target's), so the draft vocabulary is not used."""
        hidden = cfg.hidden_size or target.hidden_size
        if hidden != target.hidden_size:
            raise ValueError("the DFlash drafter shares the target's embedding and head, so its width must match")
        if cfg.mask_token_id < 0:
            raise ValueError("drafter.mask_token_id must name an unused vocabulary row (the tokenizer's <|mask|>)")
        tc = target.model.config
        dcfg = DFlashConfig(
            hidden_size=hidden,
            intermediate_size=cfg.intermediate_size or 3 * hidden,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            vocab_size=target.vocab_size,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            aux_layer_ids=list(target.aux_layer_ids),
            num_target_layers=target.num_layers,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=target.rope_theta,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        )
        return cls(dcfg, target.embed_tokens().weight, target.lm_head().weight).to(target.dtype)


class DFlashProposer:
    """DFlash inference state of one decode call (drafters/base.py `Proposer`).

    The context keys and values of committed tokens are kept per layer; each step
    drafts one whole block at the pending token (the anchor, which has no target
    state yet) and takes its first K positions.
    """

    def __init__(self, drafter: DFlashDrafter):
        self.d = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.valid: torch.Tensor | None = None
        self.anchor = self.anchor_pos = None

    def _append(self, out, width: int, positions: torch.Tensor, valid: torch.Tensor) -> None:
        kv = self.d.context(self.d.features(out)[:, :width], positions)
        if self.kv is None:
            self.kv, self.valid = kv, valid
            return
        self.kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.kv, kv)]
        self.valid = torch.cat([self.valid, valid], dim=1)

    def begin(self, ids, positions, valid, first, out) -> None:
        self._append(out, ids.shape[1], positions, valid)
        self.anchor, self.anchor_pos = first, positions[:, -1] + 1

    def propose(self, k: int, pick: Pick):
        if k > self.d.max_drafts(self.d):
            raise ValueError(
                f"{k} drafts per step, but a DFlash block of {self.d.block_size} holds at most "
                f"{self.d.max_drafts(self.d)}"
            )
        b = self.anchor.shape[0]
        hidden = self.d.blocks(self.anchor[:, None], self.anchor_pos[:, None], self.kv, self.valid[:, None])
        logits = self.d.logits(hidden[:, 0, 1 : k + 1]).reshape(b * k, -1)
        return pick_block(logits, b, k, pick)

    def commit(self, out, emitted, num_emitted, positions) -> None:
        """Context rows for [anchor, accepted drafts]; the correction or bonus token is the next anchor."""
        m = int(num_emitted.max())
        valid = torch.arange(m, device=emitted.device)[None] < num_emitted[:, None]
        self._append(out, m, positions[:, :m], valid)
        rows = torch.arange(emitted.shape[0], device=emitted.device)
        self.anchor = emitted[rows, num_emitted - 1]
        self.anchor_pos = positions[:, 0] + num_emitted

    def select(self, keep: torch.Tensor) -> None:
        self.kv = [(k[keep], v[keep]) for k, v in self.kv]
        self.valid, self.anchor, self.anchor_pos = self.valid[keep], self.anchor[keep], self.anchor_pos[keep]
