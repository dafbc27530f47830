"""What a recipe asks of a cluster: the actors it places, and the nodes, CPUs and memory that hold them.

A rollout worker or learner rank that finds no node with its GPUs and CPUs waits forever, silently. So the node
count, the GPUs, CPUs and memory per node and the entrypoint are computed here from the recipe, never typed by
hand. Nodes come from the recipe's `cluster` section (`cluster.nodes`, `cluster.gpus_per_node`), or from
--gpus-per-node (then as many nodes as the GPU actors need).
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from draftopd.config import Config, ConfigError, load_config

RAY_PORT, DASHBOARD_PORT, CLIENT_PORT = 6379, 8265, 10001  # Ray's ports, on every launcher


@dataclass(frozen=True)
class Actor:
    role: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class Layout:
    """What one recipe needs of a cluster. Invariants: the GPU actors, placed first-fit, fit on `num_nodes` nodes
    of `gpus_per_node` GPUs; `cpus_per_node` covers whatever placement Ray chooses within those GPUs."""

    recipe: str  # as the job names it: recipes/NAME.yaml, relative to the image's (and the checkout's) root
    name: str  # the recipe's stem, made a valid Kubernetes name
    num_nodes: int
    gpus_per_node: int
    cpus_per_node: int
    memory_gb_per_node: int
    actors: tuple[Actor, ...]
    gpu_type: str = ""  # `cluster.gpu` of the recipe (H100-80GB, ...), for people: nothing selects nodes by it

    @property
    def total_gpus(self) -> float:
        return sum(a.gpus for a in self.actors)

    @property
    def total_cpus(self) -> float:
        return sum(a.cpus for a in self.actors)

    def describe(self) -> str:
        gpu = f" {self.gpu_type}" if self.gpu_type else ""
        return (
            f"{self.num_nodes} node(s) x {self.gpus_per_node}{gpu} GPU(s), {self.cpus_per_node} CPUs, "
            f"{self.memory_gb_per_node} GiB; the actors ask Ray for {_num(self.total_gpus)} GPUs and "
            f"{_num(self.total_cpus)} CPUs"
        )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def recipe_actors(cfg: Config) -> list[Actor]:
    """The actors a Draft-OPD job places, with the resources opd/actors.py asks Ray for (the replay buffer asks
    for none)."""
    r, lr = cfg.rollout, cfg.learner
    workers = [Actor("rollout", r.num_cpus_per_worker, r.num_gpus_per_worker)] * r.num_workers
    return workers + [Actor("learner", lr.num_cpus_per_learner, lr.num_gpus_per_learner)] * lr.num_learners


def _place_gpu_actors(actors: list[Actor], gpus_per_node: int, num_nodes: int | None) -> list[list[Actor]]:
    """First-fit decreasing on GPUs, opening nodes as needed when num_nodes is None. Raises when a GPU actor fits
    no node."""
    nodes: list[list[Actor]] = [[] for _ in range(num_nodes or 0)]
    for a in sorted((a for a in actors if a.gpus), key=lambda a: -a.gpus):
        if a.gpus > gpus_per_node:
            raise ConfigError(f"a {a.role} actor asks for {_num(a.gpus)} GPUs; a node has {gpus_per_node}")
        node = next((n for n in nodes if sum(b.gpus for b in n) + a.gpus <= gpus_per_node), None)
        if node is None:
            if num_nodes is not None:
                raise ConfigError(
                    f"the GPU actors do not fit on {num_nodes} node(s) of {gpus_per_node} GPUs "
                    f"({_num(sum(b.gpus for b in actors))} GPUs in all)"
                )
            node = []
            nodes.append(node)
        node.append(a)
    return nodes or [[]]


def _cpus_per_node(actors: list[Actor], gpus_per_node: int) -> int:
    """CPUs one node needs whichever way Ray places the actors: the GPU actors asking most CPU per GPU that fit
    in its GPUs, every CPU-only actor (Ray may pack them all on one node), and one CPU for the raylet, the object
    store and Ray's own workers."""
    left, cpus = gpus_per_node, 0.0
    for a in sorted((a for a in actors if a.gpus), key=lambda a: -a.cpus / a.gpus):
        if a.gpus <= left:
            left, cpus = left - a.gpus, cpus + a.cpus
    return math.ceil(cpus + sum(a.cpus for a in actors if not a.gpus)) + 1


def plan(
    recipe: str | Path,
    gpus_per_node: int | None = None,
    cpus_per_node: int | None = None,
    memory_gb_per_node: int | None = None,
    overrides: list[str] | None = None,
) -> Layout:
    """The cluster a recipe (with `section.field=value` overrides) needs. --gpus-per-node wins over the recipe's
    `cluster` section (its node count and GPU type included)."""
    path = Path(recipe)
    cfg = load_config(path, overrides)
    if not cfg.opd.enabled:
        raise ConfigError(
            f"{path}: opd.enabled is false, and an SFT-only recipe runs in the driver process alone, not on Ray "
            "actors: run `draftopd train` (or `docker run IMAGE train`) on one machine"
        )
    actors = recipe_actors(cfg)
    total_gpus = sum(a.gpus for a in actors)
    num_nodes, gpu_type = None, ""
    if gpus_per_node is None:
        num_nodes, gpus_per_node, gpu_type = cfg.cluster.nodes or None, cfg.cluster.gpus_per_node, cfg.cluster.gpu
        if total_gpus and not gpus_per_node and num_nodes is None:
            raise ConfigError(
                f"{path} asks for {_num(total_gpus)} GPUs and sets no cluster.nodes / cluster.gpus_per_node: "
                "pass --gpus-per-node"
            )
    if gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be >= 0, not {gpus_per_node}")
    nodes = _place_gpu_actors(actors, gpus_per_node, num_nodes)
    needed = _cpus_per_node(actors, gpus_per_node)
    if cpus_per_node is not None and cpus_per_node < needed:
        raise ConfigError(f"--cpus-per-node {cpus_per_node} is too few: a node may have to hold {needed}")
    cpus = cpus_per_node or needed
    # Host memory: each GPU's actor loads a target checkpoint before it moves to the GPU, and CPU learner ranks
    # hold the target in memory. 64 GiB per GPU fits 8-GPU nodes (usually 1-2 TiB); CPU-only nodes get 4 GiB/CPU.
    memory = memory_gb_per_node or max(8, 64 * gpus_per_node if gpus_per_node else 4 * cpus)
    name = re.sub(r"[^a-z0-9-]+", "-", path.stem.lower()).strip("-")
    ref = f"recipes/{path.name}" if path.parent.name == "recipes" else path.as_posix()
    return Layout(ref, name, len(nodes), gpus_per_node, cpus, memory, tuple(actors), gpu_type)


def entrypoint(layout: Layout, runs_dir: str | None, overrides: list[str] | None = None) -> str:
    """`draftopd train RECIPE [run.out_dir=...] [overrides]`: the job every launcher runs."""
    cmd = ["draftopd", "train", layout.recipe] + ([f"run.out_dir={runs_dir}"] if runs_dir else [])
    return shlex.join(cmd + list(overrides or []))
