"""Device check, section 3: the memory of one EAGLE-3 TTT step at the qwen3-8b drafter's shape.

One SFT (TTT) forward and backward through `sft/trainer.py::ttt_loss`, as a learner rank runs it, at
the shape of recipes/qwen3-8b.yaml's drafter (hidden 4096, MLP 12288, 32 heads, 8 key/value heads,
draft vocabulary 32,000 over Qwen3's 151,936 tokens, three aux layers, depth 7) on one sequence of
4,608 tokens, random weights, bfloat16. The target is a random 4-layer Llama of Qwen3-8B's width and
vocabulary: the drafter reads only its three aux states and its logits, whose sizes depend on width,
vocabulary and length alone (its other 32 layers would add resident weights, not step memory).

Reported: the peak CUDA memory of the step (torch.cuda.max_memory_allocated) and what was resident
before it (weights), their difference, the bytes autograd saved for backward (unique storages, no
parameters; the measure the issue and the planner's CPU validation use), and the planner's figure.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from draftopd.config import DrafterConfig
from draftopd.drafters import new_drafter
from draftopd.models.target import TargetModel
from draftopd.sft.trainer import SFTExample, collate, ttt_loss

GIB = 2**30


@dataclass
class Shape:
    """A drafter and target shape for one TTT step."""

    hidden: int = 4096
    intermediate: int = 12288
    heads: int = 32
    kv_heads: int = 8
    draft_vocab: int = 32000
    vocab: int = 151936
    depth: int = 7
    seq_len: int = 4608
    batch: int = 1
    prompt_len: int = 512  # loss on the response rows, as in SFT


QWEN3_8B = Shape()
QUICK = Shape(
    hidden=128, intermediate=384, heads=4, kv_heads=2, draft_vocab=256, vocab=1024, depth=3, seq_len=256, prompt_len=32
)


def random_target(shape: Shape, device, dtype) -> TargetModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=4,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=shape.seq_len + 64,
        tie_word_embeddings=False,
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in place at its dtype: no float32 copy of 2e9 weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.config._attn_implementation = "sdpa"
    return TargetModel(model, [1, 2, 3])


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward, parameters and buffers excluded."""

    def __init__(self, *modules: torch.nn.Module):
        self.skip = {t.untyped_storage().data_ptr() for m in modules for t in [*m.parameters(), *m.buffers()]}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage: counted by its size
            self.seen[id(t)] = t.numel() * t.element_size()
            return t
        if s.data_ptr() not in self.skip:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def plan_figure(shape: Shape, measured_bytes: int) -> dict:
    """The planner's saved-activation figure at this shape (`draftopd.plan.ttt_activation_bytes`), and the
    measurement over it; a tree without the planner says so instead of failing the section."""
    try:
        from draftopd.plan import ttt_activation_bytes
    except ImportError as exc:
        return {"available": False, "note": f"no draftopd.plan.ttt_activation_bytes ({exc})"}
    n = ttt_activation_bytes(
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        draft_vocab=shape.draft_vocab,
        vocab=shape.vocab,
        depth=shape.depth,
        seq_len=shape.seq_len,
        batch=shape.batch,
        dtype_bytes=2,
    )
    return {"available": True, "activation_gib": n / GIB, "measured_over_plan": measured_bytes / n}


def run(device: str, shape: Shape, dtype=torch.bfloat16) -> dict:
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    target = random_target(shape, dev, dtype)
    d2t = torch.randperm(shape.vocab, device=dev)[: shape.draft_vocab].sort().values
    cfg = DrafterConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        draft_vocab_size=shape.draft_vocab,
    )
    with torch.device(dev):
        drafter = new_drafter(cfg, target, d2t).to(dev).train()
    ids = torch.randint(0, shape.vocab, (shape.seq_len,)).tolist()
    batch = collate([SFTExample(ids, shape.prompt_len)] * shape.batch, shape.seq_len)
    batch = type(batch)(*(t.to(dev) for t in (batch.input_ids, batch.valid, batch.loss_pos)))
    build_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if cuda else 0
    saved = SavedBytes(drafter, target.model)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss, _ = ttt_loss(drafter, target, batch, shape.depth, 0.8)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    out = {
        "shape": asdict(shape),
        "loss": loss.item(),
        "build_seconds": build_s,
        "step_seconds": time.perf_counter() - t0,
        "saved_activation_gib": saved.total / GIB,
        "plan": plan_figure(shape, saved.total),
    }
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        out.update(peak_gib=peak / GIB, resident_gib=resident / GIB, step_gib=(peak - resident) / GIB)
    out["ok"] = bool(torch.isfinite(loss.detach()))
    return out
