"""EAGLE-3 checkpoint layouts: every published one read, one written per serving engine or library.

Read (config.json -> this project's own layout, which is vLLM's):

* `eagle`: EAGLE's originals, an `LlamaForCausalLM` config with
  `draft_vocab_size` and no aux ids (the target's default layers apply);
* `vllm`: `LlamaForCausalLMEagle3` (or `Eagle3Qwen3ForCausalLM`) with ids at the
  top level in vLLM's convention: id i = the residual stream entering layer i,
  which is what this project captures;
* `specforge`: the same architecture with ids only under
  `eagle_config.eagle_aux_hidden_state_layer_ids`, in SGLang's convention
  (the output of layer i = vLLM's i + 1);
* `speculators`: `Eagle3Speculator`, the layer under `transformer_layer_config`
  (llama or qwen3), weights named `layers.0.*` and an `embed_tokens.weight`;
  a missing `norm_before_residual` means true, as vLLM reads it.

Written (`FORMATS`): `vllm` (also read by SGLang: both id conventions, top level
and `eagle_config`), `sglang` (only what SGLang's `llama_eagle3.py` computes:
Llama layers, norm after the residual, no drift fixes, no biases) and
`speculators` (what the speculators library loads as its Eagle3 model: the
verifier named, its token embedding saved as `embed_tokens.weight` when the
verifier is a local directory, since the library does not fetch it then).
Weights keep their dtype; `torch_dtype` says which.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EAGLE3_FIELDS = (
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_output",
    "fc_norm",
    "norm_before_residual",
    "norm_before_fc",
)
FORMATS = ("vllm", "sglang", "speculators")
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias")
IDS = "eagle_aux_hidden_state_layer_ids"
VLLM_IDS = "vLLM's (id i = the stream entering layer i)"
SGLANG_IDS = "SGLang's (id i = the output of layer i), +1 on import"


class FormatError(ValueError):
    """A checkpoint layout this project cannot read or write, with the reason."""


def detect_layout(raw: dict) -> str:
    """Which published layout a config.json is in (module docstring)."""
    if raw.get("speculators_model_type"):
        return "speculators"
    archs = raw.get("architectures") or []
    if not any("Eagle3" in a for a in archs):
        return "eagle"
    if not raw.get(IDS) and (raw.get("eagle_config") or {}).get(IDS):
        return "specforge"
    return "vllm"


def id_convention(raw: dict) -> str:
    """Where a config's aux layer ids come from, and in which convention they are read."""
    layout = detect_layout(raw)
    if layout == "specforge":
        return f"eagle_config ids, {SGLANG_IDS}"
    if raw.get(IDS):
        return f"top-level ids, {VLLM_IDS}"
    return "no ids: the target's default layers"


def read_config(raw: dict) -> dict:
    """A drafter's config.json in any layout, as this project's own (vllm) layout."""
    layout = detect_layout(raw)
    if layout == "speculators":
        if raw["speculators_model_type"] != "eagle3":
            raise FormatError(f"a speculators '{raw['speculators_model_type']}' checkpoint, not eagle3")
        cfg = dict(raw.get("transformer_layer_config") or {})
        if not cfg:
            raise FormatError("speculators config without transformer_layer_config")
        cfg.update({k: raw[k] for k in EAGLE3_FIELDS if raw.get(k) is not None})
        cfg["norm_before_residual"] = raw.get("norm_before_residual", True)
        cfg["num_hidden_layers"] = cfg.get("num_hidden_layers", 1)
        return cfg
    cfg = dict(raw)
    eagle = raw.get("eagle_config") or {}
    if layout == "specforge":
        cfg[IDS] = [i + 1 for i in eagle[IDS]]
    if "norm_before_fc" in eagle:
        cfg["norm_before_fc"] = eagle["norm_before_fc"]
    return cfg


def import_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights under this project's names: `layers.0.` -> `midlayer.`; verifier copies dropped."""
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("verifier_"):
            continue  # the speculators library's frozen copies of the target's head and norm
        out[name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name] = t
    return out


def _sglang_refusals(cfg: dict) -> list[str]:
    bad = [k for k in FLAGS if cfg.get(k)]
    if cfg.get("model_type", "llama") != "llama":
        bad.append(f"model_type={cfg['model_type']}")
    if cfg.get("rope_scaling"):
        bad.append("rope_scaling")
    return bad


def _verifier(verifier: str) -> dict:
    """The speculators verifier block; a local target directory also gives its architectures."""
    archs = []
    if verifier and (Path(verifier) / "config.json").is_file():
        archs = json.loads((Path(verifier) / "config.json").read_text()).get("architectures") or []
    return {"name_or_path": verifier or None, "architectures": archs}


