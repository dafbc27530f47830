"""Small Llama building blocks shared by the drafters: RMSNorm, rotary embedding, SwiGLU MLP, cache masks."""

from __future__ import annotations

import torch
from torch import nn


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, the dtype itself otherwise (float64 tests stay float64)."""
    return torch.promote_types(dtype, torch.float32)


def attend_mask(past_valid: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
    """[B, T, S + T] boolean: valid past slots, causal within the T new rows, and always the row itself."""
    t = new_valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=new_valid.device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=new_valid.device)
    new = (causal[None] & new_valid[:, None, :]) | eye[None]
    return torch.cat([past_valid[:, None, :].expand(-1, t, -1), new], dim=-1)


class RMSNorm(nn.Module):
    """Llama's RMSNorm, computed in float32 like the reference and the serving engines."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(at_least_fp32(dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [..., head_dim] for integer positions, in the rotate-half layout of HF Llama."""
    # float32 like HF Llama and vLLM's rotary cache, so all three agree on the angles.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
