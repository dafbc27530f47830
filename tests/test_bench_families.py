"""`draftopd bench families`: the analytic FLOPs on hand-computed configs, and one tiny CLI run of the shipped
EAGLE-3 drafter beside fresh DFlash and D²SD drafters (lossless, measured passes, tau from the step records)."""

import json
from types import SimpleNamespace

import pytest

from draftopd.bench.families import dflash_flops, eagle3_flops, pard_flops, step_flops
from draftopd.cli import main
from draftopd.data.prompts import encode_chats, toy_prompts
from draftopd.drafters import load_drafter, save_drafter
from draftopd.drafters.dflash import DFlashConfig
from draftopd.drafters.eagle3 import Eagle3Config
from draftopd.engine.speculative import SpeculativeEngine
from draftopd.eval.acceptance import acceptance_stats
from draftopd.loading import eos_ids, load_target, load_tokenizer
from draftopd.messages import SamplingConfig
from draftopd.testing import tiny_drafter


def test_flops_follow_the_documented_formulas_on_hand_computed_configs():
    # H=4, MLP 8, 2 heads of 2, 1 kv head; K=3 drafts, c=2 committed rows, L=5 context keys.
    e3 = Eagle3Config(4, 8, 2, 1, vocab_size=10, draft_vocab_size=10, target_hidden_size=4, aux_layer_ids=[1, 2, 3])
    # fc 3*4*4 = 48 per committed row; a row: q/k/v 8*(2+2)*2 = 64, o 2*2*4 = 16, MLP 3*4*8 = 96,
    # attention 2*2*2*5 = 40, head 4*10 = 40 -> 256; rows c + K - 1 = 4.
    assert eagle3_flops(e3, 3, 2, 5) == 2 * (2 * 48 + 4 * 256)
    df = DFlashConfig(4, 8, 2, 2, 1, vocab_size=10, block_size=3, mask_token_id=0, aux_layer_ids=[1, 2])
    # context row: fc 2*4*4 = 32 + 2 layers * k,v 2*1*2*4 = 32 -> 64; block row per layer: q/k/v 4*4*2 = 32,
    # o 16, MLP 96, attention 2*2*2*(5+3) = 64 -> 208, times 2 layers * 3 rows; head K=2 rows * 4*10.
    block = 2 * 3 * 208 + 2 * 4 * 10
    assert dflash_flops(df, 2, 2, 5) == 2 * (2 * 64 + block) == 2912
    assert dflash_flops(df, 2, 2, 5, blocks=2) == 2 * (2 * 64 + 2 * block)
    # D²SD: the first block plus min(num_candidates, K) = 2 VP blocks, each drafter with its own context rows.
    d2 = SimpleNamespace(kind="d2sd", first=SimpleNamespace(cfg=df), vp=SimpleNamespace(cfg=df), num_candidates=4)
    assert step_flops(d2, 2, 2, 5) == 2912 + 2 * (2 * 64 + 2 * block)
    # PARD: c + K - 1 = 3 rows through 2 layers of the draft LM (H=4, MLP 8, 2 heads of 2, 1 kv head): a row
    # per layer: q/k/v 4*4*2 = 32, o 16, MLP 96, attention 2*2*2*5 = 40 -> 184; features 6 -> 4: 24 per row;
    # head on K=2 rows: 2*4*10.
    lm = {"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2}
    lm |= {"num_key_value_heads": 1, "head_dim": 2, "vocab_size": 10}
    assert pard_flops(lm, 2, 2, 5, 6) == 2 * (3 * (2 * 184 + 24) + 2 * 4 * 10)
    assert pard_flops(lm, 2, 2, 5, 0) == 2 * (3 * 2 * 184 + 2 * 4 * 10)  # target-independent: no features


def test_bench_families_compares_the_families_losslessly(tmp_path):
    target = load_target("toy", [1, 2, 3])
    save_drafter(tiny_drafter(target, kind="dflash", block_size=4), tmp_path / "dflash")
    save_drafter(tiny_drafter(target, seed=2, kind="dflash", block_size=4), tmp_path / "dflash2")
    save_drafter(tiny_drafter(target, kind="d2sd", block_size=4, num_candidates=2), tmp_path / "d2sd")
    save_drafter(tiny_drafter(target, kind="pard", num_hidden_layers=1), tmp_path / "pard")
    out = tmp_path / "bench"
    argv = ["bench", "families", "--num-eval-prompts", "2", "--max-new-tokens", "24", "--seeds", "0", "1"]
    # df: one drafter per seed (seed 0 draws with dflash, seed 1 with dflash2); d2: one for both seeds.
    df = f"df={tmp_path / 'dflash'},{tmp_path / 'dflash2'}"
    argv += ["--num-draft-tokens", "3", "--drafters", df, f"d2={tmp_path / 'd2sd'}", f"pd={tmp_path / 'pard'}"]
    assert main([*argv, "--pairs", "pd/df", "--json", str(out / "r.json"), "--out", str(out)]) == 0
    r = json.loads((out / "r.json").read_text())
    assert list(r["arms"]) == ["toy-eagle3", "df", "d2", "d2-first", "d2-naive", "pd", "pd-ti"]
    assert (out / "families.png").stat().st_size > 0
    arms = r["arms"]
    # Every arm emits the target alone's tokens; K is the option for EAGLE-3 and block - 1 for the others.
    assert all(a["lossless"] and a["identical_to_target_alone"] == "4/4" for a in arms.values())
    assert [a["num_draft_tokens"] for a in arms.values()] == [3] * 7
    assert [a["kind"] for a in arms.values()] == ["eagle3", "dflash", "d2sd", "dflash", "d2sd", "pard", "pard"]
    # Measured drafter passes per step: K chained for EAGLE-3, one block for DFlash (and D²SD's first drafter
    # alone) and PARD (both modes), two for D²SD (naive too).
    assert [a["passes_per_step"] for a in arms.values()] == [3, 1, 2, 1, 2, 1, 1]
    # D²SD is paired seed by seed with its first drafter alone and with naive resampling.
    for base in ("first", "naive"):
        p = r["pairs"][f"d2/d2-{base}"]
        ratios = [arms["d2"]["seeds"][s]["tau"] / arms[f"d2-{base}"]["seeds"][s]["tau"] for s in ("0", "1")]
        assert p["per_seed_ratio"] == pytest.approx(ratios)
        assert p["ratio"][0] == pytest.approx(sum(ratios) / 2)
    # PARD is paired with its own target-independent mode, and --pairs adds any other pair.
    assert set(r["pairs"]) == {"d2/d2-first", "d2/d2-naive", "pd/pd-ti", "pd/df"}
    ratios = [arms["pd"]["seeds"][s]["tau"] / arms["df"]["seeds"][s]["tau"] for s in ("0", "1")]
    assert r["pairs"]["pd/df"]["per_seed_ratio"] == pytest.approx(ratios)
    for a in arms.values():
        for run in a["seeds"].values():
            assert run["tau"] == pytest.approx(run["num_emitted"] / run["num_steps"])
            assert run["tau_per_pass"] == pytest.approx(run["tau"] / run["passes_per_step"])
    # tau is what the engine records for the same held-out draw (seed 0's prompts).
    tokenizer = load_tokenizer("toy")
    prompts = encode_chats(tokenizer, toy_prompts("held_out", 2, 0))  # seed 0's draw
    for name, path, td in (
        ("toy-eagle3", "draftopd/assets/toy-eagle3", True),
        ("d2", tmp_path / "d2sd", True),
        ("pd", tmp_path / "pard", True),
        ("pd-ti", tmp_path / "pard", False),
    ):
        drafter = load_drafter(path, target)
        if not td:
            drafter.target_dependent = False
        trajs = SpeculativeEngine(target, drafter, eos_ids(tokenizer, "toy")).generate(
            prompts, SamplingConfig(24, 0.0, 3, 0)
        )
        assert arms[name]["seeds"]["0"]["tau"] == pytest.approx(acceptance_stats(trajs, 3)["tau"])
        # Parameters: the module's trainable ones; the shared embedding (and DFlash's head) left out.
        assert arms[name]["params_trainable"] == sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        run = arms[name]["seeds"]["0"]
        assert run["flops_per_step"] == pytest.approx(step_flops(drafter, 3, run["tau"], run["mean_context"]))
    # The per-seed arm ran its second drafter on seed 1's draw.
    second = load_drafter(tmp_path / "dflash2", target)
    trajs = SpeculativeEngine(target, second, eos_ids(tokenizer, "toy")).generate(
        encode_chats(tokenizer, toy_prompts("held_out", 2, 1)), SamplingConfig(24, 0.0, 3, 1)
    )
    assert arms["df"]["seeds"]["1"]["tau"] == pytest.approx(acceptance_stats(trajs, 3)["tau"])
    assert arms["df"]["num_drafters"] == 2
    d2 = load_drafter(tmp_path / "d2sd", target)
    assert arms["d2-naive"]["params_trainable"] == sum(p.numel() for p in d2.first.parameters())
    assert arms["df"]["params_excluded"] == 2 * 2048 * 256 and arms["toy-eagle3"]["params_excluded"] == 2048 * 256
