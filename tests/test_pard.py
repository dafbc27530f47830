"""PARD / PARD-2: the published mask, position and label layout, COD's kept counts and chains, CAT weights, the
feature drop that trains the target-independent mode, both decode modes lossless, SFT, the refusals, and the toy
draft LM builder.

The family-neutral exactness tests (greedy identity, chi-square sampling, checkpoint round trip) run for PARD in
its target-dependent mode through the FAMILIES-parametrized fixtures of test_engine and test_drafters.
"""

import json
import math
import random
from pathlib import Path

import pytest
import torch
from conftest import random_prompts
from test_ttt_memory import family_saved_bytes

from draftopd.config import ConfigError, DrafterConfig, SFTConfig, load_config
from draftopd.drafters import FAMILIES, load_drafter, new_drafter, save_drafter
from draftopd.drafters.pard import cat_weights, cod_keep, copy_layout
from draftopd.engine.speculative import SpeculativeEngine
from draftopd.messages import SamplingConfig
from draftopd.sft.trainer import SFTExample, SFTTrainer, collate
from draftopd.testing import tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, tiny_drafter(target, kind="pard")


def test_mask_positions_and_labels_are_the_published_layout():
    """K = 3 copies of L = 5: the copy-i query at p sees x_0..x_{p-i} and its chain's masks at p-i+1..p."""
    copy, pos, mask = copy_layout([torch.arange(5)] * 3)
    assert copy.tolist() == [0] * 5 + [1] * 5 + [2] * 5 and pos.tolist() == list(range(5)) * 3
    at = {(c, p): j for j, (c, p) in enumerate(zip(copy.tolist(), pos.tolist()))}

    def sees(c, p):
        return {k for k, j in at.items() if mask[at[(c, p)], j]}

    # Hand-built from the reference rule (drafter-families.md A1).
    assert sees(0, 3) == {(0, 0), (0, 1), (0, 2), (0, 3)}  # copy 0: plain causal text
    assert sees(1, 3) == {(0, 0), (0, 1), (0, 2), (1, 3)}  # first mask after x_0..x_2
    assert sees(2, 4) == {(0, 0), (0, 1), (0, 2), (1, 3), (2, 4)}  # second mask after x_0..x_2
    assert sees(2, 2) == {(0, 0), (1, 1), (2, 2)}
    assert sees(2, 1) == {(1, 0), (2, 1)}  # wrap-around (p < i): no real token, no label either


def test_grid_logits_are_the_chain_run_alone(pair):
    """Row t, depth d of `score` equals the draft LM run causally on [x_0..x_{t+1}, mask x d] and nothing else:
    the 4-D mask and the positions isolate each chain, and its logit predicts x_{t+2+d}."""
    target, drafter = pair
    ids = torch.randint(2, 16, (1, 9))
    feats = drafter.features(target.forward(ids, torch.arange(9)[None]))
    grid = drafter.score(ids, feats, torch.ones(1, 9, dtype=torch.bool), 4)
    assert grid.shape == (1, 4, 8, 16)
    for t, d in [(0, 0), (2, 1), (3, 3), (4, 2), (6, 1)]:
        chain = torch.cat([ids[:, : t + 2], torch.zeros(1, d, dtype=torch.long)], 1)  # mask id 0 in tiny drafters
        n = chain.shape[1]
        f = torch.cat([feats[:, : t + 2], feats[:, t + 1 : t + 2].expand(-1, d, -1)], 1)  # masks copy x_{t+1}'s
        alone = drafter.run(chain, torch.arange(n)[None], torch.ones(1, n, n, dtype=torch.bool).tril(), f)
        torch.testing.assert_close(grid[0, d, t], alone[0, -1], rtol=0, atol=1e-10)


def _dense_copies(drafter, input_ids, features, valid, kept):
    """`copies` as it ran before the layout: the whole [B, T, T] boolean mask into transformers' sdpa."""
    copy, pos, mask = copy_layout(kept)
    real_pos = pos.clamp_max(input_ids.shape[1] - 1)
    ids = torch.where(copy == 0, input_ids[:, real_pos], torch.full_like(input_ids[:, real_pos], drafter.mask_token_id))
    key_ok = (copy != 0)[None] | valid[:, real_pos]
    mask = (mask[None] & key_ok[:, None, :]) | torch.eye(len(pos), dtype=torch.bool)[None]
    base = pos - copy
    feats = features[:, base.clamp_min(0)] * (base >= 0)[None, :, None].to(features.dtype)
    return drafter.run(ids, pos.expand(input_ids.shape[0], -1), mask, feats)


