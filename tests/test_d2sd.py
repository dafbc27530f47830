"""D²SD: boundary scores, the variable-prefix rows, cascade verification, VP training and the checkpoint layout.

The family-neutral exactness tests (greedy identity, chi-square sampling with its power check, recorded target
log-probs, checkpoint round trip) run for D²SD through the FAMILIES-parametrized fixtures of test_engine and
test_drafters. Draft-OPD replay does not apply yet (a winning row mixes both drafters' tokens): those tests skip it.
"""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import random_prompts
from safetensors.torch import load_file

from draftopd.config import ConfigError, SFTConfig, load_config
from draftopd.drafters import LoadError, export_drafter, load_drafter, read_checkpoint, save_drafter
from draftopd.drafters.d2sd import boundary_scores, top_boundaries
from draftopd.engine.cascade import append_row, cascade_forward
from draftopd.engine.speculative import SpeculativeEngine
from draftopd.messages import SamplingConfig
from draftopd.models.layers import attend_mask
from draftopd.sft.trainer import SFTExample, SFTTrainer
from draftopd.testing import tiny_drafter, tiny_target

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_boundary_scores_are_the_chance_of_exactly_i_accepted():
    conf = torch.tensor([[0.9, 0.5, 0.8, 0.3]], dtype=torch.float64)
    want = [0.1, 0.9 * 0.5, 0.9 * 0.5 * 0.2, 0.9 * 0.5 * 0.8 * 0.7]
    assert boundary_scores(conf)[0].tolist() == pytest.approx(want)
    assert top_boundaries(conf, 2).tolist() == [[1, 3]]  # the two best, in increasing order
    assert top_boundaries(conf, 9).tolist() == [[0, 1, 2, 3]]  # never more than K boundaries


def _prefill(target, prompts):
    """Left-padded prompts in a fresh cache: (cache, valid slots, next position)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], valid[i, width - len(p) :] = torch.tensor(p), True
    cache = target.new_cache()
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    target.forward(ids, positions, attend_mask(torch.zeros(len(prompts), 0, dtype=torch.bool), valid)[:, None], cache)
    return cache, valid, valid.sum(1)


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from draftopd.models.target import TargetModel

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg).double()
    model.config._attn_implementation = "sdpa"
    return TargetModel(model)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cascade_pass_equals_each_row_alone(arch):
    """Shared-prefix attention merged with each row's own by log-sum-exp = the target run on that row alone
    (Qwen3: per-head q/k norms before the rotation)."""
    target = tiny_target(vocab=16) if arch == "llama" else _tiny_qwen3()
    cache, valid, next_pos = _prefill(target, [[3, 4, 5, 6], [7, 8]])
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(2, 16, (2, 3, 5), generator=g)
    positions = next_pos[:, None] + torch.arange(5)
    out = cascade_forward(target, cache, valid, rows, positions, want_aux=True)
    assert out.logits.shape == (2, 3, 5, 16) and cache.get_seq_length() == 4  # the cache is left as it was
    for r in range(3):
        alone = copy.deepcopy(cache)
        mask = attend_mask(valid, torch.ones(2, 5, dtype=torch.bool))[:, None]
        want = target.forward(rows[:, r], positions, mask, alone)
        assert torch.allclose(out.logits[:, r], want.logits, atol=1e-10)
        assert torch.allclose(out.aux_hidden[:, r], want.aux_hidden, atol=1e-10)
        if r == 2:  # appending a chosen row leaves the cache as the plain pass over that row does
            append_row(cache, out.kv, torch.tensor([2, 2]))
            for mine, theirs in zip(cache.layers, alone.layers):
                assert torch.allclose(mine.keys, theirs.keys, atol=1e-12)
                assert torch.allclose(mine.values, theirs.values, atol=1e-12)


def test_rows_keep_the_first_drafters_prefix_and_match_the_vp_grid():
    """Row j keeps the first drafter's first i_j drafts (its boundary) and takes the VP drafter's argmax after
    them, with the log-probs the VP drafter's `score` gives at that grid row and prefix."""
    target = tiny_target(vocab=16)
    drafter = tiny_drafter(target, kind="d2sd", num_candidates=3)
    prompt, k = [3, 4, 5, 6, 7], 6
    proposer = drafter.proposer()
    ids = torch.tensor([prompt])
    out = target.forward(ids, torch.arange(5)[None])
    first = out.logits[:, -1].argmax(-1)
    proposer.begin(ids, torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool), first, out)
    drafts, logps = proposer.propose_rows(k)
    assert drafts.shape == (1, 4, k) and logps.shape == (1, 4, k)
    bounds = top_boundaries(logps[:, 0].exp(), 3)[0].tolist()
    for j, i in enumerate(bounds, start=1):
        assert drafts[0, j, :i].tolist() == drafts[0, 0, :i].tolist()
        assert torch.equal(logps[0, j, :i], logps[0, 0, :i])
        seq = torch.tensor([prompt + [int(first)] + drafts[0, j].tolist()])
        feats = drafter.features(target.forward(seq, torch.arange(seq.shape[1])[None]))
        valid = torch.ones_like(seq, dtype=torch.bool)
        grid = drafter.score(seq, feats, valid, k - i, rows=torch.tensor([[5 + i - 1]]), prefix=torch.tensor([[i + 1]]))
        lp = torch.log_softmax(grid[0, :, 0], -1)
        assert drafts[0, j, i:].tolist() == lp.argmax(-1).tolist()
        assert torch.allclose(logps[0, j, i:], lp.max(-1).values, atol=1e-10)


