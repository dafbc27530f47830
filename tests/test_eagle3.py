"""EAGLE-3 drafter: checkpoint layout and round trip, and training-time test matching inference."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftopd.engine.speculative import _attend_mask
from draftopd.models.eagle3 import Eagle3Drafter
from draftopd.testing import tiny_drafter, tiny_target


@pytest.mark.parametrize("opts", [{}, {"norm_output": True, "fc_norm": True}, {"head_dim": 16}])
def test_checkpoint_round_trip_is_exact(tmp_path, opts):
    target = tiny_target()
    drafter = tiny_drafter(target, draft_vocab=12, **opts)
    drafter.save(tmp_path)
    loaded = Eagle3Drafter.load(tmp_path, target.embed_tokens().weight)
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids = torch.randint(0, 16, (2, 5))
    state = torch.randn(2, 5, target.hidden_size, dtype=target.dtype)
    pos = torch.arange(5).expand(2, 5)
    mask = _attend_mask(torch.zeros(2, 0, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool))
    assert torch.equal(
        drafter.step(ids, state, pos, None, None, mask).logits, loaded.step(ids, state, pos, None, None, mask).logits
    )


def test_checkpoint_layout_is_what_vllm_reads(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, draft_vocab=12, fc_norm=True, norm_output=True)
    drafter.save(tmp_path)
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
        mask = _attend_mask(torch.zeros(1, 0, dtype=torch.bool), torch.ones(1, n, dtype=torch.bool))
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
