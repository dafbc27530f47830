"""EAGLE-3's training-time-test attention: the chunked path computes the dense path's numbers in linear memory.

Saved activations are counted with `torch.autograd.graph.saved_tensors_hooks`: every tensor autograd keeps for
backward, deduplicated by storage (views and tensors reused across depths count once), each storage's full size,
the drafter's parameters and buffers left out. The shape runs on the meta device, which saves exactly what CPU
does (checked below) without computing, so the T = 2,048 figure costs well under a second.
"""

import pytest
import torch

from draftopd.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftopd.drafters.ttt_attention import dense_mask, dense_ttt_attention, ttt_attention
from draftopd.testing import tiny_drafter, tiny_target


def saved_bytes(drafter: Eagle3Drafter, length: int, attention: str, depth: int = 7, device: str = "meta") -> int:
    """Bytes of the storages one `ttt_forward` over `length` rows (B = 1) keeps for backward."""
    ids = torch.zeros(1, length + 1, dtype=torch.long, device=device)
    aux = torch.randn(1, length + 1, drafter.fc.in_features, device=device)
    valid = torch.ones(1, length + 1, dtype=torch.bool, device=device)
    weights = {t.untyped_storage()._cdata for t in [*drafter.parameters(), *drafter.buffers()]}
    seen = {}

    def pack(x):
        s = x.untyped_storage()
        if s._cdata not in weights:
            seen[s._cdata] = s.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        drafter.ttt_forward(ids, aux, valid, depth, attention=attention)
    return sum(seen.values())


def mid_drafter(device: str = "meta", hidden: int = 512) -> Eagle3Drafter:
    """The issue's measuring shape: hidden 512, 8 heads (4 kv heads), a 1,024-token draft vocabulary."""
    cfg = Eagle3Config(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=2048,
        draft_vocab_size=1024,
        target_hidden_size=hidden,
        aux_layer_ids=[1, 2, 3],
    )
    torch.manual_seed(0)
    return Eagle3Drafter(cfg, torch.randn(2048, hidden) * 0.02).to(device)


def grads(outputs, inputs, seed: int = 5):
    """Gradients of a fixed random projection of the outputs (so every logit's gradient counts)."""
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def padded_valid(batch: int, length: int) -> torch.Tensor:
    """Row 1 left-padded by 3 with a hole at 6: its first rows see no depth-0 key at all."""
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :3] = False
    valid[1, 6] = False
    return valid