@pytest.mark.parametrize("elements", [None, 4 * 8 * 12])  # one chunk; chunks of 12 query rows, checkpointed
def test_the_copies_layout_attention_gives_the_dense_masks_logits_and_gradients(pair, monkeypatch, elements):
    from draftopd.drafters import pard_attention

    if elements:
        monkeypatch.setattr(pard_attention, "CHUNK_ELEMENTS", elements)
    target, drafter = pair
    torch.manual_seed(3)
    ids = torch.randint(2, 16, (2, 11))
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, :2] = False  # left padding: keys that no query may see
    feats = drafter.features(target.forward(ids, torch.arange(11).expand(2, 11))).detach()
    kept = cod_keep(11, 5, 0.7, 0.3, torch.Generator().manual_seed(1))  # with wrap-around chains
    params = [p for p in drafter.parameters() if p.requires_grad]
    runs = []
    for run in (
        lambda f: drafter.copies(ids, f, valid, kept)[0],
        lambda f: _dense_copies(drafter, ids, f, valid, kept),
    ):
        f = feats.clone().requires_grad_()
        logits = run(f)
        g = torch.Generator().manual_seed(5)
        loss = (logits * torch.randn(logits.shape, generator=g, dtype=logits.dtype)).sum()
        runs.append([logits, *torch.autograd.grad(loss, [f, *params])])
    assert runs[0][0].shape[1] == sum(len(k) for k in kept) > 4 * 8 * 12 // (2 * 4 * 11)
    for new, old in zip(*runs):
        torch.testing.assert_close(new, old, rtol=1e-12, atol=1e-12)


def _pard_saved_bytes(drafter, length: int) -> int:
    """Bytes `score` over `length` tokens at depth 4 keeps for backward (Draft-OPD's replay: every row, four
    copies), counted as tests/test_ttt_memory.py counts them."""
    return family_saved_bytes(drafter, length, drafter.target_proj.in_features)


def test_pard_training_memory_grows_linearly(monkeypatch):
    """4x the tokens keep at most 5x the bytes for backward once the copies are chunked (as long sequences are);
    the whole mask in one pass, the former computation, grows quadratically."""
    from draftopd.drafters import pard_attention

    drafter = tiny_drafter(tiny_target(vocab=64, hidden=256, dtype=torch.float32), kind="pard").to("meta")
    monkeypatch.setattr(pard_attention, "CHUNK_ELEMENTS", 1 << 20)
    short, long = _pard_saved_bytes(drafter, 512), _pard_saved_bytes(drafter, 2048)
    assert long / short <= 5.0, (short / 2**20, long / 2**20)
    monkeypatch.setattr(pard_attention, "CHUNK_ELEMENTS", 1 << 62)  # never chunked
    short, long = _pard_saved_bytes(drafter, 512), _pard_saved_bytes(drafter, 2048)
    assert long / short > 5.0, (short / 2**20, long / 2**20)


def test_cod_keeps_the_published_counts_and_whole_chains():
    g = torch.Generator().manual_seed(0)
    kept = cod_keep(20, 8, 0.7, 0.2, g)
    # int(L * max(r^i, r_min)): 20, 14, 9 (9.8), 6 (6.86), 4 (4.8), then the floor 0.2 * 20 = 4
    assert [len(k) for k in kept] == [20, 14, 9, 6, 4, 4, 4, 4]
    for i in range(1, 8):
        prev = set(kept[i - 1].tolist())
        assert all((p - 1) % 20 in prev for p in kept[i].tolist())  # every kept mask keeps its chain
    assert len({tuple(cod_keep(20, 8, 0.7, 0.2, g)[3].tolist()) for _ in range(5)}) > 1  # a fresh draw each time
    assert [len(k) for k in cod_keep(64, 16, 0.7, 0.1)][-1] == 6  # PARD-2's floor at K = 16


def test_cat_weights_are_the_targets_probabilities_of_the_tokens_in_between():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [0.5, 0.5, 3.0], [2.0, 1.0, 0.0]]], dtype=torch.float64)
    ids = torch.tensor([[2, 1, 0, 2]])
    w = cat_weights(logits, ids, 3)

    def p(j):  # g_j = p_target(x_j | x_<j), by hand
        row = logits[0, j - 1].tolist()
        return math.exp(row[ids[0, j]]) / sum(math.exp(v) for v in row)

    g = [1.0, p(1), p(2), p(3)]
    assert w[0, 0].tolist() == [1.0] * 4
    # copy i's logit at p predicts x_{p+1} from a context ending at x_{p-i}: weight g_{p-i+1} ... g_p
    assert w[0, 1].tolist() == pytest.approx([g[0], g[1], g[2], g[3]], abs=1e-12)
    assert w[0, 2].tolist() == pytest.approx([1.0, g[0] * g[1], g[1] * g[2], g[2] * g[3]], abs=1e-12)


