"""The typed configuration schema and the recipe loader.

Defaults live here, one docstring line each; a recipe YAML holds only what differs
for its target, and `section.field=value` overrides on the command line come last.
Loading is OmegaConf's structured merge (schema -> recipe -> overrides -> objects);
an unknown key or a value of the wrong type is a `ConfigError` that names the key
and the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOY_TARGET = "toy"  # the toy target shipped in draftopd/assets


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema."""


@dataclass
class RunConfig:
    out_dir: str = "runs"
    """Folder under which each run gets its own directory."""
    name: str = "run"
    """Run name; the run directory is `out_dir/name`."""
    seed: int = 0
    """Seed for data order, initialisation and sampling."""
    num_threads: int = 0
    """torch intra-op threads per process (0: torch's default)."""


@dataclass
class TargetConfig:
    path: str = TOY_TARGET
    """Hugging Face model directory of the target, or `toy` for the shipped toy target."""
    aux_layer_ids: list[int] = field(default_factory=list)
    """Layers whose states the EAGLE-3 drafter reads, in vLLM's convention: id i is the residual
    stream after i decoder layers (HF `hidden_states[i]`). Empty: (2, n//2, n-3), made distinct for shallow targets."""
    dtype: str = "float32"
    """Weights and compute dtype of the target (float32, bfloat16, float64)."""


@dataclass
class DrafterConfig:
    init: str = ""
    """Start from this EAGLE-3 checkpoint directory instead of a fresh drafter."""
    hidden_size: int = 0
    """Drafter width; 0 means the target's hidden size (the embedding is shared)."""
    intermediate_size: int = 0
    """MLP width; 0 means 3x the hidden size."""
    num_attention_heads: int = 8
    """Attention heads of the single decoder layer."""
    num_key_value_heads: int = 4
    """Key/value heads (grouped-query attention)."""
    draft_vocab_size: int = 1024
    """Size of the drafter's output vocabulary, the most frequent target tokens of the training responses."""
    norm_output: bool = False
    """Attention-drift fix: the state fed to the next chain step is taken after the final norm."""
    fc_norm: bool = False
    """Attention-drift fix: an RMSNorm on each captured target state before the fusion layer."""


@dataclass
class DataConfig:
    prompts: str = TOY_TARGET
    """JSONL file of prompts ({"prompt": ...} or {"messages": [...]} per line), or `toy` for the toy corpus."""
    eval_prompts: str = TOY_TARGET
    """JSONL of held-out prompts, or `toy` for the toy corpus's held-out split."""
    num_train_prompts: int = 800
    """How many prompts to answer with the target for training."""
    num_eval_prompts: int = 48
    """How many held-out prompts to evaluate on."""
    enable_thinking: bool = True
    """Chat template flag for thinking models (the toy target is one)."""
    response_temperature: float = 0.5
    """Sampling temperature of the target when it writes the training responses."""
    max_new_tokens: int = 160
    """Length cap of each generated training response."""
    generate_batch_size: int = 32
    """Prompts decoded together when making responses."""


@dataclass
class SFTConfig:
    epochs: int = 3
    """Passes over the target-written responses."""
    batch_size: int = 16
    """Sequences per optimizer step."""
    lr: float = 2e-3
    """Peak AdamW learning rate (cosine decay after warm-up)."""
    warmup_ratio: float = 0.05
    """Fraction of steps spent warming up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    ttt_depth: int = 7
    """Training-time-test depth: chain steps unrolled on the drafter's own states."""
    depth_decay: float = 0.8
    """Loss weight of depth d is depth_decay**d."""
    max_seq_len: int = 384
    """Prompt + response tokens kept per training sequence."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""


@dataclass
class EvalConfig:
    num_draft_tokens: list[int] = field(default_factory=lambda: [4, 7])
    """Chain lengths K to evaluate at."""
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    """Sampling temperatures to evaluate at."""
    max_new_tokens: int = 128
    """Tokens generated per held-out prompt."""
    batch_size: int = 1
    """Prompts decoded together (1 measures latency the way a chat user sees it)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def _check_keys(node: Any, schema: type, where: str = "") -> None:
    """Raise ConfigError on the first key that is not in the schema, suggesting the nearest one."""
    if not isinstance(node, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in node.items():
        path = f"{where}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.0)
            hint = f"; did you mean '{where}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{path}'{hint}")
        sub = fields[key].default_factory
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            _check_keys(value, sub, f"{path}.")


def _dotlist_to_dict(overrides: list[str]) -> dict:
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form section.field=value")
        key, value = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Schema defaults, then the recipe YAML, then `section.field=value` overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(Config)
    layers = []
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {path} not found")
        try:
            data = OmegaConf.to_container(OmegaConf.load(path))
        except Exception as exc:  # yaml errors carry line numbers
            raise ConfigError(f"recipe {path} is not valid YAML: {exc}") from None
        _check_keys(data or {}, Config)
        layers.append((str(path), OmegaConf.create(data or {})))
    if overrides:
        dotted = _dotlist_to_dict(overrides)
        _check_keys(dotted, Config)
        layers.append(("overrides", OmegaConf.from_dotlist(list(overrides))))
    merged = base
    for source, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or "?"
            msg = str(exc).splitlines()[0]
            raise ConfigError(f"{source}: bad value for '{key}': {msg}") from None
    return OmegaConf.to_object(merged)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