@pytest.mark.parametrize("chunk", [0, 3, 5])
def test_chunked_attention_equals_the_dense_one(chunk):
    torch.manual_seed(0)
    b, h, hk, n, dh = 2, 4, 2, 11, 8
    q = torch.randn(b, h, n, dh, dtype=torch.float64, requires_grad=True)
    ks = [torch.randn(b, hk, n, dh, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    vs = [torch.randn(b, hk, n, dh, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    valid = padded_valid(b, n)
    for depth in range(1, 5):
        out, own = ttt_attention(q, ks[:depth], vs[:depth], valid, 0.3, chunk)
        rep = [x.repeat_interleave(h // hk, 1) for x in ks[:depth] + vs[:depth]]
        ref, ref_own = dense_ttt_attention(q, rep[:depth], rep[depth:], dense_mask(valid), 0.3)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(own, ref_own, atol=1e-12, rtol=1e-12)
        assert out.isfinite().all()
        if depth == 1:  # rows before the first valid key see nothing: zeros, as the dense path's nan_to_num gives
            assert not out[1, :, :3].any()
        inputs = [q, *ks[:depth], *vs[:depth]]
        for a, r in zip(grads([out], inputs), grads([ref], inputs)):
            assert a.isfinite().all()
            torch.testing.assert_close(a, r, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("opts", [{}, {"head_dim": 16}, {"norm_output": True, "fc_norm": True}])
@pytest.mark.parametrize("depth", [1, 4])
def test_ttt_logits_and_gradients_equal_the_dense_path(opts, depth):
    target = tiny_target()
    drafter = tiny_drafter(target, draft_vocab=12, **opts)
    torch.manual_seed(3)
    ids = torch.randint(2, 16, (2, 12))
    aux = target.forward(ids, torch.arange(12).expand(2, 12)).aux_hidden.detach().requires_grad_()
    valid = padded_valid(2, 12)
    drafts = torch.randint(2, 16, (2, depth, 11))  # Draft-OPD's replayed drafts as the inputs of depths >= 1
    params = [p for p in drafter.parameters() if p.requires_grad]
    for tokens in (None, drafts):
        runs = {}
        for attention in ("chunked", "dense"):
            trace = []
            logits = drafter.ttt_forward(ids, aux, valid, depth, tokens, trace, attention=attention)
            runs[attention] = logits, grads(logits, [aux, *params]), trace
        (lc, gc, tc), (ld, gd, td) = runs["chunked"], runs["dense"]
        for a, r in zip(lc, ld):
            torch.testing.assert_close(a, r, atol=1e-12, rtol=1e-12)
        for a, r in zip(gc, gd):
            torch.testing.assert_close(a, r, atol=1e-11, rtol=1e-11)
        for a, r in zip(tc, td):
            torch.testing.assert_close(a["own_mass"], r["own_mass"], atol=1e-12, rtol=1e-12)
    assert drafter.ttt_forward(ids, aux, valid, 1)[0].requires_grad  # the default is the chunked path
    with pytest.raises(ValueError, match="chunked, dense"):
        drafter.ttt_forward(ids, aux, valid, 1, attention="flash")


def test_float32_ttt_is_the_dense_path_bit_for_bit():
    """One chunk, kv heads repeated: the same operations in the same order, so SFT on CPU reproduces exactly."""
    target = tiny_target(dtype=torch.float32, hidden=64)
    drafter = tiny_drafter(target, draft_vocab=12)
    torch.manual_seed(4)
    ids = torch.randint(2, 16, (3, 40))
    aux = target.forward(ids, torch.arange(40).expand(3, 40)).aux_hidden.detach().requires_grad_()
    valid = padded_valid(3, 40)
    params = [p for p in drafter.parameters() if p.requires_grad]
    runs = {}
    for attention in ("chunked", "dense"):
        logits = drafter.ttt_forward(ids, aux, valid, 7, attention=attention)
        runs[attention] = [*logits, *grads(logits, [aux, *params])]
    assert all(torch.equal(a, r) for a, r in zip(runs["chunked"], runs["dense"]))


def test_bfloat16_chunked_attention_is_as_close_to_float64_as_the_dense_one():
    torch.manual_seed(1)
    b, h, hk, n, dh, depth = 1, 4, 2, 96, 32, 4
    exact = [torch.randn(b, h if i == 0 else hk, n, dh, dtype=torch.float64) for i in range(1 + 2 * depth)]
    valid = torch.ones(b, n, dtype=torch.bool)

    def run(path, dtype):
        xs = [x.to(dtype).requires_grad_() for x in exact]
        q, ks, vs = xs[0], xs[1 : 1 + depth], xs[1 + depth :]
        if path == "dense":
            rep = [x.repeat_interleave(h // hk, 1) for x in ks + vs]
            out, _ = dense_ttt_attention(q, rep[:depth], rep[depth:], dense_mask(valid), dh**-0.5)
        else:
            out, _ = ttt_attention(q, ks, vs, valid, dh**-0.5, chunk=40)
        return [out.detach().double(), *(g.double() for g in grads([out.float()], xs))]

    ref = run("dense", torch.float64)
    err = {}
    for path in ("chunked", "dense"):
        err[path] = max(float((a - r).abs().max() / r.abs().max()) for a, r in zip(run(path, torch.bfloat16), ref))
    assert err["chunked"] < 0.02 and err["chunked"] < 1.5 * err["dense"], err


def test_saved_activations_count_on_meta_as_on_cpu():
    """The meta device keeps what CPU keeps, byte for byte (so the long-sequence figures below are real)."""
    cpu, meta = mid_drafter("cpu", hidden=64), mid_drafter("meta", hidden=64)
    for attention in ("chunked", "dense"):
        assert saved_bytes(meta, 48, attention, depth=3) == saved_bytes(cpu, 48, attention, depth=3, device="cpu")


def test_saved_activations_grow_linearly_with_the_sequence():
    drafter = mid_drafter()
    short, long = saved_bytes(drafter, 512, "chunked"), saved_bytes(drafter, 2048, "chunked")
    assert long / short <= 5.0, (short / 2**20, long / 2**20)


def test_the_dense_path_grows_quadratically():
    """The same measure on the former computation: the ratio test above would fail on it."""
    drafter = mid_drafter()
    short, long = saved_bytes(drafter, 512, "dense"), saved_bytes(drafter, 2048, "dense")
    assert long / short > 5.0, (short / 2**20, long / 2**20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bfloat16_ttt_equals_the_dense_path():
    drafter = mid_drafter("cuda").to(torch.bfloat16)
    ids = torch.randint(0, 2048, (2, 513), device="cuda")
    aux = torch.randn(2, 513, 3 * 512, device="cuda", dtype=torch.bfloat16)
    valid = torch.ones(2, 513, dtype=torch.bool, device="cuda")
    valid[1, :40] = False
    params = [p for p in drafter.parameters() if p.requires_grad]
    runs = {}
    for attention in ("chunked", "dense"):
        logits = drafter.ttt_forward(ids, aux, valid, 7, attention=attention)
        runs[attention] = [x.float() for x in logits], grads([x.float() for x in logits], params)
    for a, r in zip(runs["chunked"][0], runs["dense"][0]):
        torch.testing.assert_close(a, r, atol=0.1, rtol=0.05)
    for a, r in zip(runs["chunked"][1], runs["dense"][1]):
        assert float((a - r).norm() / r.norm()) < 0.05


# ---- DFlash (and D²SD's two DFlash drafters): block attention over many rows, chunked under autograd -------------


def family_saved_bytes(drafter, length: int, feature_width: int = 0) -> int:
    """`saved_bytes` for a one-pass family scoring every row (Draft-OPD's replay), depth 4, on the meta device;
    the target features are `feature_width` wide (default DFlash's: three target layers)."""
    ids = torch.zeros(1, length, dtype=torch.long, device="meta")
    feats = torch.randn(1, length, feature_width or 3 * drafter.cfg.hidden_size, device="meta")
    valid = torch.ones(1, length, dtype=torch.bool, device="meta")
    weights = {t.untyped_storage()._cdata for t in [*drafter.parameters(), *drafter.buffers()]}
    seen = {}

    def pack(x):
        if x.untyped_storage()._cdata not in weights:
            seen[x.untyped_storage()._cdata] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        drafter.score(ids, feats, valid, 4)
    return sum(seen.values())


def test_dflash_chunked_block_attention_equals_the_whole(monkeypatch):
    from draftopd.drafters import dflash

    target = tiny_target()
    drafter = tiny_drafter(target, kind="dflash")
    torch.manual_seed(2)
    ids = torch.randint(2, 16, (2, 14))
    feats = drafter.features(target.forward(ids, torch.arange(14).expand(2, 14))).detach().requires_grad_()
    valid = padded_valid(2, 14)
    params = [p for p in drafter.parameters() if p.requires_grad]
    runs = []
    for elements in (dflash.CHUNK_ELEMENTS, 2 * 4 * 8 * 14 * 3):  # the second: chunks of 3 rows
        monkeypatch.setattr(dflash, "CHUNK_ELEMENTS", elements)
        grid = drafter.score(ids, feats, valid, 7)
        runs.append([grid, *grads([grid], [feats, *params])])
    for a, r in zip(*runs):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=1e-12)


def test_dflash_training_memory_grows_linearly(monkeypatch):
    from draftopd.drafters import dflash

    drafter = tiny_drafter(tiny_target(vocab=64, hidden=256, dtype=torch.float32), kind="dflash").to("meta")
    monkeypatch.setattr(dflash, "CHUNK_ELEMENTS", 1 << 20)  # both lengths chunked, as long sequences are
    short, long = family_saved_bytes(drafter, 512), family_saved_bytes(drafter, 2048)
    assert long / short <= 5.0, (short / 2**20, long / 2**20)
    monkeypatch.setattr(dflash, "CHUNK_ELEMENTS", 1 << 62)  # never chunked: the former computation
    short, long = family_saved_bytes(drafter, 512), family_saved_bytes(drafter, 2048)
    assert long / short > 5.0, (short / 2**20, long / 2**20)
