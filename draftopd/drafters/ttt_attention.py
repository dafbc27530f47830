"""The attention of EAGLE-3's training-time test (TTT), in memory linear in the sequence length.

At TTT depth d, query row t attends to the depth-0 keys of rows <= t that are valid, and to its own row's keys of
depths 1..d (always valid): what a chain of drafts started after token t+1 sees at inference. Materialising the
[B, H, T, T + d] scores at every depth and keeping them for backward made training memory quadratic in T (8.1x
the saved bytes for 4x the tokens at depth 7; about 43 GiB per sequence at the qwen3-8b drafter's 4,608 tokens).

`ttt_attention` computes the same numbers query chunk by query chunk, each chunk against the causal keys it can
see (keys after its last row are skipped), and keeps for backward only q, the keys and values (which later depths
reuse, so they are stored once) and each row's log-sum-exp; backward recomputes each chunk's probabilities from
them, as flash attention does, in plain torch so that it runs the same on CPU and CUDA. `dense_ttt_attention` is
the former computation, kept as the reference the tests compare against.

Shapes: q [B, H, T, Dh]; `keys`/`values` lists of 1 + d tensors [B, Hkv, T, Dh] (H a multiple of Hkv: head h
reads kv head h // (H / Hkv), as `repeat_interleave` pairs them); `key_valid` [B, T]; the log-sum-exp [B, H, T]
in float32 (float64 for float64 inputs); a row with no key at all (depth 0, no valid key) outputs zeros.
"""

from __future__ import annotations

import torch

from draftopd.models.layers import at_least_fp32

# elements of one chunk's [B, Hkv, group * chunk, T] score block: 64 Mi, so that the few such blocks backward
# holds at once stay near 1 GiB in float32 (the qwen3-8b drafter at 4,608 tokens gets chunks of 448 rows)
CHUNK_ELEMENTS = 1 << 26


def ttt_attention(q, keys, values, key_valid, scale: float, chunk: int = 0):
    """(out [B, H, T, Dh] in q's dtype, log-sum-exp [B, H, T], not differentiable); `chunk` 0: sized by memory."""
    b, h, n, _ = q.shape
    chunk = chunk or _chunk_rows(b, h, n)
    return _TTTAttention.apply(key_valid, scale, chunk, len(keys), q, *keys, *values)


def diagonal_mass(q, keys, lse, scale: float) -> torch.Tensor:
    """Attention mass each row puts on its own depth-1..d keys (the drafter's own drafts), [B, H, T], detached."""
    with torch.no_grad():
        if len(keys) == 1:
            return torch.zeros_like(lse)
        q5 = _grouped(q, keys[0].shape[1])
        diag = torch.stack([_diag_scores(q5, k, scale) for k in keys[1:]], -1).to(lse.dtype)
        return torch.exp(diag - lse.view(diag.shape[:-1])[..., None]).sum(-1).reshape(lse.shape)


def dense_mask(key_valid: torch.Tensor) -> torch.Tensor:
    """[B, T, T] boolean: the causal depth-0 keys each row may see (the dense reference's mask)."""
    n = key_valid.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=key_valid.device).tril()
    return causal[None] & key_valid[:, None, :]


def dense_ttt_attention(q, keys, values, mask, scale: float):
    """The former dense computation (reference only: keeps [B, H, T, T + d] tensors for backward).

    `keys`/`values` here carry all H heads (kv heads already repeated) and `mask` is `dense_mask(key_valid)`.
    """
    n = q.shape[2]
    scores0 = (q @ keys[0].transpose(-1, -2)) * scale
    scores0 = scores0.masked_fill(~mask[:, None], float("-inf"))
    diag = torch.stack([(q * kk).sum(-1) * scale for kk in keys[1:]], dim=-1) if len(keys) > 1 else None
    scores = scores0 if diag is None else torch.cat([scores0, diag], dim=-1)
    wide = scores.to(at_least_fp32(q.dtype))
    probs = torch.softmax(wide, dim=-1).to(q.dtype).nan_to_num(0.0)
    o = probs[..., :n] @ values[0]
    for e in range(1, len(keys)):
        o = o + probs[..., n + e - 1 : n + e] * values[e]
    return o, torch.logsumexp(wide.detach(), dim=-1)


