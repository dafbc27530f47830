"""`draftopd cluster kuberay|slurm|submit RECIPE`: a recipe's cluster launchers (draftopd/cluster renders them)."""

from __future__ import annotations

from draftopd.cli.common import add_command


def register(sub) -> None:
    from draftopd.cluster import add_arguments

    p = add_command(
        sub,
        "cluster",
        cmd_cluster,
        "a recipe's cluster launchers: KubeRay RayCluster/RayJob, a SLURM script, ray job submit",
    )
    add_arguments(p)


def cmd_cluster(args) -> None:
    from draftopd.cli.recipe_check import check_recipe_paths
    from draftopd.cluster import run
    from draftopd.config import load_config
    from draftopd.plan import check_before_train

    if args.launcher == "submit":  # a printed line is run as is: check what `train` would check first
        for recipe in args.recipes:
            cfg = load_config(recipe, args.set)
            check_before_train(cfg, recipe)
            check_recipe_paths(cfg, on_cluster=True)
    run(args)
