"""The shipped toy target is a real language model, and the engine is exact on it."""

import json

import pytest
import torch

from draftopd.data.prompts import encode_chats, toy_prompts
from draftopd.drafters import load_drafter
from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
from draftopd.loading import ASSETS, eos_ids, load_target, load_tokenizer


@pytest.fixture(scope="module")
def toy():
    tok = load_tokenizer("toy")
    return tok, load_target("toy", [1, 2, 3]), eos_ids(tok, "toy")


def test_loads_with_auto_classes_and_learned_far_below_uniform():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ASSETS / "toy-target"
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama" and len(tok) == model.config.vocab_size == 2048
    report = json.loads((path / "toy_target_report.json").read_text())
    assert report["held_out_loss_nats_per_token"] < 0.2 * report["uniform_loss_nats_per_token"]
    # Measure it again here on a few held-out chats instead of trusting the report.
    chats = toy_prompts("held_out", 16)
    text = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    ids = tok(text, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids.input_ids[:, 1:], reduction="none")
    mask = ids.attention_mask[:, 1:].bool()
    assert nll[mask].mean() < 0.5 * report["uniform_loss_nats_per_token"]


def test_greedy_answers_are_not_degenerate(toy):
    tok, target, eos = toy
    chats = [
        [{"role": "user", "content": "What is 47 + 385?"}],
        [
            {
                "role": "user",
                "content": "Write the Python function `clear` from the `collections` module:\n"
                "```python\ndef clear(self):\n```",
            }
        ],
    ]
    trajs = SpeculativeEngine(target, None, eos).generate(encode_chats(tok, chats), SamplingConfig(100))
    arith, code = (tok.decode(t.output_ids) for t in trajs)
    assert arith.startswith("<think>\n") and "</think>" in arith and "47 + 385" in arith
    assert "```python\ndef " in code
    for t in trajs:
        assert len(set(t.output_ids)) > 15  # not a loop on a few tokens
    assert trajs[0].finish_reason == "stop"  # the worked answer ends by itself


def test_greedy_exact_on_toy_target_with_trained_drafter():
    tok = load_tokenizer("toy")
    target = load_target("toy", [1, 2, 3], dtype="float64")
    drafter = load_drafter(str(ASSETS / "toy-eagle3"), target)
    eos = eos_ids(tok, "toy")
    prompts = encode_chats(tok, toy_prompts("held_out", 12))
    cfg = SamplingConfig(max_new_tokens=64)
    alone = SpeculativeEngine(target, None, eos).generate(prompts, cfg)
    accepted = 0
    for k, bs in [(4, 1), (7, 4), (3, 12)]:
        out = []
        for i in range(0, len(prompts), bs):
            out += SpeculativeEngine(target, drafter, eos).generate(prompts[i : i + bs], SamplingConfig(64, 0.0, k))
        for a, b in zip(alone, out):
            assert a.output_ids == b.output_ids
        accepted += sum(s.num_accepted for t in out for s in t.steps)
    assert accepted > 200