def _batch(target):
    trajs = SpeculativeEngine(target, None, [1]).generate(
        random_prompts(8, 16, seed=4), SamplingConfig(max_new_tokens=16, temperature=1.0)
    )
    return collate([SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs], 64)


def test_feature_drop_trains_the_target_independent_mode(pair):
    """A dropped sample sees exactly the TI model; with COD off the losses agree to the bit, and the TI logits
    are the plain draft LM's (the projection has no bias)."""
    target, drafter = pair
    batch = _batch(target)
    out = target.forward(batch.input_ids, torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids))
    whole = SFTConfig(cod_ratio=1.0, cod_min=1.0)

    def loss(drop, td=True):
        drafter.target_dependent = td
        try:
            cfg = SFTConfig(**{**whole.__dict__, "feature_drop": drop})
            return drafter.sft_loss(batch, out, 4, cfg, torch.Generator().manual_seed(0))[0]
        finally:
            drafter.target_dependent = True

    assert torch.equal(loss(1.0), loss(0.0, td=False))
    assert not torch.allclose(loss(0.0), loss(0.0, td=False))
    drafter.target_dependent = False
    try:
        ti = drafter.score(batch.input_ids, drafter.features(out), batch.valid, 1)
    finally:
        drafter.target_dependent = True
    plain = drafter.lm(batch.input_ids).logits[:, 1:]
    real = batch.valid[:, 1:]  # right padding: a real query sees the same keys in both
    assert torch.allclose(ti[:, 0][real], plain[real], atol=1e-10)


def test_cod_loss_counts_tokens_and_sft_learns(pair):
    target, _ = pair
    trajs = SpeculativeEngine(target, None, [1]).generate(
        random_prompts(32, 16, seed=3), SamplingConfig(max_new_tokens=24, temperature=1.0)
    )
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs]
    cfg = SFTConfig(epochs=8, batch_size=16, lr=3e-3, ttt_depth=8, cod_min=0.2)
    trainer = SFTTrainer(tiny_drafter(target, kind="pard"), target, examples, cfg)
    metrics = list(trainer.run())
    for m in metrics:  # each step ran on COD's published count of tokens for its batch length L, not K * L
        length = m["full_tokens"] // 8
        assert m["tokens"] == sum(len(k) for k in cod_keep(length, 8, 0.7, 0.2)) < m["full_tokens"]
    assert {"ce", "kd", "acc_0", "acc_7"} <= set(metrics[0])
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 16 and sum(losses[-3:]) < 0.8 * sum(losses[:3])


def test_one_pass_drafts_are_the_training_grid_in_both_modes(pair):
    """The proposer's K drafts after the prefill are the argmax of `score` at the last row, depths 0..K-1."""
    target, drafter = pair
    prompt = [3, 4, 5, 6, 7]
    picked = []

    def pick(logits):
        picked.append(logits)
        return logits.argmax(-1), None

    for td in (True, False):
        drafter.target_dependent = td
        picked.clear()
        try:
            proposer = drafter.proposer()
            ids = torch.tensor([prompt])
            out = target.forward(ids, torch.arange(5)[None], want_aux=td)
            first = out.logits[:, -1].argmax(-1)
            proposer.begin(ids, torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool), first, out)
            drafts, _, _ = proposer.propose(4, pick)
            # Three arbitrary later tokens give the grid room for depths 1..3; row 4's chains never see them.
            full = torch.cat([ids, first[:, None], torch.tensor([[9, 9, 9]])], 1)
            feats = drafter.features(target.forward(full, torch.arange(9)[None]))
            grid = drafter.score(full, feats, torch.ones(1, 9, dtype=torch.bool), 4)
            # row t = 4: context ends at the first emitted token (position 5); depth d predicts position 6 + d
            rows = torch.stack([grid[0, d, 4] for d in range(4)])
            torch.testing.assert_close(picked[0], rows, rtol=0, atol=1e-10)
            assert drafts[0].tolist() == rows.argmax(-1).tolist()
        finally:
            drafter.target_dependent = True


