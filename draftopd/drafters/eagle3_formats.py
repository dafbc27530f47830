"""EAGLE-3 checkpoint layouts that serving engines read, for export and import.

Both layouts hold the same `model.safetensors` under the names vLLM's EAGLE-3
loader expects (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`); only
`config.json` differs:

* `vllm` (also read by SGLang): a Llama config with `architectures:
  ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids` (vLLM's convention: the residual stream
  entering those layers, which is what this project captures), `norm_output`
  and `fc_norm`;
* `speculators`: `speculators_model_type: eagle3` with the Llama layer under
  `transformer_layer_config`, the EAGLE-3 fields beside it, and a
  `speculators_config` naming the verifier and the number of draft tokens.
  vLLM reads a missing `norm_before_residual` as true there; this project's
  drafter normalises after taking the residual, so export writes false and
  import refuses true.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

EAGLE3_FIELDS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_output", "fc_norm")
FORMATS = ("vllm", "speculators")


class FormatError(ValueError):
    """A checkpoint layout this project cannot read or write, with the reason."""


def read_config(raw: dict) -> dict:
    """A drafter's config.json (either layout) in the `vllm` layout."""
    kind = raw.get("speculators_model_type")
    if kind is None:
        return raw
    if kind != "eagle3":
        raise FormatError(f"a speculators '{kind}' checkpoint, not eagle3")
    if raw.get("norm_before_residual", True):
        raise FormatError("norm_before_residual=true drafters are not supported (norm after the residual only)")
    cfg = dict(raw.get("transformer_layer_config") or {})
    if not cfg:
        raise FormatError("speculators config without transformer_layer_config")
    cfg.update({k: raw[k] for k in EAGLE3_FIELDS if k in raw})
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1)
    return cfg


def speculators_config(cfg: dict, verifier: str, num_draft_tokens: int) -> dict:
    layer = {k: v for k, v in cfg.items() if k not in EAGLE3_FIELDS and k != "architectures"}
    layer.update(architectures=["LlamaForCausalLM"], model_type="llama")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        **{k: cfg[k] for k in EAGLE3_FIELDS if k in cfg},
        "norm_before_residual": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_draft_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
    }


def export_drafter(src: str | Path, fmt: str, out: str | Path, verifier: str = "", num_draft_tokens: int = 4) -> Path:
    """Write `src` (either layout) to `out` in layout `fmt`; the weights are copied byte for byte."""
    if fmt not in FORMATS:
        raise FormatError(f"unknown format {fmt!r}: {', '.join(FORMATS)}")
    src, out = Path(src), Path(out)
    cfg = read_config(json.loads((src / "config.json").read_text()))
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "model.safetensors", out / "model.safetensors")
    if fmt == "speculators":
        cfg = speculators_config(cfg, verifier, num_draft_tokens)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
