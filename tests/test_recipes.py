"""Every recipe loads through the schema; the real-target recipes fit their target and their GPU layout.

No weights and no Ray: each real target is represented by its config.json (tests/fixtures/targets/<name>, only
the fields needed), and the drafter is built on the meta device by the same function a run uses.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftopd.config import TOY_TARGET, load_config

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
FIXTURES = ROOT / "tests" / "fixtures" / "targets"
REAL = [p for p in RECIPES if load_config(p).target.path != TOY_TARGET]


def _fixture(cfg) -> dict:
    """The target's config.json, found by the last part of target.path (`Qwen/Qwen3-8B` -> Qwen3-8B)."""
    path = FIXTURES / Path(cfg.target.path).name / "config.json"
    assert path.is_file(), f"no fixture config for target {cfg.target.path} at {path}"
    return json.loads(path.read_text())


def test_real_target_recipes_exist():
    names = {p.stem for p in REAL}
    assert {"qwen3-4b", "qwen3-8b", "llama-3.1-8b-instruct", "qwen3-30b-a3b", "gpt-oss-20b"} <= names
    assert any(load_config(p).cluster.nodes > 1 for p in REAL), "no multi-node recipe"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_resolves_through_the_schema(recipe):
    cfg = load_config(recipe)
    assert cfg.run.name == recipe.stem  # run directories do not collide between recipes


@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_drafter_shape_fits_the_target(recipe):
    cfg, hf = load_config(recipe), _fixture(load_config(recipe))
    d, n, hidden = cfg.drafter, hf["num_hidden_layers"], hf["hidden_size"]
    assert d.hidden_size in (0, hidden), "the drafter shares the target's embedding: same width"
    width = d.hidden_size or hidden
    ids = cfg.target.aux_layer_ids
    assert len(set(ids)) == 3 and all(1 <= i <= n - 1 for i in ids), ids
    assert ids == [2, n // 2, n - 3], "shipped recipes use vLLM's default capture layers"
    assert d.draft_vocab_size == 32000 <= hf["vocab_size"]
    assert d.num_attention_heads % d.num_key_value_heads == 0
    head_dim = d.head_dim or width // d.num_attention_heads
    assert d.head_dim or width % d.num_attention_heads == 0
    assert head_dim in (width // d.num_attention_heads, hf.get("head_dim")), "hidden/heads, or the target's width"
    assert head_dim % 8 == 0, "RoPE needs an even head_dim; attention kernels want a multiple of 8"
    assert d.intermediate_size > 0


def _meta_target(hf: dict, aux_layer_ids: list[int]):
    """What `drafters.new_drafter` reads from a target, with a meta-device embedding (no memory)."""
    embed = torch.empty(hf["vocab_size"], hf["hidden_size"], device="meta", dtype=torch.bfloat16)
    return SimpleNamespace(
        hidden_size=hf["hidden_size"],
        vocab_size=hf["vocab_size"],
        aux_layer_ids=aux_layer_ids,
        dtype=torch.bfloat16,
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        model=SimpleNamespace(config=SimpleNamespace(**hf)),
        embed_tokens=lambda: SimpleNamespace(weight=embed),
    )


@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_eagle3_weights_have_the_serving_shapes(recipe):
    """The drafter a run builds (on the meta device) has the tensor shapes vLLM's llama_eagle3 loads."""
    from draftopd.drafters import new_drafter

    cfg = load_config(recipe)
    hf, d = _fixture(cfg), cfg.drafter
    ht, vocab, vd = hf["hidden_size"], hf["vocab_size"], d.draft_vocab_size
    with torch.device("meta"):
        drafter = new_drafter(d, _meta_target(hf, cfg.target.aux_layer_ids), torch.arange(vd))
    h, inter, nh, nkv = drafter.cfg.hidden_size, d.intermediate_size, d.num_attention_heads, d.num_key_value_heads
    hd = d.head_dim or h // nh
    want = {
        "fc.weight": (h, 3 * ht),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, nh * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "lm_head.weight": (vd, h),
        "d2t": (vd,),
        "t2d": (vocab,),
    }
    shapes = {k: tuple(v.shape) for k, v in drafter.state().items()}
    assert {k: shapes.get(k) for k in want} == want
    assert drafter.embed.weight.shape == (vocab, ht) and drafter.fc.weight.dtype == torch.bfloat16
    served = drafter.config()
    assert served["target_hidden_size"] == ht and served["eagle_aux_hidden_state_layer_ids"] == cfg.target.aux_layer_ids
    assert served["head_dim"] == hd and served["draft_vocab_size"] == vd and served["vocab_size"] == vocab
    assert type(drafter.cfg).from_hf(served) == drafter.cfg and served["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_gpu_layout_matches_the_cluster_section(recipe):
    cfg = load_config(recipe)
    r, lr, layout = cfg.rollout, cfg.learner, cfg.cluster
    rollout_gpus = r.num_workers * r.num_gpus_per_worker
    learner_gpus = lr.num_learners * lr.num_gpus_per_learner
    assert rollout_gpus + learner_gpus == layout.nodes * layout.gpus_per_node and layout.gpu, layout
    assert r.num_gpus_per_worker >= 1 and lr.num_gpus_per_learner == 1  # a vLLM engine per GPU; NCCL ranks
    assert cfg.sft.batch_size % lr.num_learners == 0  # every rank gets the same number of sequences
    assert r.prompts_per_round % (r.num_workers * r.batch_size) == 0
    assert r.vllm_max_model_len >= max(r.max_new_tokens, cfg.learner.max_seq_len, cfg.sft.max_seq_len)


@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_published_hyperparameters(recipe):
    """SFT (EAGLE-3 TTT) then Draft-OPD, with the settings of the papers and the serving stack."""
    cfg = load_config(recipe)
    assert cfg.target.dtype == "bfloat16" and cfg.opd.enabled and cfg.sft.epochs > 0
    assert cfg.sft.ttt_depth == 7 and cfg.sft.depth_decay == 0.8 and cfg.learner.decay == 0.8
    assert 5e-5 <= cfg.sft.lr <= 2e-4 and 1e-5 <= cfg.learner.lr <= 5e-5
    assert cfg.rollout.backend == "vllm" and cfg.rollout.temperature == 0.0 and cfg.sync.backend == "nccl"
