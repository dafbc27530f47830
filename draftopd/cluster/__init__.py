"""Cluster launchers rendered from a recipe: KubeRay RayCluster and RayJob manifests, a SLURM batch script, and
the `ray job submit` line for a cluster that already runs (`draftopd cluster kuberay|slurm|submit RECIPE`).

`layout` works out what the recipe asks of the cluster (nodes from its `cluster` section, the GPUs, CPUs and memory
per node from its actors); `kuberay`, `slurm` and `submit` each write one kind of launcher from that layout. Every
cluster a launcher starts runs Ray with token authentication, and the token never appears in a rendered file or a
printed line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from draftopd.cluster import kuberay, slurm
from draftopd.cluster.kuberay import DATA, HOME, IMAGE_UID, KUBERAY_SECRET_VERSION, PVC
from draftopd.cluster.layout import Layout, plan
from draftopd.cluster.submit import submit_command, token_source
from draftopd.schema import ConfigError

# What tests and the CLI use: the layout, the image's user and home the Dockerfile must agree with, the renderers.
__all__ = ["HOME", "IMAGE_UID", "PVC", "Layout", "add_arguments", "plan", "render", "run", "submit_command"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "launcher",
        choices=["kuberay", "slurm", "submit"],
        help="kuberay: RayCluster and RayJob manifests; slurm: an sbatch script; submit: the ray job submit line",
    )
    p.add_argument("recipes", nargs="+", metavar="RECIPE", help="one or more Draft-OPD recipes")
    p.add_argument("--image", help="kuberay: the image every pod runs, built from the Dockerfile (required)")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="default: the recipe's cluster section")
    p.add_argument(
        "--cpus-per-node", type=int, metavar="C", help="default: the CPUs of the worst actor placement, plus one"
    )
    p.add_argument("--memory-per-node", type=int, metavar="GIB", help="default: 64 per GPU, or 4 per CPU")
    p.add_argument("--pvc", default=PVC, help=f"kuberay: the shared volume's claim, mounted at {DATA}")
    p.add_argument(
        "--auth-secret",
        metavar="SECRET",
        help=f"kuberay: a Secret of yours holding the Ray token under the key auth_token (KubeRay "
        f"{KUBERAY_SECRET_VERSION} or newer); default: KubeRay creates one per cluster",
    )
    p.add_argument("--address", default="http://HEAD:8265", help="submit: the cluster's dashboard address")
    p.add_argument("--runs-dir", help="submit: run.out_dir on storage every node sees")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="a recipe override, for the layout and the job alike (repeat; e.g. target.path=/data/models/Qwen3-8B)",
    )
    p.add_argument("--out", help="write the files into this folder (default: print them)")


def _command(args: argparse.Namespace, recipe: str) -> str:
    """The command line that renders this recipe's files, recorded in them (tests re-run it)."""
    words = ["draftopd", "cluster", args.launcher, recipe]
    for flag in ("image", "gpus_per_node", "cpus_per_node", "memory_per_node", "auth_secret", "out"):
        if getattr(args, flag) is not None:
            words += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.pvc != PVC:
        words += ["--pvc", args.pvc]
    for item in args.set:
        words += ["--set", item]
    return shlex.join(words)


def render(args: argparse.Namespace, recipe: str) -> dict[str, str]:
    """File name -> text, for one recipe ("" names the printed submit line)."""
    layout = plan(recipe, args.gpus_per_node, args.cpus_per_node, args.memory_per_node, args.set)
    command = _command(args, recipe)
    if args.launcher == "slurm":
        name = f"{Path(recipe).stem}.sbatch"
        script = (Path(args.out) / name).as_posix() if args.out else name
        return {name: slurm.render_sbatch(layout, command, script, args.set)}
    if args.launcher == "submit":
        line = submit_command(layout, args.address, args.runs_dir, args.set)
        source = token_source() or "none found: set RAY_AUTH_TOKEN_PATH to the file holding the cluster's token"
        return {"": f"# {layout.recipe}: {layout.describe()}\n# Ray token: {source}\n{line}\n"}
    if not args.image:
        raise ConfigError("draftopd cluster kuberay needs --image (the image built from the Dockerfile)")
    if not layout.recipe.startswith("recipes/"):
        print(f"note: the image holds the repository's recipes/ only, not {layout.recipe}", file=sys.stderr)
    stem = Path(recipe).stem
    return kuberay.render_files(layout, command, stem, args.image, args.pvc, args.set, args.auth_secret)


def run(args: argparse.Namespace) -> None:
    for recipe in args.recipes:
        for name, text in render(args, recipe).items():
            if args.out and name:
                path = Path(args.out) / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
                print(f"wrote {path}")
            else:
                print(text if name.endswith(".sbatch") or not name else f"---\n{text}", end="")