@pytest.mark.parametrize("tiny_pair", ["pard"], indirect=True)
@pytest.mark.parametrize("target_dependent", [True, False])
def test_both_modes_are_lossless_at_temperature_zero(tiny_pair, target_dependent):
    target, drafter = tiny_pair
    drafter.target_dependent = target_dependent
    try:
        prompts = random_prompts(12, target.vocab_size, seed=7)
        alone = SpeculativeEngine(target, None, [1]).generate(prompts, SamplingConfig(max_new_tokens=40))
        accepted = 0
        for k in (3, 7):
            out = SpeculativeEngine(target, drafter, [1]).generate(prompts, SamplingConfig(40, 0.0, k))
            assert [t.output_ids for t in out] == [t.output_ids for t in alone]
            accepted += sum(s.num_accepted for t in out for s in t.steps)
        assert accepted > 50
    finally:
        drafter.target_dependent = True


def test_target_independent_mode_is_lossless_when_sampling(pair):
    """The chi-square check of test_engine, in the TI mode (the FAMILIES fixtures run the TD mode)."""
    from test_engine import FALSE_ALARM, chi_square_p_value, exact_distribution, sample_counts

    target = tiny_target(vocab=8, hidden=32, seed=5, sharpness=1.5)
    drafter = tiny_drafter(target, seed=6, kind="pard")
    drafter.target_dependent = False
    probs, _ = exact_distribution(target, [2, 3, 4], 3)
    counts, trajs = sample_counts(target, drafter, [2, 3, 4], 3, 2, rows=20000, seed=12)
    assert chi_square_p_value(counts, probs) > FALSE_ALARM
    rates = [s.num_accepted for t in trajs for s in t.steps]
    assert 0 < sum(rates) < len(rates) * 2


def test_checkpoint_is_a_llama_with_pard_token_and_its_ti_mode_is_that_llama(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    target, drafter = pair
    save_drafter(drafter, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["pard_token"] == 0
    assert cfg["pard_config"] == {"target_layer_ids": [1, 2, 3], "target_hidden_size": 32, "feat_scale": 0.02}
    loaded = load_drafter(tmp_path, target, "pard")
    assert "pard" in FAMILIES and loaded.kind == "pard"
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64)  # ignores target_proj
    ids = torch.randint(2, 16, (1, 7))
    loaded.target_dependent = False
    grid = loaded.score(ids, None, torch.ones(1, 7, dtype=torch.bool), 1)
    assert torch.allclose(grid[0, 0], plain(ids).logits[0, 1:], atol=1e-10)


def test_draft_opd_takes_pard_with_native_rollouts_and_refuses_vllm_rollouts_in_one_line():
    """Replay equal to recorded, the two streams and the loop run for PARD in test_opd*.py (FAMILIES). vLLM's
    draft model takes PARD pushes (test_pard_vllm.py) but runs the TI mode only, not the TD one Draft-OPD
    trains."""
    cfg = load_config(ROOT / "recipes" / "toy-pard2-opd.yaml", [])
    assert cfg.opd.enabled and cfg.drafter.kind == "pard" and cfg.rollout.backend == "native"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["drafter.kind=pard", "opd.enabled=true", "rollout.backend=vllm", "learner.rej_coef=0"])
    assert "target-dependent" in str(err.value) and "\n" not in str(err.value)


def test_cat_weights_on_the_replay_grid_are_the_targets_probabilities_of_the_drafts_in_between():
    """Row t, depth d predicts token t + 2 + d from a context ending at t + 1: it weighs the target's
    probabilities of tokens t + 2 .. t + 1 + d, each given the text before it."""
    from draftopd.opd.replay import cat_grid

    g = torch.Generator().manual_seed(3)
    logits, ids = torch.randn(2, 9, 11, generator=g, dtype=torch.float64), torch.randint(0, 11, (2, 9), generator=g)
    grid = cat_grid(logits, ids, 4)
    p = torch.softmax(logits, -1)
    for b in range(2):
        for d in range(4):
            for t in range(8):
                want = (
                    0.0
                    if t + 2 + d > 8
                    else float(
                        torch.prod(
                            torch.stack(
                                [p[b, j - 1, ids[b, j]] for j in range(t + 2, t + 2 + d)] or [torch.tensor(1.0)]
                            )
                        )
                    )
                )
                assert grid[b, d, t].item() == pytest.approx(want, rel=1e-6)


