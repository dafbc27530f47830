"""The EAGLE-3 decoder layer in the variants published drafters use, computed as vLLM serves them.

* Llama or Qwen3 layers (`model_type`); Qwen3's normalise each head's q and k
  (`q_norm`, `k_norm`) before the rotation;
* biases: `attention_bias` on q/k/v (and o for Llama layers), `mlp_bias` on the
  Llama MLP, as vLLM's `llama.py`/`qwen3.py` build them;
* rotary scaling `llama3` and `yarn` (vLLM's `llama3_rope.py`,
  `yarn_scaling_rope.py`): the inverse frequencies change, and yarn scales
  cos/sin by its attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from draftopd.models.layers import MLP, RMSNorm, apply_rope

ROPE_TYPES = ("default", "llama3", "yarn")


def _yarn_inv_freq(base: float, dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    factor, orig = rope["factor"], rope["original_max_position_embeddings"]
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)

    def correction(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(rope.get("beta_fast", 32)), correction(rope.get("beta_slow", 1))
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate by the factor
    inv = (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.get("attention_factor") is not None:
        attn = float(rope["attention_factor"])
    elif rope.get("mscale") and rope.get("mscale_all_dim"):
        attn = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
    else:
        attn = mscale(factor)
    return inv, attn


def _llama3_inv_freq(inv: torch.Tensor, rope: dict) -> torch.Tensor:
    factor, low_f, high_f = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    orig = rope["original_max_position_embeddings"]
    wave = 2 * math.pi / inv
    smooth = (orig / wave - low_f) / (high_f - low_f) if low_f != high_f else 0
    mid = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wave < orig / high_f, inv, torch.where(wave > orig / low_f, inv / factor, mid))


def rope_frequencies(head_dim: int, theta: float, rope: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], cos/sin scale) of a rotary embedding with optional scaling."""
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "default":
        return inv, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv, rope), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(theta, head_dim, rope)
    raise ValueError(f"rope scaling '{kind}' is not supported ({', '.join(ROPE_TYPES)})")


class Rotary(nn.Module):
    """cos/sin for integer positions in HF's rotate-half layout, in float32 like vLLM's cache."""

    def __init__(self, head_dim: int, theta: float, rope: dict | None):
        super().__init__()
        inv, self.scale = rope_frequencies(head_dim, theta, rope)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


class Attention(nn.Module):
    """Self-attention whose q/k/v read the 2H-wide [embedding ; state] input."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        hd, nh, nkv, bias = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias
        self.q_proj = nn.Linear(2 * cfg.hidden_size, nh * hd, bias=bias)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, nkv * hd, bias=bias)
        # vLLM's Llama layer biases o_proj with q/k/v; its Qwen3 layer never does
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=bias and cfg.model_type == "llama")
        if cfg.model_type == "qwen3":
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.rotary = Rotary(hd, cfg.rope_theta, cfg.rope_scaling)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """Rotated q [B, nh, T, D] and k, v [B, nh, T, D] (kv heads repeated for GQA)."""
        b, t, _ = x.shape
        hd, nh, nkv = self.cfg.head_dim, self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q = self.q_proj(x).view(b, t, nh, hd)
        k = self.k_proj(x).view(b, t, nkv, hd)
        if self.cfg.model_type == "qwen3":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, nkv, hd).transpose(1, 2)
        cos, sin = self.rotary(positions, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if nkv != nh:
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        return q, k, v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))


class MidLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias and cfg.model_type == "llama")
