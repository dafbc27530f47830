"""The recipe loader: schema defaults, the recipe, then overrides, checked.

The schema itself (sections, defaults with one docstring line each, closed choices) is `schema.py`, below
every other module; this loader sits above the drafters and the data layer because a resolved recipe is also
checked against the rules of its drafter family (asked of the family class: `max_drafts`, `config_refusal`)
and its data sources. A recipe YAML holds only what differs for its target, and `section.field=value`
overrides on the command line come last. Loading is OmegaConf's structured merge (schema -> recipe ->
overrides -> objects); an unknown key or a value of the wrong type is a `ConfigError` that names the key and
the closest valid one. The schema's names are re-exported here, so callers import one module.
"""

from __future__ import annotations

from pathlib import Path

from draftopd.schema import (
    CHOICES,
    TOY_TARGET,
    BufferConfig,
    ClusterConfig,
    Config,
    ConfigError,
    DataConfig,
    DrafterConfig,
    EvalConfig,
    LearnerConfig,
    OPDConfig,
    RayConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    SyncConfig,
    TargetConfig,
    TrackingConfig,
    check_keys,
    to_dict,
)

__all__ = [
    "CHOICES",
    "TOY_TARGET",
    "BufferConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DrafterConfig",
    "EvalConfig",
    "LearnerConfig",
    "OPDConfig",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SyncConfig",
    "TargetConfig",
    "TrackingConfig",
    "load_config",
    "to_dict",
]


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


def _recipe_layers(path: Path, below: tuple[Path, ...] = ()) -> list[tuple[str, dict]]:
    """The recipe's values, its bases' first: a top-level `base: FILE` (relative to the recipe, and itself a recipe
    that may name a base) holds the values the recipe does not set."""
    from omegaconf import OmegaConf

    try:
        data = OmegaConf.to_container(OmegaConf.load(path)) or {}
    except Exception as exc:  # yaml errors carry line numbers
        raise ConfigError(f"recipe {path} is not valid YAML: {exc}") from None
    layers = []
    if isinstance(data, dict) and "base" in data:
        name = data.pop("base")
        base = path.parent / str(name)
        if not base.is_file():
            raise ConfigError(f"{path}: its base {name} is not a file ({base})")
        below = (*below, path.resolve())
        if base.resolve() in below:
            raise ConfigError(f"{path}: its base {name} is the recipe itself or one based on it")
        layers = _recipe_layers(base, below)
    try:
        check_keys(data, Config)
    except ConfigError as exc:  # say which file of the chain holds the typo
        raise ConfigError(f"{path}: {exc}") from None
    return [*layers, (str(path), data)]


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Schema defaults, then the recipe YAML (its `base` chain first), then `section.field=value` overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(Config)
    layers = []
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {path} not found")
        layers += [(source, OmegaConf.create(data)) for source, data in _recipe_layers(path)]
    if overrides:
        dotted = _dotlist_to_dict(overrides)
        check_keys(dotted, Config)
        layers.append(("overrides", OmegaConf.from_dotlist(list(overrides))))
    merged = base
    for source, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or "?"
            msg = str(exc).splitlines()[0]
            raise ConfigError(f"{source}: bad value for '{key}': {msg}") from None
    cfg = OmegaConf.to_object(merged)
    _check_choices(cfg)
    return cfg