def test_the_vllm_export_is_the_ti_mode_and_the_td_checkpoint_is_refused_in_one_line(pair, tmp_path):
    """vLLM serves the TI mode (draft_model + parallel_drafting) from the export; the training checkpoint, which
    holds target_proj, asks for the TD mode, which no stock vLLM method computes (test_pard_vllm.py serves it)."""
    from safetensors.torch import load_file

    from draftopd.drafters import LoadError, export_drafter, inspect_checkpoint

    target, drafter = pair
    pard = FAMILIES["pard"]
    ckpt = save_drafter(drafter, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="target-dependent mode has no stock vLLM method") as err:
        pard.speculative_config(ckpt, 4)
    assert "\n" not in str(err.value)
    with pytest.raises(LoadError, match="a 'pard' drafter exports to vllm only, not 'speculators'") as err:
        export_drafter(ckpt, "speculators", tmp_path / "other")
    assert "\n" not in str(err.value)
    out = export_drafter(ckpt, "vllm", tmp_path / "vllm")
    spec = {"method": "draft_model", "model": str(out), "num_speculative_tokens": 4, "parallel_drafting": True}
    assert pard.speculative_config(out, 4) == spec
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["pard_token"] == 0
    assert cfg["pard_config"]["target_dependent"] is False and "mask_token_id" not in cfg
    assert set(load_file(str(out / "model.safetensors"))) == set(drafter.lm.state_dict())  # no target_proj
    assert "modes: TI only (vLLM: draft_model, parallel_drafting)" in inspect_checkpoint(out)
    # the export loads here as the TI mode of the same drafter, in both settings of target_dependent
    ti = load_drafter(out, target)
    assert not ti.target_dependent and ti.needs == "none" and not ti.target_proj.weight.any()
    ids = torch.randint(2, 16, (1, 7))
    valid = torch.ones(1, 7, dtype=torch.bool)
    feats = drafter.features(target.forward(ids, torch.arange(7)[None]))
    drafter.target_dependent = False
    try:
        want = drafter.score(ids, None, valid, 3)
    finally:
        drafter.target_dependent = True
    assert torch.equal(ti.score(ids, None, valid, 3), want)
    assert torch.equal(ti.score(ids, feats, valid, 3), want)  # features through a zero projection change nothing


def test_make_toy_draft_lm_trains_a_llama_with_the_targets_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM

    from draftopd.cli import build_parser
    from draftopd.loading import load_target, load_tokenizer
    from draftopd.toy.corpus import arithmetic_sample
    from draftopd.toy.draft_lm import ToyDraftLMSpec, make_toy_draft_lm

    args = build_parser().parse_args(["make-toy-draft-lm", "--out", str(tmp_path), "--minutes", "0.5"])
    assert args.minutes == 0.5 and args.target == "toy"
    spec = ToyDraftLMSpec(hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, seq_len=32)
    spec.batch_size, spec.minutes = 4, 0.02
    rng = random.Random(0)  # arithmetic samples of the toy corpus (its code half takes seconds to gather)
    corpus = [arithmetic_sample(rng) for _ in range(60)], [arithmetic_sample(rng) for _ in range(10)]
    report = make_toy_draft_lm(tmp_path, "toy", spec, corpus)
    assert report["train_steps"] > 0 and math.isfinite(report["held_out_loss_nats_per_token"])
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    tok = load_tokenizer("toy")
    assert model.config.vocab_size == len(tok) and tok.convert_tokens_to_ids("<|mask|>") == 5
    # drafter.base_lm: PARD conversion starts from exactly these weights, features read from four toy layers
    target = load_target("toy", [1, 2, 3, 4])
    cfg = DrafterConfig(kind="pard", base_lm=str(tmp_path), mask_token_id=5)
    drafter = new_drafter(cfg, target, torch.arange(target.vocab_size))
    assert drafter.aux_layer_ids == [1, 2, 3, 4] and drafter.target_proj.weight.shape == (16, 4 * 256)
    for name, weight in model.state_dict().items():
        assert torch.equal(drafter.lm.state_dict()[name], weight), name


def test_the_shipped_toy_draft_lm_is_what_the_toy_recipe_converts():
    """`drafter.base_lm: toy` is the shipped draft LM: the toy target's vocabulary, trained well past uniform."""
    from draftopd.loading import ASSETS, load_target

    cfg = load_config(ROOT / "recipes" / "toy-pard2-sft.yaml", [])
    target = load_target("toy", cfg.target.aux_layer_ids)
    drafter = new_drafter(cfg.drafter, target, torch.arange(target.vocab_size))
    report = json.loads((ASSETS / "toy-draft-lm" / "toy_draft_lm_report.json").read_text())
    assert report["held_out_loss_nats_per_token"] < 0.2 * report["uniform_loss_nats_per_token"]
    assert drafter.lm.config.vocab_size == target.vocab_size and drafter.mask_token_id == 5
    assert sum(p.numel() for p in drafter.lm.parameters()) == report["num_parameters"]
