"""Commands of a run's life: `train` a recipe, `plan` its memory and hours, watch it with `ui`."""

from __future__ import annotations

import sys
from pathlib import Path

from draftopd.cli.common import add_command


def register(sub) -> None:
    p = add_command(
        sub, "train", cmd_train, "run a recipe: SFT of a drafter, then Draft-OPD when the recipe enables it"
    )
    p.add_argument("recipe", help="recipe YAML, or a run directory to resume")
    p.add_argument("overrides", nargs="*", help="section.field=value")

    p = add_command(sub, "plan", cmd_plan, "a recipe's memory per GPU role against cluster.gpu, step times and hours")
    p.add_argument("recipe", help="recipe YAML")
    p.add_argument("overrides", nargs="*", help="section.field=value")
    p.add_argument("--json", default=None, help="also write the plan here (roles, parts, hours)")

    p = add_command(sub, "ui", cmd_ui, "serve the MLflow UI for a run directory (or a tracking URI) on 127.0.0.1")
    p.add_argument("store", help="run directory holding mlflow.db, a path to an mlflow.db, or a backend store URI")
    p.add_argument("--port", type=int, default=5000, help="port on 127.0.0.1")


def cmd_train(args) -> None:
    from draftopd.cli.recipe_check import check_local_gpus, check_recipe_paths
    from draftopd.config import ConfigError, load_config
    from draftopd.plan import check_before_train
    from draftopd.sft.pipeline import run_sft

    run_dir = Path(args.recipe)
    if run_dir.is_dir():  # a run directory: resume it with the config it was started with
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} is a directory but not a run directory (it has no config.yaml)")
        resume = [f"run.out_dir={run_dir.resolve().parent}", f"run.name={run_dir.name}", "run.resume=true"]
        cfg = load_config(run_dir / "config.yaml", [*resume, *args.overrides])
    else:
        cfg = load_config(args.recipe, args.overrides)
    check_before_train(cfg, args.recipe)  # a layout that cannot fit its GPUs stops here, before any actor starts
    check_recipe_paths(cfg)  # so does a target, pool or checkpoint that is not on disk
    check_local_gpus(cfg)  # and a run of its own Ray that asks for more GPUs than this machine has
    if cfg.opd.enabled:
        from draftopd.opd.driver import run_opd

        run_opd(cfg, sys.argv)
    else:
        run_sft(cfg, sys.argv)


def cmd_plan(args) -> None:
    from draftopd.plan import plan_command

    plan_command(args.recipe, args.overrides, args.json)


def cmd_ui(args) -> int:
    from draftopd.tracking import serve_ui

    return serve_ui(args.store, args.port)
