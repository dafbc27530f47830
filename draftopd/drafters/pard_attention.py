"""PARD's attention over all its mask copies, in memory linear in the tokens.

Training (and Draft-OPD's replay) runs every kept token of every copy in one pass: T tokens, T up to K times the
text. The copy-i query at position p sees copy 0 up to p - i and one mask per copy of its own chain
(`layout_rows`), so a dense [B, 1, T, T] mask, and the attention weights sdpa keeps for backward beside it, grew
with T squared: 10.81x the saved bytes for 4x the text at depth 4 (tests/test_pard.py's shape), where the other
families are linear.

Here the model is handed the layout instead of the mask: per token its copy, position and whether it may be a key
([B, 1, T, 3] int64, the shape Hugging Face passes through to the attention as a prepared 4-D mask). The attention
builds each query chunk's rows of the mask from it and runs sdpa on that chunk; past `CHUNK_ELEMENTS` the chunks go
through activation checkpointing, so backward keeps q, k and v and recomputes each chunk's mask and weights.
Every row's numbers are sdpa's on the same keys, so the logits and gradients are the dense path's (float64: to
rounding, tests/test_pard.py). A boolean mask (the proposer's, a few tokens per step) takes Hugging Face's sdpa.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ATTENTION = "draftopd_pard"  # the attention implementation's name in transformers' AttentionInterface

# elements of one chunk's [B, H, rows, T] score block (as DFlash's block attention): 64 Mi, ~1 GiB in float32 with
# the few such blocks backward holds at once
CHUNK_ELEMENTS = 1 << 26


def layout_rows(copy: torch.Tensor, pos: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """[stop - start, T] boolean: which keys the queries start..stop-1 may attend (before key validity).

    Query a = (i, p) sees the real token (0, q) with q <= p - i and the mask (j, q) of its own chain, 1 <= j <= i
    and q = p - i + j; wrap-around queries (p < i) see only their chain's masks.
    """
    qc, qp = copy[start:stop, None], pos[start:stop, None]
    base = qp - qc  # position of the last real token the query sees
    real = (copy[None] == 0) & (pos[None] <= base)
    chain = (copy[None] >= 1) & (copy[None] <= qc) & (pos[None] == base + copy[None])
    return real | chain


def layout(copy: torch.Tensor, pos: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
    """The [B, T, 3] int64 layout the attention reads: copy [T] and position [T] of each token, and key_ok [B, T]
    (whether the token may be attended as a key)."""
    b = key_ok.shape[0]
    return torch.stack([copy.expand(b, -1), pos.expand(b, -1), key_ok.long()], -1)


def layout_mask(lay: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """[B, stop - start, T] boolean: the mask rows of queries start..stop-1; every query keeps itself."""
    copy, pos, key_ok = lay[0, :, 0], lay[0, :, 1], lay[:, :, 2].bool()
    rows = layout_rows(copy, pos, start, stop)[None] & key_ok[:, None, :]
    eye = torch.arange(start, stop, device=lay.device)[:, None] == torch.arange(lay.shape[1], device=lay.device)
    return rows | eye[None]


def _chunk(q, k, v, lay, start: int, scale: float | None):
    mask = layout_mask(lay, start, start + q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)


def pard_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: (out [B, T, H, Dh], None). `attention_mask` a layout [B, 1, T, 3]
    (int64) is computed chunk by chunk; anything else goes to transformers' sdpa."""
    if attention_mask is None or attention_mask.dtype != torch.long:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    from transformers.integrations.sdpa_attention import repeat_kv

    if dropout:
        raise ValueError("PARD's chunked attention has no dropout (the draft LM trains without it)")
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    lay = attention_mask[:, 0]
    b, h, t, _ = query.shape
    rows = max(1, CHUNK_ELEMENTS // max(1, b * h * t))
    if t <= rows or not torch.is_grad_enabled():
        out = _chunk(query, key, value, lay, 0, scaling)
    else:
        parts = [
            checkpoint(_chunk, query[:, :, a : a + rows], key, value, lay, a, scaling, use_reentrant=False)
            for a in range(0, t, rows)
        ]
        out = torch.cat(parts, 2)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make `ATTENTION` an attention implementation transformers' models can be set to (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, pard_attention)