def _check_choices(cfg: Config) -> None:
    from draftopd.drafters import FAMILIES  # the family list lives with the families

    for key, allowed in {**CHOICES, "drafter.kind": tuple(FAMILIES)}.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    rollout_k, eval_ks = cfg.rollout.num_draft_tokens, cfg.eval.num_draft_tokens
    if rollout_k < 1 or any(k < 1 for k in eval_ks):  # K = 0 decodes without the drafter, K < 0 fails in a proposer
        key, value = ("rollout.num_draft_tokens", rollout_k) if rollout_k < 1 else ("eval.num_draft_tokens", eval_ks)
        raise ConfigError(f"{key}={value}: K, the drafts per step, must be at least 1")
    _check_family(cfg, FAMILIES[cfg.drafter.kind])
    if cfg.ray.in_process and (cfg.learner.num_learners != 1 or cfg.sync.backend != "object_store"):
        raise ConfigError(
            "ray.in_process=true runs one learner rank (learner.num_learners=1) and sync.backend=object_store"
        )
    from draftopd.data.io import PromptError
    from draftopd.data.prompts import check_distinct_sources

    try:
        check_distinct_sources(cfg.data.prompts, cfg.data.eval_prompts)
    except PromptError as exc:
        raise ConfigError(str(exc)) from None
    o, max_staleness = cfg.opd, cfg.buffer.max_staleness
    if o.accumulate_rounds < 1:
        raise ConfigError(f"opd.accumulate_rounds={o.accumulate_rounds} must be at least 1")
    if not cfg.sync.timeout_s > 0:  # a group without a deadline hangs on a lost member until NCCL's watchdog
        raise ConfigError(f"sync.timeout_s={cfg.sync.timeout_s} must be positive")
    if o.max_policy_lag not in (0, 1):
        # one round in flight at a time: a larger lag would only queue more rounds on the same workers
        raise ConfigError(f"opd.max_policy_lag={o.max_policy_lag} must be 0 (synchronous) or 1 (overlapped)")
    if (1 + o.max_policy_lag) * o.steps_per_round + o.sync_every > max_staleness:
        # A round's states would go stale before its last learner step: the step would find none to replay.
        lag = f"(1 + opd.max_policy_lag {o.max_policy_lag}) x " if o.max_policy_lag else ""
        raise ConfigError(
            f"{lag}opd.steps_per_round + opd.sync_every ({o.steps_per_round} + {o.sync_every}) must not exceed "
            f"buffer.max_staleness ({max_staleness})"
        )
    if cfg.learner.num_gpus_per_learner not in (0, 1):
        # A rank computes on one device (opd/learner.py::learner_device); NCCL refuses two ranks on one GPU.
        raise ConfigError(
            f"learner.num_gpus_per_learner={cfg.learner.num_gpus_per_learner!r} must be 0 (CPU ranks, gloo) "
            "or 1 (one GPU per rank, NCCL)"
        )


def _rollout_refusal(cfg: Config, family) -> str:
    """Why Draft-OPD cannot roll out with vLLM as configured ('' when it can): the drafter must take live pushes
    (its family's rule), and stock records (vLLM's per-request metrics) carry no rejected stream."""
    if not cfg.opd.enabled or cfg.rollout.backend != "vllm":
        return ""
    if not family.live_push:
        return f"drafter.kind={cfg.drafter.kind} takes no live weight pushes into vLLM: use rollout.backend=native"
    if cfg.learner.rej_coef > 0 and cfg.rollout.record != "full":
        return (
            f"learner.rej_coef={cfg.learner.rej_coef:g} needs the rejected drafts' scores, which only "
            "rollout.record=full records (stock records carry the accepted stream): set it, or learner.rej_coef=0"
        )
    return ""


def _check_family(cfg: Config, family) -> None:
    """The rules of the recipe's drafter family, asked of its class: what it refuses to run, and the most drafts a
    step holds (checked here when the drafter is built from the recipe; a checkpoint's own shape is checked by
    its proposer)."""
    reason = family.config_refusal(cfg) or _rollout_refusal(cfg, family)
    if reason:
        raise ConfigError(reason)
    d, limit = cfg.drafter, family.max_drafts(cfg.drafter)
    if limit is None or d.init:
        return
    asked = {"eval.num_draft_tokens": max(cfg.eval.num_draft_tokens, default=0)}
    if cfg.opd.enabled:
        asked["rollout.num_draft_tokens"] = cfg.rollout.num_draft_tokens
    for key, k in asked.items():
        if k > limit:
            raise ConfigError(
                f"{key} asks for {k} drafts per step, but a {d.kind} block of drafter.block_size={d.block_size} "
                f"holds at most {limit}"
            )
