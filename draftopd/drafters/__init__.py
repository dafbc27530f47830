"""Drafter families, chosen by `drafter.kind`, and the one reader and writer of a drafter directory.

A drafter directory is `config.json` + `model.safetensors`, in a layout the
family's serving engines read. `FAMILIES` is the literal list of families this
project implements; `detect_kind` also recognises the published layouts of
families it does not (yet), so that such a checkpoint is refused with one line
naming both kinds instead of loading as something else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftopd.drafters.d2sd import D2SDDrafter
from draftopd.drafters.dflash import DFlashDrafter
from draftopd.drafters.eagle3 import Eagle3Drafter
from draftopd.drafters.pard import PardDrafter
from draftopd.loading import LoadError

FAMILIES = {"eagle3": Eagle3Drafter, "dflash": DFlashDrafter, "d2sd": D2SDDrafter, "pard": PardDrafter}


def detect_kind(config: dict) -> str:
    """The drafter family of a config.json in any published layout ('' when it is none of them)."""
    archs = config.get("architectures") or []
    spec = config.get("speculators_model_type")
    if spec:
        return str(spec)
    if "LlamaForCausalLMEagle3" in archs or "Eagle3Speculator" in archs:
        return "eagle3"
    if "D2SDDraftModel" in archs:  # before DFlash: it holds two DFlash configs
        return "d2sd"
    if any("DFlash" in a for a in archs) or "dflash_config" in config:
        return "dflash"
    if "pard_token" in config:
        return "pard"
    if config.get("num_hidden_layers") == 1 and "draft_vocab_size" in config:
        return "eagle3"  # EAGLE's original layout: a one-layer Llama config with a draft vocabulary
    return ""


def family(kind: str):
    """The drafter class of `kind`; a one-line error naming the families there are otherwise."""
    if kind not in FAMILIES:
        raise LoadError(f"no drafter family '{kind}' (families: {', '.join(FAMILIES)})")
    return FAMILIES[kind]


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint directory: `model.safetensors`, sharded safetensors (by their index) or
    `pytorch_model.bin` (read as plain tensors only, never arbitrary pickled objects)."""
    from safetensors.torch import load_file

    p = Path(path)
    if (p / "model.safetensors").is_file():
        return load_file(str(p / "model.safetensors"))
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (p / index).is_file():
            shards = sorted(set(json.loads((p / index).read_text())["weight_map"].values()))
            return {k: v for s in shards for k, v in read_shard(p / s).items()}
    if (p / "pytorch_model.bin").is_file():
        return read_shard(p / "pytorch_model.bin")
    raise LoadError(f"drafter {path}: no model.safetensors, sharded safetensors or pytorch_model.bin")


