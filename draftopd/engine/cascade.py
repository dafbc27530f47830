"""One target pass over several candidate rows that share the committed prefix: cascade attention in plain torch.

R rows of T new tokens each continue the same committed prefix (D²SD's
candidate rows). In every layer each row's queries attend to the prefix keys
and values already in the target's cache, computed once per sequence and
shared by its rows, and, causally, to the row's own new keys and values; the
two partial attentions are merged by their log-sum-exp:
lse = logaddexp(lse_prefix, lse_own), o = e^(lse_prefix - lse) o_prefix + e^(lse_own - lse) o_own.
This equals attention over [prefix ; own row] with a causal mask, row by row.

The decoder layers are the target's own Hugging Face modules, called piece by
piece (norms, projections, rotary embedding, MLP), so this holds for Llama-
and Qwen-style dense decoders; sliding-window attention and attention sinks
are refused. The cache is left as it was; `append_row` adds one chosen row.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from draftopd.models.layers import at_least_fp32
from draftopd.models.target import TargetModel


@dataclass
class RowsOutput:
    """Logits [B, R, T, V], aux states [B, R, T, n_aux * H] or None, and per layer the rows' own keys and
    values [B, R, h_kv, T, D] (rotated, as the cache holds them)."""

    logits: torch.Tensor
    aux_hidden: torch.Tensor | None
    kv: list[tuple[torch.Tensor, torch.Tensor]]


def partial_attention(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of attention with `scores` [..., T, S] (-inf: masked) over values [..., S, D];
    a query that sees nothing gets output 0 and lse -inf, so that it weighs nothing in a merge."""
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(scores.dtype).min))
    return probs @ values, lse


def merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two key sets from the two partial results."""
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * o_a + torch.exp(lse_b - lse)[..., None] * o_b


def cascade_attention(q, k, v, k_prefix, v_prefix, prefix_valid, scale: float) -> torch.Tensor:
    """q [B, R, h, T, D]; own k, v [B, R, h_kv, T, D]; shared k_prefix, v_prefix [B, h_kv, S, D];
    prefix_valid [B, S]. Returns [B, R, h, T, D]."""
    b, r, h, t, d = q.shape
    hkv = k.shape[2]
    work = at_least_fp32(q.dtype)
    qg = q.reshape(b, r, hkv, h // hkv, t, d).to(work)  # query heads grouped by their key/value head
    s_pre = torch.einsum("brkgtd,bksd->brkgts", qg, k_prefix.to(work)) * scale
    s_pre = s_pre.masked_fill(~prefix_valid[:, None, None, None, None, :], float("-inf"))
    o_pre, lse_pre = partial_attention(s_pre, v_prefix.to(work)[:, None, :, None])
    s_own = torch.einsum("brkgtd,brkjd->brkgtj", qg, k.to(work)) * scale
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    o_own, lse_own = partial_attention(s_own.masked_fill(~causal, float("-inf")), v.to(work)[:, :, :, None])
    return merge(o_pre, lse_pre, o_own, lse_own).reshape(b, r, h, t, d).to(q.dtype)


def _check(attn) -> None:
    if getattr(attn, "sliding_window", None) or hasattr(attn, "sinks"):
        raise ValueError("cascade verification handles full attention only (no sliding window, no sinks)")


@torch.no_grad()
def cascade_forward(
    target: TargetModel, cache, prefix_valid: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, want_aux: bool
) -> RowsOutput:
    """Rows `ids` [B, R, T] at `positions` [B, T] after the prefix in `cache` (valid slots `prefix_valid` [B, S])."""
    model = target.model.model
    b, r, t = ids.shape
    x = model.embed_tokens(ids.reshape(b * r, t))
    cos, sin = model.rotary_emb(x, positions.repeat_interleave(r, 0))
    captured = {0: x}
    kv = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        _check(attn)
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        h = layer.input_layernorm(x)
        q, k, v = (proj(h).view(b * r, t, -1, attn.head_dim) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        q, k, v = (z.unflatten(0, (b, r)) for z in (q, k, v))  # [B, R, heads, T, D]
        layer_cache = cache.layers[i]
        o = cascade_attention(q, k, v, layer_cache.keys, layer_cache.values, prefix_valid, attn.scaling)
        x = x + attn.o_proj(o.flatten(0, 1).transpose(1, 2).reshape(b * r, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        captured[i + 1] = x
        kv.append((k, v))
    logits = target.lm_head()(model.norm(x)).view(b, r, t, -1)
    aux = None
    if want_aux:
        aux = torch.cat([captured[i] for i in target.aux_layer_ids], -1).view(b, r, t, -1)
    return RowsOutput(logits, aux, kv)


def append_row(cache, kv: list[tuple[torch.Tensor, torch.Tensor]], row: torch.Tensor) -> None:
    """Append row `row` [B] of each sequence's own keys and values to the cache (its T new slots)."""
    at = torch.arange(row.shape[0], device=row.device)
    for i, (k, v) in enumerate(kv):
        cache.update(k[at, row], v[at, row], i)