def test_greedy_rows_win_and_records_name_them():
    """With a trained pair, re-drafted rows win some steps; every step records its row, and stays lossless."""
    from draftopd.testing import train_tiny_drafter

    target = tiny_target(vocab=16)
    drafter = train_tiny_drafter(target, kind="d2sd")
    prompts = random_prompts(12, 16, seed=2)
    alone = SpeculativeEngine(target, None, [1]).generate(prompts, SamplingConfig(40))
    out = SpeculativeEngine(target, drafter, [1]).generate(prompts, SamplingConfig(40, 0.0, 7))
    assert [t.output_ids for t in out] == [t.output_ids for t in alone]
    steps = [s for t in out for s in t.steps]
    assert {s.row for s in steps} <= set(range(5)) and any(s.row > 0 for s in steps)
    assert all(len(s.emitted) == s.num_accepted + 1 for t in out for s in t.steps[:-1])


def test_vp_training_rows_draw_prefixes_as_published():
    target = tiny_target(vocab=16)
    drafter = tiny_drafter(target, kind="d2sd")
    rows = torch.arange(4000).view(1, -1) % 20
    real = torch.ones_like(rows, dtype=torch.bool)
    sets = drafter.training_rows(rows, real, torch.Generator().manual_seed(0))
    assert set(sets) == {"", "vp_"} and torch.equal(sets[""].rows, rows)
    vp = sets["vp_"]
    i = vp.kwargs["prefix"]
    assert torch.equal(vp.rows + 2 - i, rows + 1)  # the same anchors, seen with i tokens
    assert torch.equal(vp.num_depths, 8 - i) and int(i.min()) >= 1 and int(i.max()) <= 7
    freq = torch.bincount(i.flatten(), minlength=8)[1:].double() / i.numel()
    want = torch.tensor([0.9**n for n in range(1, 8)], dtype=torch.float64)
    assert torch.allclose(freq, want / want.sum(), atol=0.03)


def test_sft_trains_both_drafters_at_random_anchors():
    target = tiny_target()
    trajs = SpeculativeEngine(target, None, [1]).generate(
        random_prompts(32, 16, seed=3), SamplingConfig(max_new_tokens=24, temperature=1.0)
    )
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs]
    drafter = tiny_drafter(target, kind="d2sd")
    with pytest.raises(ValueError, match="sft.num_anchors"):
        SFTTrainer(drafter, target, examples, SFTConfig(ttt_depth=7))
    cfg = SFTConfig(epochs=8, batch_size=16, lr=3e-3, ttt_depth=7, depth_decay=math.exp(-1 / 4), num_anchors=6)
    trainer = SFTTrainer(drafter, target, examples, cfg)
    before = {k: v.clone() for k, v in drafter.state().items()}
    metrics = list(trainer.run())
    assert {"kl_0", "vp_kl_0", "vp_acc_0"} <= set(metrics[0])
    vp = [m["vp_kl_0"] + m["vp_kl_1"] for m in metrics]
    assert sum(vp[-3:]) < 0.8 * sum(vp[:3])
    after = drafter.state()
    assert all(not torch.equal(before[k], after[k]) for k in ("first.fc.weight", "vp.fc.weight"))


def test_checkpoint_holds_both_drafters_in_its_own_layout(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, kind="d2sd", num_candidates=3)
    save_drafter(drafter, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["architectures"] == ["D2SDDraftModel"] and cfg["num_candidates"] == 3
    assert cfg["vp_prefix_base"] == 0.9
    for part in ("first_drafter", "vp_drafter"):
        assert cfg[part]["architectures"] == ["DFlashDraftModel"] and cfg[part]["block_size"] == 8
    names = set(load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    assert {"first.fc.weight", "vp.fc.weight", "first.layers.0.self_attn.q_norm.weight", "vp.norm.weight"} <= names
    assert all(n.split(".")[0] in ("first", "vp") for n in names) and not any("embed" in n for n in names)
    assert read_checkpoint(tmp_path / "ckpt")[0] == "d2sd"
    loaded = load_drafter(tmp_path / "ckpt", target, "d2sd")
    assert loaded.num_candidates == 3
    with pytest.raises(LoadError, match="no serving layout"):
        export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "out")
    with pytest.raises(ValueError, match="native"):
        loaded.speculative_config(tmp_path / "ckpt", 4)
    with pytest.raises(ValueError, match="Draft-OPD"):
        loaded.score(torch.zeros(1, 4, dtype=torch.long), None, None, 2, depth_tokens=torch.zeros(1, 2, 3))
    del cfg["vp_drafter"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="vp_drafter"):
        load_drafter(tmp_path / "ckpt", target)


def test_toy_recipe_trains_d2sd_at_random_anchors():
    from draftopd.loading import load_tokenizer

    cfg = load_config(RECIPES / "toy-d2sd-sft.yaml")
    mask = load_tokenizer("toy").convert_tokens_to_ids("<|mask|>")
    d = cfg.drafter
    assert d.kind == "d2sd" and d.mask_token_id == mask and d.block_size == 16 and d.num_candidates == 4
    assert cfg.sft.num_anchors > 0 and cfg.sft.ttt_depth == 15
    assert cfg.sft.depth_decay == pytest.approx(math.exp(-1 / 7), abs=1e-4)
    assert max(cfg.eval.num_draft_tokens) <= d.block_size - 1
    with pytest.raises(ConfigError, match="d2sd"):
        load_config(RECIPES / "toy-dflash-opd.yaml", ["drafter.kind=d2sd"])
