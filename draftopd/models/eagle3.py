"""The EAGLE-3 drafter: fused target states + one decoder layer + a draft-vocabulary head.

Layout and maths follow what vLLM's `llama_eagle3.py` loads and computes, so a
checkpoint saved here is served as is:

* `fc` fuses the concatenated aux states of the target ([B, T, n_aux * H_t] -> H);
  with `fc_norm`, each aux state first goes through its own RMSNorm
  (`fc_norm.{i}.weight`), one of the two attention-drift fixes;
* `midlayer`: the q/k/v input is `cat(input_layernorm(embed(token)), hidden_norm(state))`
  (2H wide); the residual is the un-normed state; then a Llama MLP block;
* `norm` then `lm_head` over the draft vocabulary; `d2t[i]` maps draft id i to
  target id `i + d2t[i]`, `t2d` marks target ids present in the draft vocabulary;
* the state fed to the next chain step is the residual stream before `norm`,
  or after it with `norm_output` (the other drift fix).

The token embedding is the target's, frozen and never saved with the drafter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from draftopd.models.layers import MLP, RMSNorm, apply_rope, at_least_fp32, rope_cos_sin

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

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    def to_hf(self) -> dict:
        """config.json as vLLM and SGLang read it for `method: eagle3`."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
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
            "norm_output": self.norm_output,
            "fc_norm": self.fc_norm,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf(cls, d: dict) -> Eagle3Config:
        if ARCHITECTURE not in d.get("architectures", []) and d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"not an EAGLE-3 drafter config (architectures={d.get('architectures')})")
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
            rope_theta=d.get("rope_theta", 10000.0),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            norm_output=bool(d.get("norm_output", False)),
            fc_norm=bool(d.get("fc_norm", False)),
            head_dim=d.get("head_dim") or 0,
        )


class Attention(nn.Module):
    """Self-attention whose q/k/v read the 2H-wide [embedding ; state] input."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(2 * cfg.hidden_size, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """Rotated q [B, nh, T, D] and k, v [B, nh, T, D] (kv heads repeated for GQA)."""
        b, t, _ = x.shape
        hd, nh, nkv = self.cfg.head_dim, self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q = self.q_proj(x).view(b, t, nh, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, nkv, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, nkv, hd).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, hd, self.cfg.rope_theta, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if nkv != nh:
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        return q, k, v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


@dataclass
class DrafterStep:
    """Outputs of one drafter forward: draft-vocab logits, the state to feed on, and k/v of the new rows."""

    logits: torch.Tensor
    state: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. `embed_weight` is the target's embedding matrix (shared, frozen)."""

    def __init__(self, cfg: Eagle3Config, embed_weight: torch.Tensor, d2t: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        if embed_weight.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"target embedding {tuple(embed_weight.shape)} does not match the drafter's "
                f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})"
            )
        self.embed = nn.Embedding.from_pretrained(embed_weight.detach().clone(), freeze=True)
        n_aux = len(cfg.aux_layer_ids) or 3
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
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
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def _attn_input(self, input_ids: torch.Tensor, state: torch.Tensor):
        m = self.midlayer
        x = torch.cat([m.input_layernorm(self.embed(input_ids)), m.hidden_norm(state)], dim=-1)
        return x, state

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
        """
        b, n = input_ids.shape[0], input_ids.shape[1] - 1
        attn = self.midlayer.self_attn
        state = self.fuse(aux[:, :n])
        pos = torch.arange(n, device=input_ids.device).expand(b, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
        mask0 = causal[None] & key_valid[:, None, :n]  # [B, T, T]
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
            scores0 = (q @ ks[0].transpose(-1, -2)) * scale
            scores0 = scores0.masked_fill(~mask0[:, None], float("-inf"))
            diag = torch.stack([(q * kk).sum(-1) * scale for kk in ks[1:]], dim=-1) if d else None
            scores = scores0 if diag is None else torch.cat([scores0, diag], dim=-1)
            probs = torch.softmax(scores.to(at_least_fp32(q.dtype)), dim=-1).to(q.dtype).nan_to_num(0.0)
            o = probs[..., :n] @ vs[0]
            for e in range(1, d + 1):
                o = o + probs[..., n + e - 1 : n + e] * vs[e]
            logits, state = self._finish(attn.out(o), residual)
            outs.append(logits)
            if trace is not None:
                own = probs[..., n:].sum(-1).mean(1) if d else torch.zeros_like(state[..., 0])
                trace.append({"own_mass": own.detach(), "state_norm": state.norm(dim=-1).detach()})
        return outs

    def forward(self, *args, **kwargs) -> list[torch.Tensor]:
        """The training pass (`ttt_forward`), so that wrappers such as a DeepSpeed engine can call the module."""
        return self.ttt_forward(*args, **kwargs)

    # ---- checkpoints -------------------------------------------------------

    def numpy_state(self) -> dict:
        """`checkpoint_state` as numpy copies: what crosses process boundaries (never views of live buffers).

        numpy has no bfloat16: those tensors travel as float32 (exact) and are cast back on load.
        """
        out = {}
        for k, v in self.checkpoint_state().items():
            v = v.detach().cpu()
            out[k] = (v.float() if v.dtype == torch.bfloat16 else v.clone()).numpy()
        return out

    @classmethod
    def from_state(cls, drafter_config: dict, state: dict, embed_weight: torch.Tensor) -> Eagle3Drafter:
        """A drafter from a config.json dict and `numpy_state` arrays, bound to `embed_weight`."""
        tensors = state_to_tensors(state)
        drafter = cls(Eagle3Config.from_hf(drafter_config), embed_weight, d2t=tensors["d2t"])
        drafter.load_state_dict(tensors, strict=False)
        return drafter.to(embed_weight.dtype)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Weights under the names vLLM's EAGLE-3 loader expects (no embedding)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed.")}

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.checkpoint_state().items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(self.cfg.to_hf(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, embed_weight: torch.Tensor) -> Eagle3Drafter:
        from safetensors.torch import load_file

        path = Path(path)
        for name in ("config.json", "model.safetensors"):
            if not (path / name).is_file():
                raise FileNotFoundError(f"drafter checkpoint {path} has no {name}")
        from draftopd.models.formats import read_config

        cfg = Eagle3Config.from_hf(read_config(path))  # either serving layout
        tensors = load_file(str(path / "model.safetensors"))
        model = cls(cfg, embed_weight, d2t=tensors.get("d2t"))
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        missing = [m for m in missing if not m.startswith("embed.")]
        if missing or unexpected:
            raise ValueError(f"drafter checkpoint {path}: missing {missing}, unexpected {unexpected}")
        return model.to(embed_weight.dtype)


def state_to_tensors(state: dict) -> dict[str, torch.Tensor]:
    """numpy arrays (possibly read-only, from Ray's object store) -> writable tensors."""
    import numpy as np

    return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()}
