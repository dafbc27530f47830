"""The attention of EAGLE-3's training-time test (TTT), in memory linear in the sequence length.

At TTT depth d, query row t attends to the depth-0 keys of rows <= t that are valid, and to its own row's keys of
depths 1..d (always valid): what a chain of drafts started after token t+1 sees at inference. Materialising the
[B, H, T, T + d] scores at every depth and keeping them for backward made training memory quadratic in T (8.5x
the saved bytes for 4x the tokens at depth 7; 43 GiB per sequence at the qwen3-8b drafter's 4,608 tokens).

`ttt_attention` computes the same numbers query chunk by query chunk, each chunk against the causal keys it can
see (keys after its last row are skipped), and keeps for backward only q and the keys and values, which later
depths reuse, so that they are stored once; backward recomputes each chunk's scores and softmax (flash
attention's trade, in plain torch so that it runs the same on CPU and CUDA). Within a chunk the operations are
the dense ones, in the order autograd ran them, so with one chunk (the toy and mid sizes) and kv heads given
repeated, as the drafter does, logits and gradients are the former ones bit for bit and SFT reproduces exactly.
Grouped kv heads ([B, Hkv, T, Dh]) are computed too and would save another 5% at qwen3-8b, at the cost of
summing each kv head's gradient in another order. `dense_ttt_attention` is the former computation, kept as the
reference the tests compare against.

Shapes: q [B, H, T, Dh]; `keys`/`values` lists of 1 + d tensors [B, Hkv, T, Dh] (H a multiple of Hkv: head h
reads kv head h // (H / Hkv), as `repeat_interleave` pairs them); `key_valid` [B, T]. A row with no key at all
(depth 0, no valid key) outputs zeros and passes no gradient, as the dense path's `nan_to_num` made it.
"""

from __future__ import annotations

import torch

from draftopd.models.layers import at_least_fp32

# elements of one chunk's [B, Hkv, group * chunk, T] score block: 64 Mi, so that the few such blocks backward
# holds at once stay near 1 GiB in float32 (the qwen3-8b drafter at 4,608 tokens gets chunks of 448 rows)
CHUNK_ELEMENTS = 1 << 26


def ttt_attention(q, keys, values, key_valid, scale: float, chunk: int = 0):
    """(out [B, H, T, Dh] in q's dtype, own mass [B, H, T]); `chunk` 0: rows per chunk sized by memory.

    The own mass is the attention each row puts on its depth-1..d keys (the drafter's own drafts), detached.
    """
    b, h, n, _ = q.shape
    chunk = chunk or _chunk_rows(b, h, n)
    return _TTTAttention.apply(key_valid, scale, chunk, len(keys), q, *keys, *values)


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
    own = probs[..., n:].sum(-1) if len(keys) > 1 else torch.zeros_like(probs[..., 0])
    return o, own.detach()


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
    """Chunked exact attention over causal depth-0 keys plus per-row diagonal keys; backward recomputes.

    Each chunk's forward and backward are the dense path's operations on the chunk's rows (the same softmax, its
    backward, the same casts and scalings), so that with one chunk and kv heads given repeated the numbers are the
    dense path's bit for bit.
    """

    @staticmethod
    def forward(ctx, key_valid, scale, chunk, num_keys, q, *kv):
        keys, values = kv[:num_keys], kv[num_keys:]
        b, h, n, dh = q.shape
        hk, acc = keys[0].shape[1], at_least_fp32(q.dtype)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        own = torch.zeros(b, hk, h // hk, n, dtype=q.dtype, device=q.device)
        for i0 in range(0, n, chunk):
            i1 = min(n, i0 + chunk)
            q5 = _grouped(q[:, :, i0:i1], hk)
            scores = _chunk_scores(q5, keys, _chunk_mask(key_valid, i0, i1), i0, i1, scale).to(acc)
            probs = torch.softmax(scores, dim=-1).to(q.dtype).nan_to_num(0.0)
            o = (probs[..., :i1].reshape(b, hk, -1, i1) @ values[0][:, :, :i1]).view(q5.shape)
            for e in range(1, num_keys):
                o = o + probs[..., i1 + e - 1 : i1 + e] * values[e][:, :, None, i0:i1]
            out[:, :, i0:i1] = o.reshape(b, h, i1 - i0, dh)
            if num_keys > 1:
                own[..., i0:i1] = probs[..., i1:].sum(-1)
        ctx.save_for_backward(key_valid, q, *kv)
        ctx.scale, ctx.chunk, ctx.num_keys = scale, chunk, num_keys
        own = own.view(b, h, n)
        ctx.mark_non_differentiable(own)
        return out, own

    @staticmethod
    def backward(ctx, grad_out, _grad_own):
        key_valid, q, *kv = ctx.saved_tensors
        scale, chunk, num_keys = ctx.scale, ctx.chunk, ctx.num_keys
        keys, values = kv[:num_keys], kv[num_keys:]
        b, h, n, dh = q.shape
        hk, acc = keys[0].shape[1], at_least_fp32(q.dtype)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dkv = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in kv]
        dk, dv = dkv[:num_keys], dkv[num_keys:]
        for i0 in range(0, n, chunk):
            i1 = min(n, i0 + chunk)
            mask = _chunk_mask(key_valid, i0, i1)
            q5, do5 = _grouped(q[:, :, i0:i1], hk), _grouped(grad_out[:, :, i0:i1], hk)
            scores = _chunk_scores(q5, keys, mask, i0, i1, scale).to(acc)
            probs = torch.softmax(scores, dim=-1)
            p = probs.to(q.dtype)
            # gradient w.r.t. the probabilities the forward multiplied the values with
            dp = (do5.reshape(b, hk, -1, dh) @ values[0][:, :, :i1].transpose(-1, -2)).view(*q5.shape[:-1], i1)
            diag = [(do5 * v[:, :, None, i0:i1]).sum(-1, keepdim=True) for v in values[1:]]
            dp = torch.cat([dp, *diag], dim=-1) * p.isfinite()  # nan_to_num's backward: rows without keys get 0
            ds = torch._softmax_backward_data(dp.to(acc), probs, -1, acc).to(q.dtype)
            ds0 = ds[..., :i1].masked_fill(~mask[:, None, None], 0.0) * scale
            p0 = p[..., :i1].nan_to_num(0.0)
            dq5 = None
            dk[0][:, :, :i1] += (ds0.transpose(-1, -2) @ q5).sum(2)
            dv[0][:, :, :i1] += (p0.transpose(-1, -2) @ do5).sum(2)
            for e in reversed(range(1, num_keys)):
                de = ds[..., i1 + e - 1 : i1 + e] * scale
                dq_e = de * keys[e][:, :, None, i0:i1]
                dq5 = dq_e if dq5 is None else dq5 + dq_e
                dk[e][:, :, i0:i1] += (de * q5).sum(2)
                dv[e][:, :, i0:i1] += (p[..., i1 + e - 1 : i1 + e] * do5).sum(2)
            dq_0 = (ds0.reshape(b, hk, -1, i1) @ keys[0][:, :, :i1]).view(q5.shape)
            dq5 = dq_0 if dq5 is None else dq5 + dq_0
            dq[:, :, i0:i1] = dq5.reshape(b, h, i1 - i0, dh)
        grads = [g.to(x.dtype) for g, x in zip(dkv, kv)]
        return None, None, None, None, dq, *grads
