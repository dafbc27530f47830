"""What `draftopd plan` knows about hardware and models: a GPU table, and shapes of targets and drafters.

The planner (plan.py) works from shapes alone, so it runs before any weight is read: a target's shape comes
from its config.json (`target.path`, the toy target's in draftopd/assets), or, where that path is not on this
machine, from the small table of the targets the shipped recipes name. Parameter counts are exact for the
dense and MoE Llama/Qwen3/gpt-oss layouts (biases and per-head norms left out: well under 0.1%).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

GiB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """Capacity as the driver reports it (nvidia-smi's total), dense bf16 peak and HBM bandwidth."""

    name: str
    memory_gib: float
    peak_flops: float
    """Dense bf16 FLOP/s (tensor cores, no sparsity); for CPU a rough fp32 figure."""
    bandwidth: float
    """Memory bandwidth, bytes/s."""


GPUS = {
    "H100-80GB": GpuSpec("H100-80GB", 79.6, 989e12, 3.35e12),  # SXM
    "H200": GpuSpec("H200", 140.4, 989e12, 4.8e12),
    "A100-80GB": GpuSpec("A100-80GB", 80.0, 312e12, 2.04e12),
    "A100-40GB": GpuSpec("A100-40GB", 40.0, 312e12, 1.56e12),
    "L40S": GpuSpec("L40S", 45.0, 362e12, 0.864e12),
}
ALIASES = {"H200-141GB": "H200", "H100": "H100-80GB", "A100": "A100-80GB"}


def cpu_spec() -> GpuSpec:
    """The host as a 'device': its physical memory, and ~30 GFLOP/s of fp32 per core (a rough figure)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return GpuSpec("CPU", round(memory, 1), 3e10 * (os.cpu_count() or 1), 2e10)


def gpu_spec(name: str) -> GpuSpec | None:
    """The spec of `cluster.gpu` (None for an unknown name); empty or `CPU`: the host."""
    if not name or name.upper() == "CPU":
        return cpu_spec()
    return GPUS.get(ALIASES.get(name, name))


# The targets the shipped GPU recipes name (fields of their config.json that the planner reads), for planning on a
# machine without the weights. gpt-oss ships MXFP4 experts: vLLM serves them as is, transformers dequantizes them.
KNOWN_TARGETS = {
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "Llama-3.1-8B-Instruct": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  tie_word_embeddings=False),
    "Qwen3-30B-A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "gpt-oss-20b": dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        vocab_size=201088, tie_word_embeddings=False,
                        quantization_config={"quant_method": "mxfp4"}),
}  # fmt: skip


class PlanError(ValueError):
    """A recipe the planner cannot size (its target's shape is unknown here)."""


@dataclass(frozen=True)
class TargetShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0
    experts_active: int = 0
    expert_intermediate: int = 0
    mxfp4_experts: bool = False

    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (2 * h * q + 2 * h * kv + 2 * h)  # q, o, k, v, two norms

    @property
    def expert_params(self) -> int:
        """All routed experts' weights (0 for a dense target)."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def dense_mlp_params(self) -> int:
        return 0 if self.experts else self.layers * 3 * self.hidden * self.intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        router = self.layers * self.hidden * self.experts
        return self.attention_params + self.expert_params + self.dense_mlp_params + self.embedding_params + router

    @property
    def active_params(self) -> int:
        """Weights one token's forward multiplies (routed experts: the active ones), lm_head included."""
        active = self.layers * self.experts_active * 3 * self.hidden * self.expert_intermediate
        return self.attention_params + active + self.dense_mlp_params + self.vocab * self.hidden

    def weight_bytes(self, dtype_bytes: int, serving: bool = False) -> float:
        """Bytes of the weights; `serving`: as vLLM holds them (MXFP4 experts at 4.25 bits per weight)."""
        if serving and self.mxfp4_experts:
            return (self.params - self.expert_params) * dtype_bytes + self.expert_params * 4.25 / 8
        return self.params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def shape_from_config(c: dict) -> TargetShape:
    """A target's shape from its (Hugging Face) config.json."""
    heads = c["num_attention_heads"]
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    return TargetShape(
        layers=c["num_hidden_layers"],
        hidden=c["hidden_size"],
        intermediate=c["intermediate_size"],
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        vocab=c["vocab_size"],
        tied=bool(c.get("tie_word_embeddings", False)),
        experts=experts,
        experts_active=(c.get("num_experts_per_tok") or c.get("experts_per_token") or 0) if experts else 0,
        expert_intermediate=(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else 0,
        mxfp4_experts=(c.get("quantization_config") or {}).get("quant_method") == "mxfp4",
    )


def target_config(path: str) -> dict:
    """config.json of the target at `path` (`toy`: the shipped one), else the known table by its last part."""
    from draftopd.schema import TOY_TARGET

    if path == TOY_TARGET:
        local = Path(__file__).parent / "assets" / "toy-target" / "config.json"
    else:
        local = Path(path) / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    name = Path(path).name
    if name in KNOWN_TARGETS:
        return dict(KNOWN_TARGETS[name])
    known = ", ".join(KNOWN_TARGETS)
    raise PlanError(f"target.path={path}: no config.json there, and not one of the targets known here ({known})")


@dataclass(frozen=True)
class DrafterShape:
    """An EAGLE-3 drafter: one decoder layer over the fused target states, a draft-vocabulary head."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_vocab: int
    target_hidden: int
    num_aux: int = 3

    @property
    def layer_params(self) -> int:
        """Weights one depth of the chain multiplies (fc excluded: it runs once)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = 2 * h * q + 2 * 2 * h * kv + q * h  # q, k, v read [embedding ; state] (2H); o
        return attn + 3 * h * self.intermediate + self.draft_vocab * h

    @property
    def trainable_params(self) -> int:
        fc = self.num_aux * self.target_hidden * self.hidden
        return fc + self.layer_params + 4 * self.hidden  # hidden_norm, input_layernorm, post-attention, final

    @property
    def frozen_params(self) -> int:
        return self.vocab * self.hidden  # the drafter's copy of the target's embedding

    @property
    def buffer_bytes(self) -> int:
        return 8 * self.draft_vocab + self.vocab + 4 * (self.head_dim // 2)  # d2t (long), t2d (bool), inv_freq


def drafter_shape(cfg, target: TargetShape) -> DrafterShape:
    """The drafter a run builds (`drafter.init`'s config.json when set, else the recipe's drafter section)."""
    d = cfg.drafter
    if d.init:
        from draftopd.drafters import family, read_raw
        from draftopd.loading import resolve_drafter_path

        kind, raw = read_raw(resolve_drafter_path(d.init), "eagle3")
        e = family(kind).read_config(raw)  # this project's layout, whatever the checkpoint's
        hidden, heads = e["hidden_size"], e["num_attention_heads"]
        return DrafterShape(
            hidden=hidden,
            intermediate=e["intermediate_size"],
            heads=heads,
            kv_heads=e.get("num_key_value_heads") or heads,
            head_dim=e.get("head_dim") or hidden // heads,
            vocab=e["vocab_size"],
            draft_vocab=e.get("draft_vocab_size") or e["vocab_size"],
            target_hidden=e.get("target_hidden_size") or hidden,
            num_aux=len(e.get("eagle_aux_hidden_state_layer_ids") or []) or 3,
        )
    hidden = d.hidden_size or target.hidden
    return DrafterShape(
        hidden=hidden,
        intermediate=d.intermediate_size or 3 * hidden,
        heads=d.num_attention_heads,
        kv_heads=d.num_key_value_heads,
        head_dim=d.head_dim or hidden // d.num_attention_heads,
        vocab=target.vocab,
        draft_vocab=min(d.draft_vocab_size, target.vocab),
        target_hidden=target.hidden,
        num_aux=len(cfg.target.aux_layer_ids) or 3,
    )