def read_shard(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if file.suffix == ".safetensors":
        return load_file(str(file))
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses pickled objects other than tensors
        raise LoadError(f"drafter {file}: not a plain tensor file ({type(exc).__name__})") from None


def read_raw(path: str | Path, kind: str = "") -> tuple[str, dict]:
    """(kind, config.json as written) of a drafter directory; `kind` given: it must match."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise LoadError(f"drafter {path}: no config.json")
    raw = json.loads((p / "config.json").read_text())
    found = detect_kind(raw)
    if not found:
        raise LoadError(f"drafter {path}: config.json is no drafter layout draftopd knows")
    if kind and found != kind:
        raise LoadError(f"drafter {path} is a '{found}' checkpoint, not '{kind}' (drafter.kind)")
    family(found)
    return found, raw


def read_checkpoint(path: str | Path, kind: str = "") -> tuple[str, dict, dict[str, torch.Tensor]]:
    """(kind, config in the family's own layout, tensors) of a drafter directory; `kind` given: it must match."""
    found, raw = read_raw(path, kind)
    try:
        config = family(found).read_config(raw)
    except ValueError as exc:
        raise LoadError(f"drafter {path}: {exc}") from None
    return found, config, read_tensors(path)


def clone_drafter(drafter, target):
    """An independent copy of `drafter` (its own tensors), bound to `target` as a loaded one is."""
    fam = family(drafter.kind)
    state = {k: v.detach().clone() for k, v in drafter.state().items()}
    return fam.from_state(fam.read_config(drafter.config()), state, target)


def load_drafter(path: str | Path, target, kind: str = ""):
    """The drafter in `path`, bound to `target` (whose embedding it may share); checks that the two fit."""
    found, config, tensors = read_checkpoint(path, kind)
    try:
        return family(found).from_state(config, tensors, target)
    except ValueError as exc:
        raise LoadError(f"drafter {path}: {exc}") from None


def load_state(drafter, state: dict[str, torch.Tensor]) -> None:
    """`state()`'s tensors into a built drafter in place: the family's own `load_state` where its checkpoint
    names differ from its modules' (PARD), else the module's, refusing tensors it does not know."""
    own = getattr(drafter, "load_state", None)
    if own is not None:
        own(state)
        return
    _, unexpected = drafter.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"{drafter.kind} drafter: unexpected tensors {unexpected}")


def write_checkpoint(config: dict, state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """The one writer of a drafter directory: config.json and model.safetensors, tensors as they are."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def save_drafter(drafter, path: str | Path) -> Path:
    return write_checkpoint(drafter.config(), drafter.state(), path)


def new_drafter(cfg, target, draft_to_target: torch.Tensor):
    """A freshly initialised drafter of family `cfg.kind` for `target` over a draft vocabulary (sorted target ids)."""
    try:
        return family(cfg.kind).new(cfg, target, draft_to_target)
    except ValueError as exc:
        raise LoadError(str(exc)) from None


def export_drafter(src: str | Path, fmt: str, out: str | Path, verifier: str = "", num_draft_tokens: int = 4) -> Path:
    """`src` (any layout its family reads) written to `out` in the serving layout `fmt`, weights in their dtype,
    readable by all (0644): the serving engine often runs as another user than the one who exported."""
    found, raw = read_raw(src)
    if fmt not in family(found).formats:
        raise LoadError(f"drafter {src}: {format_refusal(found, fmt)}")
    try:
        config, tensors = family(found).export(raw, read_tensors(src), fmt, verifier, num_draft_tokens)
    except ValueError as exc:
        raise LoadError(f"drafter {src}: {exc}") from None
    path = write_checkpoint(config, tensors, out)
    for name in ("config.json", "model.safetensors"):
        (path / name).chmod(0o644)
    return path


def format_refusal(kind: str, fmt: str) -> str:
    """One line: the family, and the serving formats it has (none yet, for some)."""
    formats = family(kind).formats
    if not formats:
        return f"a '{kind}' drafter has no serving layout to export to yet (asked for '{fmt}')"
    return f"a '{kind}' drafter exports to {', '.join(formats)} only, not '{fmt}'"


def serving_command(kind: str, fmt: str, target: str, out: str | Path, num_draft_tokens: int) -> str:
    """The shell command that serves `out` (written by `export_drafter` in `fmt`) beside `target`: vLLM with the
    family's own `speculative_config`; a speculators directory names its verifier, so vLLM takes it alone; the
    sglang layout is EAGLE-3's, served as a chain (top-k 1) of K drafts, K + 1 tokens verified per step."""
    import shlex

    model = str(Path(out).resolve())
    if fmt == "speculators":
        return shlex.join(["vllm", "serve", model])
    if fmt == "sglang":
        k = str(num_draft_tokens)
        return shlex.join(
            ["python", "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm", "EAGLE3"]
            + ["--speculative-draft-model-path", model, "--speculative-num-steps", k, "--speculative-eagle-topk", "1"]
            + ["--speculative-num-draft-tokens", str(num_draft_tokens + 1)]
        )
    spec = family(kind).speculative_config(model, num_draft_tokens)
    return shlex.join(["vllm", "serve", target, "--speculative-config", json.dumps(spec)])


def inspect_checkpoint(path: str | Path, target=None) -> list[str]:
    """Lines describing a drafter directory: family, layout, conventions, shapes, fit to `target`."""
    found, raw = read_raw(path)
    tensors = read_tensors(path)
    cls = family(found)
    try:
        return [f"family: {found}", *cls.describe(raw, tensors, target)]
    except ValueError as exc:
        raise LoadError(f"drafter {path}: {exc}") from None
