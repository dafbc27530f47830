"""Drafter families: checkpoint round trips and refusals for every family; EAGLE-3's layout and TTT."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftopd.drafters import FAMILIES, LoadError, load_drafter, read_checkpoint, save_drafter
from draftopd.models.layers import attend_mask
from draftopd.testing import tiny_drafter, tiny_target

FAMILY_OPTS = {
    "eagle3": [{}, {"norm_output": True, "fc_norm": True}, {"head_dim": 16}],
    "dflash": [{}, {"num_hidden_layers": 2, "head_dim": 16, "block_size": 4}],
}
CASES = [(kind, opts) for kind in FAMILIES for opts in FAMILY_OPTS.get(kind, [{}])]


@pytest.mark.parametrize("kind,opts", CASES)
def test_checkpoint_round_trip_is_exact(tmp_path, kind, opts):
    target = tiny_target()
    drafter = tiny_drafter(target, draft_vocab=12, kind=kind, **opts)
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, target, kind)
    assert type(loaded) is type(drafter) and loaded.kind == kind
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids = torch.randint(0, 16, (2, 9))
    out = target.forward(ids, torch.arange(9).expand(2, 9))
    valid = torch.ones(2, 9, dtype=torch.bool)
    assert torch.equal(
        drafter.score(ids, drafter.features(out), valid, 3), loaded.score(ids, loaded.features(out), valid, 3)
    )


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_checkpoint_of_another_family_is_refused_in_one_line(tmp_path, kind):
    target = tiny_target()
    save_drafter(tiny_drafter(target, kind=kind), tmp_path)
    other = "dflash" if kind != "dflash" else "eagle3"
    with pytest.raises(LoadError) as err:
        load_drafter(tmp_path, target, other)
    assert "\n" not in str(err.value) and f"'{kind}'" in str(err.value) and f"'{other}'" in str(err.value)
    # a published layout of a family draftopd does not implement is named, not loaded as something else
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "block_size": 8}))
    with pytest.raises(LoadError, match="'dflash'"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_rollout_workers_next_load_replaces_every_tensor_in_place(tmp_path, kind):
    """After its first drafter, a rollout worker loads pushed weights into the same modules, whatever the family's
    checkpoint names; every tensor of the push arrives (the weight syncs end in this load)."""
    from draftopd.opd.rollout import RolloutWorker

    target = tiny_target()
    target.model.save_pretrained(tmp_path)
    drafter = tiny_drafter(target, kind=kind)
    worker = RolloutWorker(str(tmp_path), target.aux_layer_ids, "float64", [1])
    config, first = drafter.config(), drafter.state()
    assert worker.load_weights(config, first, 0) == 0
    held = worker.engine.drafter
    g = torch.Generator().manual_seed(0)
    pushed = {
        k: v + torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
        for k, v in first.items()
    }
    assert worker.load_weights(config, pushed, 1) == 1 and worker.engine.drafter is held
    got = worker.weights()
    assert got.keys() == pushed.keys()
    assert all(torch.equal(got[k], pushed[k]) for k in pushed), [
        k for k in pushed if not torch.equal(got[k], pushed[k])
    ]
    with pytest.raises(ValueError, match="unexpected tensors"):
        worker.load_weights(config, {**pushed, "stray.weight": torch.zeros(2)}, 2)


def test_no_module_outside_drafters_imports_a_familys_internals():
    """Families plug in through draftopd.drafters (FAMILIES, the protocol, the reader and writer) only."""
    root = Path(__file__).resolve().parents[1] / "draftopd"
    pattern = re.compile(r"^\s*(from|import)\s+draftopd\.drafters\.(?!base\b)\w+", re.M)
    offenders = [
        str(f.relative_to(root))
        for f in root.rglob("*.py")
        if "drafters" not in f.relative_to(root).parts and pattern.search(f.read_text())
    ]
    assert offenders == []
    assert pattern.search("from draftopd.drafters.eagle3 import Eagle3Config")  # the check can fail


def test_checkpoint_layout_is_what_vllm_reads(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, draft_vocab=12, fc_norm=True, norm_output=True)
    save_drafter(drafter, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 12 and cfg["vocab_size"] == 16
    assert cfg["eagle_aux_hidden_state_layer_ids"] == target.aux_layer_ids
    assert cfg["norm_output"] is True and cfg["fc_norm"] is True
    tensors = load_file(str(tmp_path / "model.safetensors"))
    h, th = target.hidden_size, target.hidden_size
    assert tensors["fc.weight"].shape == (h, 3 * th)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert tensors["lm_head.weight"].shape == (12, h)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert int(tensors["t2d"].sum()) == 12
    for name in [
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.post_attention_layernorm.weight",
        "norm.weight",
        "fc_norm.0.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight",
    ]:
        assert name in tensors, name
    assert not any(k.startswith("embed") for k in tensors)  # the target's embedding is shared, not saved


@pytest.mark.parametrize("opts", [{}, {"norm_output": True, "fc_norm": True}, {"head_dim": 16}])
def test_ttt_matches_chained_inference(opts):
    """Depth d of training-time test equals chain step d+1 of cached inference, row by row."""
    target = tiny_target()
    drafter = tiny_drafter(target, **opts)
    torch.manual_seed(3)
    ids = torch.randint(2, 16, (1, 12))
    out = target.forward(ids, torch.arange(12)[None])
    depth = 4
    ttt = drafter.ttt_forward(ids, out.aux_hidden, torch.ones(1, 12, dtype=torch.bool), depth)
    fused = drafter.fuse(out.aux_hidden)
    for t in [0, 3, 6]:
        # Context rows 0..t: (state_j, token_{j+1}) at position j.
        n = t + 1
        mask = attend_mask(torch.zeros(1, 0, dtype=torch.bool), torch.ones(1, n, dtype=torch.bool))
        step = drafter.step(ids[:, 1 : n + 1], fused[:, :n], torch.arange(n)[None], None, None, mask)
        keys, vals, state = step.keys, step.values, step.state[:, -1:]
        torch.testing.assert_close(step.logits[0, -1], ttt[0][0, t])
        for d in range(1, depth):
            if t + 1 + d >= 12:
                break
            tok = ids[:, t + 1 + d : t + 2 + d]  # teacher-forced token, as in TTT
            m = torch.ones(1, 1, keys.shape[2] + 1, dtype=torch.bool)
            step = drafter.step(tok, state, torch.tensor([[t + d]]), keys, vals, m)
            keys, vals = torch.cat([keys, step.keys], 2), torch.cat([vals, step.values], 2)
            state = step.state
            torch.testing.assert_close(step.logits[0, -1], ttt[d][0, t])