def verifier_embedding(verifier: str) -> torch.Tensor | None:
    """The token embedding of a local target directory (the speculators library expects it in the drafter's file)."""
    from safetensors import safe_open

    root = Path(verifier) if verifier else None
    if root is None or not root.is_dir():
        return None
    files = {"model.safetensors": None} if (root / "model.safetensors").is_file() else {}
    if (root / "model.safetensors.index.json").is_file():
        files = dict.fromkeys(json.loads((root / "model.safetensors.index.json").read_text())["weight_map"].values())
    for file in files:
        with safe_open(str(root / file), "pt") as f:
            for name in (
                "model.embed_tokens.weight",
                "embed_tokens.weight",
                "model.language_model.embed_tokens.weight",
            ):
                if name in f.keys():
                    return f.get_tensor(name)
    return None


def speculators_config(cfg: dict, verifier: str, num_draft_tokens: int) -> dict:
    layer = {k: v for k, v in cfg.items() if k not in EAGLE3_FIELDS and k not in ("architectures", "torch_dtype")}
    layer.pop("num_aux_hidden_states", None)
    arch = "LlamaForCausalLM" if cfg.get("model_type", "llama") == "llama" else "Qwen3ForCausalLM"
    layer.update(architectures=[arch], model_type=cfg.get("model_type", "llama"))
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        **{k: cfg[k] for k in EAGLE3_FIELDS if k in cfg},
        "torch_dtype": cfg.get("torch_dtype", "float32"),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_draft_tokens}],
            "default_proposal_method": "greedy",
            "verifier": _verifier(verifier),
        },
    }


def export_state(
    cfg: dict, tensors: dict[str, torch.Tensor], fmt: str, verifier: str = "", num_draft_tokens: int = 4
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) of a drafter in layout `fmt`; `cfg`/`tensors` are in this project's layout."""
    if fmt not in FORMATS:
        raise FormatError(f"unknown format {fmt!r}: {', '.join(FORMATS)}")
    cfg = {**{k: False for k in FLAGS}, **cfg}  # explicit: a missing norm_before_residual reads as true in speculators
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    cfg["torch_dtype"] = str(floats[0] if floats else torch.float32).removeprefix("torch.")
    ids = list(cfg.get(IDS) or [])
    cfg["num_aux_hidden_states"] = len(ids) or 3
    if fmt == "speculators":
        renamed = {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}
        embed = renamed.get("embed_tokens.weight")
        embed = verifier_embedding(verifier) if embed is None else embed
        if embed is not None:  # the library's model holds the embedding; vLLM drops it when equal to the target's
            renamed["embed_tokens.weight"] = embed.to(floats[0] if floats else torch.float32)
        return speculators_config(cfg, verifier, num_draft_tokens), renamed
    if ids and min(ids) < 1:
        raise FormatError(f"aux layer ids {ids} include the embedding (0), which SGLang cannot capture")
    cfg["eagle_config"] = {**(cfg.get("eagle_config") or {}), IDS: [i - 1 for i in ids]} if ids else {}
    if fmt == "sglang":
        bad = _sglang_refusals(cfg)
        if bad:
            raise FormatError(f"SGLang's EAGLE-3 model does not compute {', '.join(bad)}: export --format vllm")
        cfg.pop(IDS, None)
    return cfg, _without_identity_maps(cfg, dict(tensors), fmt)


def identity_maps(vocab_size: int | None, draft_vocab_size: int | None, d2t: torch.Tensor | None) -> bool:
    """Whether `d2t` (and its `t2d`) only restate the identity: the draft vocabulary is the target's whole one and
    every offset is 0. Such maps are left out of what is saved and exported (vLLM's model holds none then)."""
    if d2t is None or vocab_size is None or (draft_vocab_size or vocab_size) != vocab_size:
        return False
    return not d2t.any()


def _without_identity_maps(cfg: dict, tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """vLLM's EAGLE-3 model keeps no draft-to-target map when the draft vocabulary is the target's whole
    vocabulary and refuses one it has no parameter for (`draft_id_to_target_id`), so an identity `d2t` (all
    offsets 0) and its `t2d` are left out of both layouts (SGLang reads a missing map as the identity too). A
    whole-vocabulary map that permutes ids is kept for SGLang, which reads any map as its hot-token ids, and
    refused for vLLM, which cannot serve it."""
    vocab = cfg.get("vocab_size")
    if "d2t" not in tensors or vocab is None or cfg.get("draft_vocab_size", vocab) != vocab:
        return tensors
    if not identity_maps(vocab, cfg.get("draft_vocab_size"), tensors["d2t"]):
        if fmt == "sglang":
            return tensors
        raise FormatError(
            "the draft vocabulary is the whole target vocabulary but its d2t map is not the identity: vLLM's "
            "EAGLE-3 model keeps no map then and cannot serve it (export --format sglang)"
        )
    return {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