def _chunk_rows(b: int, h: int, n: int) -> int:
    rows = max(1, CHUNK_ELEMENTS // max(1, b * h * n))
    return n if rows >= n else max(64, rows // 64 * 64)


def _grouped(x: torch.Tensor, hk: int) -> torch.Tensor:
    """[B, H, c, Dh] -> [B, Hkv, g, c, Dh]: the query heads that share each kv head."""
    b, h, c, dh = x.shape
    return x.reshape(b, hk, h // hk, c, dh)


def _diag_scores(q5: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Row t's score against its own row of `k` [B, Hkv, c, Dh]: [B, Hkv, g, c]."""
    return (q5 * k[:, :, None]).sum(-1) * scale


def _chunk_scores(q5, keys, mask, i0: int, i1: int, scale: float):
    """Scores of query rows i0..i1 (q5 [B, Hkv, g, c, Dh]) against depth-0 keys 0..i1 and the row's own keys.

    Returns [B, Hkv, g, c, i1 + d] in q's dtype, the depth-0 part masked to -inf where `mask` [B, c, i1] is False.
    """
    b, hk, g, c, dh = q5.shape
    k0 = keys[0][:, :, :i1]
    s0 = (q5.reshape(b, hk, g * c, dh) @ k0.transpose(-1, -2)) * scale
    s0 = s0.view(b, hk, g, c, i1).masked_fill(~mask[:, None, None], float("-inf"))
    if len(keys) == 1:
        return s0
    diag = torch.stack([_diag_scores(q5, k[:, :, i0:i1], scale) for k in keys[1:]], dim=-1)
    return torch.cat([s0, diag], dim=-1)


def _chunk_mask(key_valid: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
    rows = torch.arange(i0, i1, device=key_valid.device)[:, None]
    cols = torch.arange(i1, device=key_valid.device)[None]
    return (cols <= rows)[None] & key_valid[:, None, :i1]


class _TTTAttention(torch.autograd.Function):
    """Chunked exact attention over causal depth-0 keys plus per-row diagonal keys; backward recomputes."""

    @staticmethod
    def forward(ctx, key_valid, scale, chunk, num_keys, q, *kv):
        keys, values = kv[:num_keys], kv[num_keys:]
        b, h, n, dh = q.shape
        hk, acc = keys[0].shape[1], at_least_fp32(q.dtype)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(b, hk, h // hk, n, dtype=acc, device=q.device)
        for i0 in range(0, n, chunk):
            i1 = min(n, i0 + chunk)
            q5 = _grouped(q[:, :, i0:i1], hk)
            scores = _chunk_scores(q5, keys, _chunk_mask(key_valid, i0, i1), i0, i1, scale).to(acc)
            probs = torch.softmax(scores, dim=-1).to(q.dtype).nan_to_num(0.0)
            lse[..., i0:i1] = torch.logsumexp(scores, dim=-1)
            o = (probs[..., :i1].reshape(b, hk, -1, i1) @ values[0][:, :, :i1]).view(q5.shape)
            for e in range(1, num_keys):
                o = o + probs[..., i1 + e - 1 : i1 + e] * values[e][:, :, None, i0:i1]
            out[:, :, i0:i1] = o.reshape(b, h, i1 - i0, dh)
        lse = lse.view(b, h, n)
        ctx.save_for_backward(key_valid, q, lse, *kv)
        ctx.scale, ctx.chunk, ctx.num_keys = scale, chunk, num_keys
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        key_valid, q, lse, *kv = ctx.saved_tensors
        scale, chunk, num_keys = ctx.scale, ctx.chunk, ctx.num_keys
        keys, values = kv[:num_keys], kv[num_keys:]
        b, h, n, dh = q.shape
        hk, acc = keys[0].shape[1], at_least_fp32(q.dtype)
        # a row with no key at all has lse -inf and zero probabilities: +inf makes exp(s - lse) 0 there
        lse = torch.where(torch.isfinite(lse), lse, torch.inf).view(b, hk, h // hk, n)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dkv = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in kv]
        dk, dv = dkv[:num_keys], dkv[num_keys:]
        for i0 in range(0, n, chunk):
            i1 = min(n, i0 + chunk)
            c = i1 - i0
            q5, do5 = _grouped(q[:, :, i0:i1], hk), _grouped(grad_out[:, :, i0:i1], hk)
            scores = _chunk_scores(q5, keys, _chunk_mask(key_valid, i0, i1), i0, i1, scale).to(acc)
            probs = torch.exp(scores - lse[..., i0:i1, None])
            p0 = probs[..., :i1].to(q.dtype).reshape(b, hk, -1, i1)
            do4 = do5.reshape(b, hk, -1, dh)
            dp = (do4 @ values[0][:, :, :i1].transpose(-1, -2)).view(*q5.shape[:-1], i1)
            if num_keys > 1:
                diag = [(do5 * v[:, :, None, i0:i1]).sum(-1) for v in values[1:]]
                dp = torch.cat([dp.to(acc), torch.stack(diag, -1).to(acc)], dim=-1)
            dp = dp.to(acc)
            ds = probs * (dp - (probs * dp).sum(-1, keepdim=True)) * scale
            ds0 = ds[..., :i1].to(q.dtype).reshape(b, hk, -1, i1)
            dq5 = (ds0 @ keys[0][:, :, :i1]).view(q5.shape)
            dk[0][:, :, :i1] += ds0.transpose(-1, -2) @ q5.reshape(b, hk, -1, dh)
            dv[0][:, :, :i1] += p0.transpose(-1, -2) @ do4
            for e in range(1, num_keys):
                de = ds[..., i1 + e - 1 : i1 + e].to(q.dtype)
                dq5 = dq5 + de * keys[e][:, :, None, i0:i1]
                dk[e][:, :, i0:i1] += (de * q5).sum(2)
                dv[e][:, :, i0:i1] += (probs[..., i1 + e - 1 : i1 + e].to(q.dtype) * do5).sum(2)
            dq[:, :, i0:i1] = dq5.reshape(b, h, c, dh)
        grads = [g.to(x.dtype) for g, x in zip(dkv, kv)]
        return None, None, None, None, dq, *grads
