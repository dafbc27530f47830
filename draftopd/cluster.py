"""Cluster launchers rendered from a recipe: KubeRay RayCluster and RayJob manifests, a SLURM batch script, and
the `ray job submit` line for a cluster that already runs (`draftopd cluster kuberay|slurm|submit RECIPE`).

A launcher has to ask the cluster for what the recipe asks Ray for: a rollout worker or learner rank that finds
no node with its GPUs and CPUs waits forever, silently. So the node count, the GPUs, CPUs and memory per node and
the entrypoint are computed here from the recipe, never typed by hand. Nodes come from the recipe's header line
`# layout: nodes=N gpus_per_node=G`, or from --gpus-per-node (then as many nodes as the GPU actors need).

Every cluster a launcher starts runs Ray with token authentication (a Ray cluster that takes jobs from anyone who
reaches its dashboard runs their code), and the token never appears in a rendered file or a printed line.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from draftopd.config import Config, ConfigError, load_config

IMAGE_UID = 1001  # the non-root user of the Dockerfile; tests check the two agree
HOME = "/home/draftopd"  # the image's working directory, holding the repository's recipes/
DATA = "/data"  # the shared volume on every pod: run directories (checkpoints) and the Hugging Face cache
PVC = "draftopd-data"  # its claim, cluster/kuberay/data-pvc.yaml
HEAD_CPUS, HEAD_MEMORY_GB = 4, 16  # the head runs the driver (tokenizer, prompts, MLflow) and Ray's GCS, no actors
RAY_PORT, DASHBOARD_PORT, CLIENT_PORT = 6379, 8265, 10001
# authOptions (Ray token authentication on RayCluster, RayJob and RayService) came in KubeRay 1.5.1, and
# authOptions.secretName in 1.6.0; both need Ray 2.52 or newer on the pods.
KUBERAY_VERSION, KUBERAY_SECRET_VERSION = "1.5.1", "1.6.0"
JOB_LABEL = "draftopd/rayjob"  # on a RayJob's pods: KubeRay names its cluster NAME-xxxxx, so ray.io/cluster is unknown
LAYOUT_LINE = re.compile(r"^#\s*layout:\s*nodes\s*=\s*(\d+)\s+gpus_per_node\s*=\s*(\d+)(?:\s+gpu\s*=\s*(\S+))?")


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
    gpu_type: str = ""  # `gpu=` of the layout line (H100-80GB, ...), for people: nothing selects nodes by it

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


def read_layout_line(recipe: str | Path) -> tuple[int, int, str] | None:
    """(nodes, gpus_per_node, gpu type or "") from a `# layout: nodes=N gpus_per_node=G [gpu=TYPE]` line, or None."""
    for line in Path(recipe).read_text(encoding="utf-8").splitlines():
        m = LAYOUT_LINE.match(line.strip())
        if m:
            return int(m.group(1)), int(m.group(2)), m.group(3) or ""
    return None


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
    layout line."""
    path = Path(recipe)
    cfg = load_config(path, overrides)
    if not cfg.opd.enabled:
        raise ConfigError(
            f"{path}: opd.enabled is false, and an SFT-only recipe runs in the driver process alone, not on Ray "
            "actors: run `draftopd train` (or `docker run IMAGE train`) on one machine"
        )
    actors = recipe_actors(cfg)
    total_gpus = sum(a.gpus for a in actors)
    header = read_layout_line(path)
    num_nodes, gpu_type = None, ""
    if gpus_per_node is None and header is not None:
        num_nodes, gpus_per_node, gpu_type = header
    elif gpus_per_node is None:
        if total_gpus:
            raise ConfigError(
                f"{path} asks for {_num(total_gpus)} GPUs and has no '# layout: nodes=N gpus_per_node=G' line: "
                "pass --gpus-per-node"
            )
        gpus_per_node = 0
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


# -- KubeRay -------------------------------------------------------------------------------------------------


def _pod(container: dict, gpus: int, pvc: str, labels: dict | None) -> dict:
    spec = {
        "securityContext": {"runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID, "fsGroup": IMAGE_UID},
        "containers": [container],
        "volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": pvc}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # vLLM and NCCL need more than 64 MB of /dev/shm
        ],
    }
    if gpus:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return ({"metadata": {"labels": labels}} if labels else {}) | {"spec": spec}  # KubeRay copies the labels to pods


