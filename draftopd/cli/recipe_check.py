"""Before `train` starts anything or `cluster submit` prints a line: the paths a recipe reads must be there.

A recipe names its target, prompt pools and starting checkpoints by path; a wrong one (a hub name such as
`Qwen/Qwen3-8B`, which is never downloaded, or a pool not prepared yet) would otherwise surface minutes into a run,
or on the cluster after the job was submitted. `train` checks them on this machine. `cluster submit` runs the job
from this checkout on a cluster: relative paths travel with it and are checked here, absolute ones live on the
cluster's storage and cannot be.
"""

from __future__ import annotations

from pathlib import Path

from draftopd.config import TOY_TARGET, Config, ConfigError
from draftopd.loading import TOY_DRAFTERS


def recipe_paths(cfg: Config) -> dict[str, str]:
    """key -> path of what the recipe reads from disk (the shipped toy assets left out)."""
    paths = {
        "target.path": cfg.target.path,
        "data.prompts": cfg.data.prompts,
        "data.eval_prompts": cfg.data.eval_prompts,
        "drafter.init": cfg.drafter.init,
        "drafter.base_lm": cfg.drafter.base_lm,
    }
    shipped = {TOY_TARGET, *TOY_DRAFTERS}  # names of what draftopd/assets holds
    return {key: value for key, value in paths.items() if value and value not in shipped}


def check_recipe_paths(cfg: Config, on_cluster: bool = False) -> None:
    """ConfigError, one line naming the key, for the first path that is not there; on a cluster, absolute paths
    are on its storage and are left to the job."""
    for key, value in recipe_paths(cfg).items():
        path = Path(value)
        if on_cluster and path.is_absolute():
            continue
        if not path.exists():
            raise ConfigError(_missing(key, value, on_cluster))
        if key == "target.path" and not (path / "config.json").is_file():
            raise ConfigError(f"target.path={value}: no config.json in that directory (a Hugging Face model folder)")


def _missing(key: str, value: str, on_cluster: bool) -> str:
    if key == "target.path":
        where, how = (" on storage every node sees", "--set target.path=DIR") if on_cluster else ("", "target.path=DIR")
        return (
            f"target.path={value}: no such directory; a target is read from disk, never downloaded: "
            f"`hf download {value} --local-dir DIR`{where}, then {how}"
        )
    if key.startswith("data."):
        return f"{key}={value}: no such file or pool; make it with `draftopd prepare-data --out {value} ...` first"
    return f"{key}={value}: no such checkpoint directory"


def check_local_gpus(cfg: Config, env: dict | None = None) -> None:
    """A Draft-OPD run that starts its own Ray (no `ray.address`, not under `ray job submit`) gets this machine's
    GPUs alone: asking for more would leave its actors waiting for GPUs that never come."""
    import os

    env = os.environ if env is None else env
    if not cfg.opd.enabled or cfg.ray.in_process or cfg.ray.address or env.get("RAY_ADDRESS"):
        return
    import torch

    from draftopd.cluster.layout import recipe_actors

    asked = sum(a.gpus for a in recipe_actors(cfg))
    here = torch.cuda.device_count()
    if asked > here:
        raise ConfigError(
            f"the recipe's actors ask Ray for {asked:g} GPUs and this machine has {here}: run it on a cluster "
            "(`draftopd cluster submit RECIPE`, or ray.address=ADDRESS), or give it fewer GPU actors"
        )
