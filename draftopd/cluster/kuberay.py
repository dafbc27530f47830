"""KubeRay launchers for a recipe: a long-lived RayCluster, a one-run RayJob, and a NetworkPolicy beside each.

Every cluster runs Ray with token authentication (a Ray cluster that takes jobs from anyone who reaches its
dashboard runs their code): KubeRay makes the token and hands it to every Ray container, probe and submitter, so it
never appears in a rendered file.
"""

from __future__ import annotations

from draftopd.cluster.layout import CLIENT_PORT, DASHBOARD_PORT, RAY_PORT, Layout, entrypoint

IMAGE_UID = 1001  # the non-root user of the Dockerfile; tests check the two agree
HOME = "/home/draftopd"  # the image's working directory, holding the repository's recipes/
DATA = "/data"  # the shared volume on every pod: run directories (checkpoints) and the Hugging Face cache
PVC = "draftopd-data"  # its claim, cluster/kuberay/data-pvc.yaml
HEAD_CPUS, HEAD_MEMORY_GB = 4, 16  # the head runs the driver (tokenizer, prompts, MLflow) and Ray's GCS, no actors
# authOptions (Ray token authentication on RayCluster, RayJob and RayService) came in KubeRay 1.5.1, and
# authOptions.secretName in 1.6.0; both need Ray 2.52 or newer on the pods.
KUBERAY_VERSION, KUBERAY_SECRET_VERSION = "1.5.1", "1.6.0"
JOB_LABEL = "draftopd/rayjob"  # on a RayJob's pods: KubeRay names its cluster NAME-xxxxx, so ray.io/cluster is unknown


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


def render_files(
    layout: Layout,
    command: str,
    stem: str,
    image: str,
    pvc: str = PVC,
    overrides: list[str] | None = None,
    auth_secret: str | None = None,
) -> dict[str, str]:
    """File name -> text: STEM-raycluster.yaml and STEM-rayjob.yaml, each headed by the command that renders it."""
    needs = f"KubeRay operator {KUBERAY_SECRET_VERSION if auth_secret else KUBERAY_VERSION} or newer"
    header = [
        f"Rendered by: {command}",
        f"{layout.recipe}: {layout.describe()}.",
        f"Needs the {needs} (authOptions: Ray token authentication), and a network plugin that enforces the "
        "NetworkPolicy below it.",
        "Re-render, do not edit.",
    ]
    cluster = render_raycluster(layout, image, pvc, auth_secret)
    job = render_rayjob(layout, image, pvc, overrides, auth_secret)
    return {
        f"{stem}-raycluster.yaml": dump_yaml(header, cluster, render_network_policy(layout, "RayCluster")),
        f"{stem}-rayjob.yaml": dump_yaml(header, job, render_network_policy(layout, "RayJob")),
    }