def _container(name: str, image: str, cpus: int, memory_gb: int, gpus: int) -> dict:
    amount = {"cpu": cpus, "memory": f"{memory_gb}Gi"} | ({"nvidia.com/gpu": gpus} if gpus else {})
    return {
        "name": name,
        "image": image,
        "workingDir": HOME,  # `ray start` runs here, so job entrypoints do too (recipes/ is here)
        # No RAY_AUTH_MODE here: authOptions has KubeRay set it and the token on every Ray container, probe and
        # submitter.
        "env": [{"name": "HF_HOME", "value": f"{DATA}/hf-cache"}],
        "resources": {"requests": dict(amount), "limits": dict(amount)},
        "volumeMounts": [{"name": "data", "mountPath": DATA}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }


def ray_cluster_spec(
    layout: Layout,
    image: str,
    pvc: str = PVC,
    auth_secret: str | None = None,
    dashboard_host: str = "127.0.0.1",
    pod_labels: dict | None = None,
) -> dict:
    """The cluster both kinds start. Ray token authentication is on: KubeRay creates a Secret named after the
    RayCluster holding a random token, or uses `auth_secret` (a Secret of the user's, key auth_token)."""
    from importlib.metadata import version

    head = _container("ray-head", image, HEAD_CPUS, HEAD_MEMORY_GB, 0)
    head["ports"] = [
        {"containerPort": RAY_PORT, "name": "gcs-server"},
        {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
        {"containerPort": CLIENT_PORT, "name": "client"},
    ]
    g = layout.gpus_per_node
    worker = _container("ray-worker", image, layout.cpus_per_node, layout.memory_gb_per_node, g)
    worker_params = {"num-cpus": str(layout.cpus_per_node)} | ({"num-gpus": str(g)} if g else {})
    return {
        "rayVersion": version("ray"),
        "authOptions": {"mode": "token"} | ({"secretName": auth_secret} if auth_secret else {}),
        "headGroupSpec": {
            # num-cpus 0: no actor lands on the head, so every GPU actor goes to a worker pod.
            "rayStartParams": {"dashboard-host": dashboard_host, "num-cpus": "0"},
            "template": _pod(head, 0, pvc, pod_labels),
        },
        "workerGroupSpecs": [
            {
                "groupName": "gpu-workers" if g else "cpu-workers",
                "replicas": layout.num_nodes,
                "minReplicas": layout.num_nodes,
                "maxReplicas": layout.num_nodes,
                "rayStartParams": worker_params,
                "template": _pod(worker, g, pvc, pod_labels),
            }
        ],
    }


def _metadata(layout: Layout) -> dict:
    return {
        "name": f"draftopd-{layout.name}"[:50].rstrip("-"),
        "labels": {"app.kubernetes.io/name": "draftopd", "draftopd/recipe": layout.name[:63].rstrip("-")},
    }


def render_raycluster(layout: Layout, image: str, pvc: str = PVC, auth_secret: str | None = None) -> dict:
    """A long-lived cluster for the recipe; jobs go in with `ray job submit` through a port-forward. Its dashboard
    listens on the head pod's loopback alone: `kubectl port-forward` reaches it there, and no pod has to."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _metadata(layout),
        "spec": ray_cluster_spec(layout, image, pvc, auth_secret),
    }


def render_rayjob(
    layout: Layout, image: str, pvc: str = PVC, overrides: list[str] | None = None, auth_secret: str | None = None
) -> dict:
    """One job: KubeRay starts the cluster, runs the recipe on it and deletes the cluster when it ends."""
    name = _metadata(layout)["name"]
    # The dashboard listens on the pod's address: the submitter pod sends the job there, and the operator reads
    # the job's status there (KubeRay's RayJob controller polls it). The NetworkPolicy admits those two alone.
    spec = ray_cluster_spec(layout, image, pvc, auth_secret, "0.0.0.0", {JOB_LABEL: name})
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": _metadata(layout),
        "spec": {
            "entrypoint": entrypoint(layout, f"{DATA}/runs", overrides),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "rayClusterSpec": spec,
        },
    }


def render_network_policy(layout: Layout, kind: str) -> dict:
    """Ingress to every pod of the RayCluster (or the RayJob's cluster): from the cluster's own pods on any port
    (the head's GCS, dashboard and client ports, the raylets, object managers and workers), and for a RayJob from
    its submitter pod and the KubeRay operator on the dashboard port only. Nothing else gets in; the kubelet's
    probes and `kubectl port-forward` are not filtered by a NetworkPolicy."""
    name = _metadata(layout)["name"]
    pods = {"ray.io/cluster": name} if kind == "RayCluster" else {JOB_LABEL: name}
    ingress: list[dict] = [{"from": [{"podSelector": {"matchLabels": pods}}]}]
    if kind == "RayJob":
        submitter = {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": name}}}  # KubeRay's Job
        # the operator's Helm chart and kustomize manifests both label its pod so, in whatever namespace it runs
        operator = {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}},
        }
        ingress.append({"from": [submitter, operator], "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-{kind.lower()}", "labels": _metadata(layout)["labels"]},
        "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def dump_yaml(header: list[str], *docs: dict) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data):  # a dict used twice is written twice, not as &id001 and *id001
            return True

    lines = "".join(f"# {h}\n" for h in header)
    return lines + yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=4096)


# -- SLURM ---------------------------------------------------------------------------------------------------

SBATCH = """\
#!/bin/bash
# Rendered by: @COMMAND@
# @RECIPE@: @DESCRIBE@.
# Re-render after editing the recipe; do not edit by hand.
#
# Submit from the repository root, on a filesystem every node mounts; arguments are recipe overrides:
#   sbatch @SCRIPT@ [section.field=value ...]
# Every node needs draftopd (and the target at the recipe's path): activate a virtual environment that lives on
# the shared filesystem before sbatch (srun hands the environment on), or run the GPU image through pyxis:
#   DRAFTOPD_SRUN_ARGS="--container-image=registry.example.com/draftopd:0.1.0 --container-mounts=$PWD:$PWD
#     --container-workdir=$PWD" (and DRAFTOPD_RUNS_DIR on a mounted path)
#SBATCH --job-name=draftopd-@NAME@
#SBATCH --nodes=@NODES@
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=@CPUS@
@GPU_LINES@#SBATCH --mem=@MEMORY@G
#SBATCH --output=%x-%j.out
set -euo pipefail

RECIPE=@RECIPE@
NUM_NODES=@NODES@
CPUS=@CPUS@
GPUS=@GPUS@
RUNS_DIR=${DRAFTOPD_RUNS_DIR:-$PWD/runs}  # learners write checkpoints here: every node must see it
RAY_PORT=${DRAFTOPD_RAY_PORT:-@RAY_PORT@}
read -r -a SRUN_ARGS <<< "${DRAFTOPD_SRUN_ARGS:-}"

# A Ray token of this job's own: srun hands it, with the rest of the environment, to every Ray process below.
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')
export RAY_AUTH_TOKEN

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${SLURMD_NODENAME:-${NODES[0]}}  # the batch script runs on the head's node
HEAD_IP=${DRAFTOPD_HEAD_IP:-$(hostname --ip-address | tr ' ' '\\n' | grep -m1 -E '^[0-9.]+$')}
ADDRESS=$HEAD_IP:$RAY_PORT

# One task on HOST beside the Ray node already running there (the driver, the polls).
on_node() {
  local host=$1
  shift
  srun --nodes=1 --ntasks=1 --overlap -w "$host" "${SRUN_ARGS[@]}" "$@"
}

# A Ray node on HOST, holding the node's CPUs and GPUs until the job ends.
ray_node() {
  local host=$1
  shift
  srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS"@GPU_SRUN@ -w "$host" "${SRUN_ARGS[@]}" \\
    ray start --block --num-cpus="$CPUS" --num-gpus="$GPUS" "$@" &
}

COUNT_NODES='import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
sys.exit(sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]))'

wait_for_nodes() {
  for _ in $(seq 60); do
    if on_node "$HEAD" python3 -c "$COUNT_NODES" "$ADDRESS" "$1" >/dev/null 2>&1; then
      return 0
    fi
    sleep 10
  done
  echo "draftopd: the Ray cluster did not reach $1 node(s) in 10 minutes" >&2
  return 1
}

trap 'jobs -p | xargs -r kill 2>/dev/null || true' EXIT

ray_node "$HEAD" --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT"
wait_for_nodes 1
for host in "${NODES[@]}"; do
  if [ "$host" != "$HEAD" ]; then
    ray_node "$host" --address="$ADDRESS"
  fi
done
wait_for_nodes "$NUM_NODES"

# The driver runs on the head's node and joins the cluster through ray.address; its exit status is the job's.
on_node "$HEAD" draftopd train "$RECIPE" ray.address="$ADDRESS" run.out_dir="$RUNS_DIR"@OVERRIDES@ "$@"
"""


def render_sbatch(layout: Layout, command: str, script: str, overrides: list[str] | None = None) -> str:
    g = layout.gpus_per_node
    # A layout with GPUs takes whole nodes: Ray's ports and the GPUs are not shared with other jobs.
    gpu_lines = f"#SBATCH --gpus-per-node={g}\n#SBATCH --exclusive\n" if g else ""
    values = {
        "COMMAND": command,
        "RECIPE": layout.recipe,
        "DESCRIBE": layout.describe(),
        "SCRIPT": script,
        "NAME": layout.name,
        "NODES": str(layout.num_nodes),
        "CPUS": str(layout.cpus_per_node),
        "GPUS": str(g),
        "MEMORY": str(layout.memory_gb_per_node),
        "GPU_LINES": gpu_lines,
        "GPU_SRUN": ' --gpus-per-node="$GPUS"' if g else "",
        "RAY_PORT": str(RAY_PORT),
        "OVERRIDES": "".join(f" {shlex.quote(o)}" for o in overrides or []),
    }
    text = SBATCH
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


# -- an existing cluster -------------------------------------------------------------------------------------


def submit_command(
    layout: Layout,
    address: str,
    runs_dir: str | None = None,
    overrides: list[str] | None = None,
    env: Mapping[str, str] = os.environ,
) -> str:
    """`ray job submit` of the recipe from a checkout (the working directory travels with the job), to a cluster
    with Ray's token authentication on. Ray's CLI reads the token from $RAY_AUTH_TOKEN, else from the file
    $RAY_AUTH_TOKEN_PATH, else from ~/.ray/auth_token: the line names that file when there is one, never the token."""
    job = shlex.split(entrypoint(layout, runs_dir, overrides))
    auth = "RAY_AUTH_MODE=token "  # without it the CLI sends no token
    if env.get("RAY_AUTH_TOKEN_PATH") and not env.get("RAY_AUTH_TOKEN"):
        path = Path(env["RAY_AUTH_TOKEN_PATH"]).expanduser().resolve()
        auth += f"RAY_AUTH_TOKEN_PATH={shlex.quote(str(path))} "  # quoted after the `=`, so it stays an assignment
    return auth + shlex.join(["ray", "job", "submit", "--address", address, "--working-dir", ".", "--", *job])


def token_source(env: Mapping[str, str] = os.environ) -> str | None:
    """Where Ray's CLI will find the token, in its order, or None when it finds none."""
    if env.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN"
    if env.get("RAY_AUTH_TOKEN_PATH"):
        return f"the file $RAY_AUTH_TOKEN_PATH ({env['RAY_AUTH_TOKEN_PATH']})"
    default = Path("~/.ray/auth_token")
    return str(default) if default.expanduser().is_file() else None


# -- the `draftopd cluster` command --------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "launcher",
        choices=["kuberay", "slurm", "submit"],
        help="kuberay: RayCluster and RayJob manifests; slurm: an sbatch script; submit: the ray job submit line",
    )
    p.add_argument("recipes", nargs="+", metavar="RECIPE", help="one or more Draft-OPD recipes")
    p.add_argument("--image", help="kuberay: the image every pod runs, built from the Dockerfile (required)")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="default: the recipe's '# layout:' line")
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
    """File name -> text, for one recipe."""
    layout = plan(recipe, args.gpus_per_node, args.cpus_per_node, args.memory_per_node, args.set)
    command = _command(args, recipe)
    if args.launcher == "slurm":
        name = f"{Path(recipe).stem}.sbatch"
        script = (Path(args.out) / name).as_posix() if args.out else name
        return {name: render_sbatch(layout, command, script, args.set)}
    if args.launcher == "submit":
        line = submit_command(layout, args.address, args.runs_dir, args.set)
        source = token_source() or "none found: set RAY_AUTH_TOKEN_PATH to the file holding the cluster's token"
        return {"": f"# {layout.recipe}: {layout.describe()}\n# Ray token: {source}\n{line}\n"}
    if not args.image:
        raise ConfigError("draftopd cluster kuberay needs --image (the image built from the Dockerfile)")
    if not layout.recipe.startswith("recipes/"):
        print(f"note: the image holds the repository's recipes/ only, not {layout.recipe}", file=sys.stderr)
    needs = f"KubeRay operator {KUBERAY_SECRET_VERSION if args.auth_secret else KUBERAY_VERSION} or newer"
    header = [
        f"Rendered by: {command}",
        f"{layout.recipe}: {layout.describe()}.",
        f"Needs the {needs} (authOptions: Ray token authentication), and a network plugin that enforces the "
        "NetworkPolicy below it.",
        "Re-render, do not edit.",
    ]
    cluster = render_raycluster(layout, args.image, args.pvc, args.auth_secret)
    job = render_rayjob(layout, args.image, args.pvc, args.set, args.auth_secret)
    stem = Path(recipe).stem
    return {
        f"{stem}-raycluster.yaml": dump_yaml(header, cluster, render_network_policy(layout, "RayCluster")),
        f"{stem}-rayjob.yaml": dump_yaml(header, job, render_network_policy(layout, "RayJob")),
    }


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
