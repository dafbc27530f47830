"""The target model: a Hugging Face causal LM (Llama/Qwen families) seen as logits plus aux states.

EAGLE-3 drafters consume a few intermediate hidden states of the target. Layer ids
follow vLLM's convention: id `i` is the residual stream after `i` decoder layers,
i.e. the stream *entering* layer `i` (`hidden_states[i]` in Hugging Face terms for
`i < num_layers`). They are captured with forward hooks, so id `num_layers` is
the pre-norm output of the last layer, as vLLM sees it, not HF's post-norm one.

Every forward takes an explicit boolean 4-D attention mask and explicit position
ids, so the speculative engine can keep several rows of a batch at different
lengths in one key/value cache (slots of rejected drafts are simply masked out).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high layers (vLLM's (2, n//2, n-3)), made distinct for shallow targets."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and all(0 < i < num_layers for i in ids):
        return ids
    if num_layers < 4:
        raise ValueError(f"a target with {num_layers} layers is too shallow for three aux layers")
    return [1, num_layers // 2, num_layers - 1]


@dataclass
class TargetOutput:
    """Logits [B, T, V] and the concatenated aux states [B, T, n_aux * H] of one forward."""

    logits: torch.Tensor
    aux_hidden: torch.Tensor | None


class TargetModel:
    """A frozen causal LM with aux-state capture. Plain class; no devices touched until `load`."""

    def __init__(self, model, aux_layer_ids: list[int] | None = None):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        cfg = model.config
        self.num_layers: int = cfg.num_hidden_layers
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(self.num_layers)
        for i in self.aux_layer_ids:
            if not 0 <= i <= self.num_layers:
                raise ValueError(f"aux layer id {i} outside 0..{self.num_layers}")
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = self._install_hooks()
        # transformers renamed `past_key_values` to `cache` in 5.20; vLLM 0.32 pins < 5.20, so both are met
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def load(cls, path: str | Path, aux_layer_ids: list[int] | None = None, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
        return cls(model, aux_layer_ids)

    @property
    def rope_theta(self) -> float:
        """RoPE base (transformers 5 keeps it in `rope_parameters`)."""
        c = self.model.config
        params = getattr(c, "rope_parameters", None) or {}
        return float(params.get("rope_theta") or getattr(c, "rope_theta", None) or 10000.0)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    def final_norm(self) -> torch.nn.Module:
        return self.model.model.norm

    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def _install_hooks(self):
        layers = self.model.model.layers
        hooks = []
        for i in sorted(set(self.aux_layer_ids)):
            if i == 0:
                module, grab = self.embed_tokens(), (lambda out: out)
            else:
                module = layers[i - 1]
                grab = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731

            def hook(_mod, _inp, out, i=i, grab=grab):
                self._captured[i] = grab(out)

            hooks.append(module.register_forward_hook(hook))
        return hooks

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        want_aux: bool = True,
    ) -> TargetOutput:
        """One pass. `attention_mask` is boolean [B, 1, T, S_past + T] (True = may attend) or None (causal)."""
        self._captured.clear()
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=cache is not None,
            **{self._cache_kwarg: cache},
        )
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1) if want_aux else None
        self._captured.clear()
        return TargetOutput(logits=out.logits, aux_hidden=aux)

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)
