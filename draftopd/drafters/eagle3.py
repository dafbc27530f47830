"""The EAGLE-3 drafter: fused target states + one decoder layer + a draft-vocabulary head.

Layout and maths follow what vLLM's `llama_eagle3.py` loads and computes, so a
checkpoint saved here is served as is:

* `fc` fuses the concatenated aux states of the target ([B, T, n_aux * H_t] -> H);
  with `norm_before_fc` one RMSNorm over the concatenation (`input_norm`) comes
  first; with `fc_norm`, each aux state first goes through its own RMSNorm
  (`fc_norm.{i}.weight`), one of the two attention-drift fixes;
* `midlayer` (a Llama or Qwen3 layer, `eagle3_layers.py`): the q/k/v input is
  `cat(input_layernorm(embed(token)), hidden_norm(state))` (2H wide); the
  residual is the un-normed state, or the normed one with `norm_before_residual`;
  then an MLP block;
* `norm` then `lm_head` over the draft vocabulary; `d2t[i]` maps draft id i to
  target id `i + d2t[i]`, `t2d` marks target ids present in the draft vocabulary;
* the state fed to the next chain step is the residual stream before `norm`,
  or after it with `norm_output` (the other drift fix).

The token embedding is the target's, frozen and not saved with the drafter,
unless an imported checkpoint brought a different one of its own: that one is
kept (frozen) and saved as `embed_tokens.weight`, which vLLM then loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from draftopd.drafters.base import Pick
from draftopd.drafters.eagle3_formats import FORMATS, export_state, identity_maps, import_state, read_config
from draftopd.drafters.eagle3_inspect import describe
from draftopd.drafters.eagle3_layers import ROPE_TYPES, MidLayer
from draftopd.drafters.ttt_attention import dense_mask, dense_ttt_attention, ttt_attention
from draftopd.models.layers import RMSNorm, at_least_fp32, attend_mask

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Config:
    """Shape of an EAGLE-3 drafter; `aux_layer_ids` use vLLM's convention (see models/target.py)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_output: bool = False
    fc_norm: bool = False
    head_dim: int = 0  # 0: hidden_size // num_attention_heads; set it for targets whose heads are wider (Qwen3-4B)
    model_type: str = "llama"  # the decoder layer: llama, or qwen3 (q_norm/k_norm)
    norm_before_residual: bool = False  # the residual is the normed state (speculators, vLLM)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc (`input_norm`)
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict | None = None  # {'rope_type': 'llama3' | 'yarn', ...} as in HF configs

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.model_type not in ("llama", "qwen3"):
            raise ValueError(f"EAGLE-3 drafter layers of type '{self.model_type}' are not supported (llama, qwen3)")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope scaling '{kind}' is not supported ({', '.join(ROPE_TYPES)})")
        if kind == "default":
            self.rope_scaling = None

    def to_hf(self, dtype: torch.dtype = torch.float32) -> dict:
        """config.json as vLLM and SGLang read it for `method: eagle3` (`torch_dtype`: the weights' dtype)."""
        extra = {"rope_scaling": dict(self.rope_scaling)} if self.rope_scaling else {}
        return {
            "architectures": [ARCHITECTURE if self.model_type == "llama" else "Eagle3Qwen3ForCausalLM"],
            "model_type": self.model_type,
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "num_aux_hidden_states": len(self.aux_layer_ids) or 3,
            "norm_output": self.norm_output,
            "fc_norm": self.fc_norm,
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
            **extra,
        }

    @classmethod
    def from_hf(cls, d: dict) -> Eagle3Config:
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{d['num_hidden_layers']} drafter layers: only one-layer EAGLE-3 drafters are supported")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
            aux_layer_ids=list(d.get("eagle_aux_hidden_state_layer_ids") or []),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            norm_output=bool(d.get("norm_output", False)),
            fc_norm=bool(d.get("fc_norm", False)),
            head_dim=d.get("head_dim") or 0,
            model_type=d.get("model_type", "llama"),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            norm_before_fc=bool(d.get("norm_before_fc", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            rope_scaling=rope or None,
        )


@dataclass
class DrafterStep:
    """Outputs of one drafter forward: draft-vocab logits, the state to feed on, and k/v of the new rows."""

    logits: torch.Tensor
    state: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. `embed_weight` is the target's embedding matrix (frozen; `own_embedding`: the drafter's)."""

    def __init__(
        self,
        cfg: Eagle3Config,
        embed_weight: torch.Tensor,
        d2t: torch.Tensor | None = None,
        own_embedding: bool = False,
    ):
        super().__init__()
        self.cfg = cfg
        self.own_embedding = own_embedding
        if embed_weight.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"target embedding {tuple(embed_weight.shape)} does not match the drafter's "
                f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})"
            )
        self.embed = nn.Embedding.from_pretrained(embed_weight.detach().clone(), freeze=True)
        n_aux = len(cfg.aux_layer_ids) or 3
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.input_norm = RMSNorm(n_aux * cfg.target_hidden_size, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(n_aux))
            if cfg.fc_norm
            else None
        )
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if d2t is None:
            d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        self.register_buffer("d2t", d2t.clone().long())
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.t2d[self.draft_to_target_ids()] = True

    def draft_to_target_ids(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [B, T, n_aux * H_t] -> drafter state [B, T, H]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def _attn_input(self, input_ids: torch.Tensor, state: torch.Tensor):
        m = self.midlayer
        normed = m.hidden_norm(state)
        x = torch.cat([m.input_layernorm(self.embed(input_ids)), normed], dim=-1)
        return x, normed if self.cfg.norm_before_residual else state

    def _finish(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """Everything after attention: residual adds, MLP, final norm, head; returns (logits, next state)."""
        m = self.midlayer
        residual = residual + attn_out
        residual = residual + m.mlp(m.post_attention_layernorm(residual))
        normed = self.norm(residual)
        state = normed if self.cfg.norm_output else residual
        return self.lm_head(normed), state

    def step(
        self,
        input_ids: torch.Tensor,
        state: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        mask: torch.Tensor,
    ) -> DrafterStep:
        """Decode T new rows against cached keys. `mask` is boolean [B, T, S_past + T] (True = attend)."""
        x, residual = self._attn_input(input_ids, state)
        attn = self.midlayer.self_attn
        q, k, v = attn.qkv(x, positions)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        vals = v if past_v is None else torch.cat([past_v, v], dim=2)
        o = nn.functional.scaled_dot_product_attention(q, keys, vals, attn_mask=mask[:, None])
        logits, new_state = self._finish(attn.out(o), residual)
        return DrafterStep(logits=logits, state=new_state, keys=k, values=v)

    def ttt_forward(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        key_valid: torch.Tensor,
        depth: int,
        depth_tokens: torch.Tensor | None = None,
        trace: list | None = None,
        attention: str = "chunked",
    ) -> list[torch.Tensor]:
        """Training-time test over whole sequences; returns draft logits per depth, [B, L-1, Vd] each.

        Row t of depth 0 reads (fused aux_t, token_{t+1}) at position t; row t of depth d
        reads (own state from depth d-1, token_{t+1+d}) at position t+d and sees the
        depth-0 keys of rows <= t plus its own row at depths 1..d, which is exactly
        what a chain of drafts started after token t+1 sees at inference.
        `depth_tokens` [B, depth, L-1], when given, replaces the teacher-forced input
        tokens of depths >= 1 (Draft-OPD replays the drafter's own drafts this way).
        `trace`, when given, receives per depth the attention mass on the drafter's own
        earlier drafts (rest: the target's context) and the norm of the state fed
        forward, both [B, L-1] (for drift diagnostics).
        `attention`: "chunked" (memory linear in L, ttt_attention.py) or "dense" (the
        former [B, H, L, L] computation, kept as the tests' reference).
        """
        b, n = input_ids.shape[0], input_ids.shape[1] - 1
        attn = self.midlayer.self_attn
        state = self.fuse(aux[:, :n])
        pos = torch.arange(n, device=input_ids.device).expand(b, n)
        if attention == "chunked":
            attend, valid = ttt_attention, key_valid[:, :n]
        elif attention == "dense":
            attend, valid = dense_ttt_attention, dense_mask(key_valid[:, :n])
        else:
            raise ValueError(f"TTT attention '{attention}' is not one of: chunked, dense")
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        ks, vs, outs = [], [], []
        for d in range(depth):
            if d and depth_tokens is not None:
                tokens = depth_tokens[:, d]
            else:
                tokens = torch.roll(input_ids, shifts=-(1 + d), dims=1)[:, :n]  # token_{t+1+d}; tail rows unused
            x, residual = self._attn_input(tokens, state)
            q, k, v = attn.qkv(x, pos + d)
            ks.append(k)
            vs.append(v)
            o, own = attend(q, ks, vs, valid, scale)
            logits, state = self._finish(attn.out(o), residual)
            outs.append(logits)
            if trace is not None:
                trace.append({"own_mass": own.mean(1), "state_norm": state.norm(dim=-1).detach()})
        return outs

    # ---- the family interface (drafters/base.py) ------------------------------

    kind: ClassVar[str] = "eagle3"
    needs: ClassVar[str] = "aux"

    @staticmethod
    def max_drafts(cfg) -> int | None:
        """Any K: the chain feeds its own states forward as far as asked."""
        return None

    @staticmethod
    def config_refusal(cfg) -> str:
        """Every recipe the schema accepts runs with EAGLE-3."""
        return ""

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.cfg.aux_layer_ids)

    def proposer(self) -> Eagle3Proposer:
        return Eagle3Proposer(self)

    def features(self, out) -> torch.Tensor:
        return out.aux_hidden.to(self.embed.weight.dtype)

    def score(self, input_ids, features, valid, depth: int, depth_tokens=None) -> torch.Tensor:
        """TTT on the shared grid: [B, D, n, Vd] (row t, depth d predicts token t + 2 + d)."""
        return torch.stack(self.ttt_forward(input_ids, features, valid, depth, depth_tokens), 1)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """`score`, so that wrappers such as a DeepSpeed engine can call the module."""
        return self.score(*args, **kwargs)

    def config(self) -> dict:
        return self.cfg.to_hf(dtype=self.fc.weight.dtype)

    def state(self) -> dict[str, torch.Tensor]:
        """Weights under the names vLLM's EAGLE-3 loader expects; the embedding only when it is the drafter's own.
        A drafter over the whole target vocabulary (day 0) has no `d2t`/`t2d`: vLLM's model holds no map then and
        refuses one (`draft_id_to_target_id`), and `from_state` reads a missing map as the identity."""
        maps = ("d2t", "t2d") if identity_maps(self.cfg.vocab_size, self.cfg.draft_vocab_size, self.d2t) else ()
        out = {k: v for k, v in self.state_dict().items() if not k.startswith("embed.") and k not in maps}
        if self.own_embedding:
            out["embed_tokens.weight"] = self.embed.weight
        return out

    @classmethod
    def from_state(cls, config: dict, state: dict[str, torch.Tensor], target) -> Eagle3Drafter:
        """A drafter from a config.json dict and tensors (any published naming), bound to `target`."""
        cfg = Eagle3Config.from_hf(config)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"built for a vocabulary of {cfg.vocab_size} tokens, the target has {target.vocab_size}")
        if cfg.hidden_size != target.hidden_size or cfg.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"expects target hidden size {cfg.target_hidden_size} (own {cfg.hidden_size}), "
                f"the target has {target.hidden_size}"
            )
        if cfg.aux_layer_ids and cfg.aux_layer_ids != target.aux_layer_ids:
            raise ValueError(f"reads target layers {cfg.aux_layer_ids}, target set to {target.aux_layer_ids}")
        cfg.aux_layer_ids = list(target.aux_layer_ids)  # a checkpoint without ids reads the target's defaults
        state = import_state(state)
        embed = target.embed_tokens().weight
        own = state.pop("embed_tokens.weight", None)
        if own is not None and torch.equal(own, embed.detach().to(own.dtype)):
            own = None  # the target's own embedding, saved beside the drafter: shared again
        elif own is not None:
            print("drafter: its embedding differs from the target's: kept as the drafter's own")
        drafter = cls(cfg, embed if own is None else own.to(embed.dtype), state.get("d2t"), own is not None)
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        maps = ("d2t", "t2d") if cfg.draft_vocab_size == cfg.vocab_size else ()  # absent: the identity (state())
        missing = [m for m in missing if not m.startswith("embed.") and "rotary" not in m and m not in maps]
        if missing or unexpected:
            raise ValueError(f"EAGLE-3 weights: missing {missing}, unexpected {unexpected}")
        return drafter.to(embed.dtype)

    @staticmethod
    def target_layers(config: dict) -> list[int]:
        return list(Eagle3Config.from_hf(config).aux_layer_ids)

    @staticmethod
    def speculative_config(path, num_draft_tokens: int) -> dict:
        return {"method": "eagle3", "model": str(path), "num_speculative_tokens": num_draft_tokens}

    # ---- layouts and construction ------------------------------------------------

    formats: ClassVar[tuple[str, ...]] = FORMATS
    scores_rows: ClassVar[bool] = False  # the TTT chain attends to every earlier row's own states
    learner_context: ClassVar[int] = 256  # measured to learn from this window (docs/serving.md)
    live_push: ClassVar[bool] = True  # through vLLM's weight-transfer calls (tests/test_vllm_backend.py)

    @staticmethod
    def read_config(raw: dict) -> dict:
        """config.json in any published layout -> this project's (FormatError when unreadable)."""
        cfg = read_config(raw)
        Eagle3Config.from_hf(cfg)  # refuses layer types and rope scalings this module does not compute
        return cfg

    @staticmethod
    def export(config: dict, tensors: dict, fmt: str, verifier: str = "", num_draft_tokens: int = 4):
        """(config.json, tensors) in the serving layout `fmt` (eagle3_formats.py)."""
        cfg = read_config(config)
        Eagle3Config.from_hf(cfg)  # what cannot be computed here is not exported either
        return export_state(cfg, import_state(tensors), fmt, verifier, num_draft_tokens)

    @staticmethod
    def describe(raw: dict, tensors: dict, target=None) -> list[str]:
        """What `draftopd inspect` prints about a checkpoint (eagle3_inspect.py)."""
        return describe(Eagle3Config.from_hf(read_config(raw)), raw, tensors, target)

    @classmethod
    def new(cls, cfg, target, draft_to_target: torch.Tensor) -> Eagle3Drafter:
        """A fresh drafter from the recipe's `drafter` section over the given draft vocabulary."""
        hidden = cfg.hidden_size or target.hidden_size
        if hidden != target.hidden_size:
            raise ValueError("the EAGLE-3 drafter shares the target's embedding, so its hidden size must match")
        tc = target.model.config
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
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=target.rope_theta,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
            norm_output=cfg.norm_output,
            fc_norm=cfg.fc_norm,
        )
        d2t = draft_to_target - torch.arange(len(draft_to_target))
        return cls(ecfg, target.embed_tokens().weight, d2t=d2t).to(target.dtype)


class _DrafterCache:
    """Keys/values of the drafter's context rows with a validity mask; chain rows never enter it."""

    def __init__(self):
        self.k = self.v = None
        self.valid: torch.Tensor | None = None

    def past(self, batch: int, device) -> tuple:
        if self.k is None:
            return None, None, torch.zeros(batch, 0, dtype=torch.bool, device=device)
        return self.k, self.v, self.valid

    def append(self, k, v, valid):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.valid = valid if self.valid is None else torch.cat([self.valid, valid], dim=1)

    def select(self, rows: torch.Tensor):
        if self.k is not None:
            self.k, self.v, self.valid = self.k[rows], self.v[rows], self.valid[rows]


@dataclass
class _Context:
    """Drafter rows committed by the last verification, right-aligned: [B, m] each (state [B, m, H])."""

    state: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor

    def select(self, rows: torch.Tensor) -> _Context:
        return _Context(self.state[rows], self.tokens[rows], self.positions[rows], self.valid[rows])


class Eagle3Proposer:
    """EAGLE-3 inference state of one decode call (drafters/base.py `Proposer`).

    Each verification commits rows (fused target state at j, token j + 1) to the
    drafter's cache; a chain then feeds the drafter's own state forward, its
    rows kept out of the cache so that rejected drafts never reach it.
    """

    def __init__(self, drafter: Eagle3Drafter):
        self.d = drafter
        self.cache = _DrafterCache()
        self.ctx: _Context | None = None

    def begin(self, ids, positions, valid, first, out) -> None:
        tokens = torch.cat([ids[:, 1:], first[:, None]], dim=1)
        self.ctx = _Context(self.d.fuse(out.aux_hidden), tokens, positions, valid)

    def propose(self, k: int, pick: Pick):
        d, ctx, cache = self.d, self.ctx, self.cache
        b = ctx.tokens.shape[0]
        pk, pv, pvalid = cache.past(b, ctx.tokens.device)
        out = d.step(ctx.tokens, ctx.state, ctx.positions, pk, pv, attend_mask(pvalid, ctx.valid))
        cache.append(out.keys, out.values, ctx.valid)
        d2t = d.draft_to_target_ids()
        chain_k, chain_v = [], []  # keys of the chain rows d_1..d_i, which never enter the cache
        tokens, logps, probs = [], [], []
        pos = ctx.positions[:, -1:]
        for i in range(k):
            logits = out.logits[:, -1]
            choice, p = pick(logits)
            tokens.append(d2t[choice])
            logps.append(
                torch.log_softmax(logits.to(at_least_fp32(logits.dtype)), -1).gather(1, choice[:, None]).squeeze(1)
            )
            if p is not None:
                full = torch.zeros(b, d.cfg.vocab_size, dtype=p.dtype)
                probs.append(full.index_copy_(1, d2t, p))
            if i == k - 1:
                break
            if i:
                chain_k.append(out.keys)
                chain_v.append(out.values)
            keys = torch.cat([cache.k, *chain_k], dim=2)
            vals = torch.cat([cache.v, *chain_v], dim=2)
            valid = torch.cat([cache.valid, torch.ones(b, len(chain_k), dtype=torch.bool)], dim=1)
            mask = attend_mask(valid, torch.ones(b, 1, dtype=torch.bool))
            out = d.step(tokens[-1][:, None], out.state[:, -1:], pos + i + 1, keys, vals, mask)
        q = torch.stack(probs, 1) if probs else None
        return torch.stack(tokens, 1), q, torch.stack(logps, 1)

    def commit(self, out, emitted, num_emitted, positions) -> None:
        """Right-align the (target state, next token) rows of each row's committed prefix."""
        m = int(num_emitted.max())
        b = emitted.shape[0]
        shift = m - num_emitted  # left padding per row
        src = (torch.arange(m)[None] - shift[:, None]).clamp_min(0)  # [B, m] index into the verify block
        valid = torch.arange(m)[None] >= shift[:, None]
        rows = torch.arange(b)[:, None]
        fused = self.d.fuse(out.aux_hidden[rows, src])
        self.ctx = _Context(fused, emitted[rows, src], positions[rows, src], valid)

    def select(self, keep: torch.Tensor) -> None:
        self.cache.select(keep)
        self.ctx = self.ctx.select(keep)
