"""The cluster launchers rendered from each recipe ask the cluster for what the recipe asks Ray for.

The expected numbers are worked out here from the recipe's own fields and its `cluster` section, not through
draftopd.cluster, so a slip in the renderer shows up as a disagreement.
"""

import copy
import re
import shlex
import shutil
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

from draftopd import cluster
from draftopd.cli import build_parser, main
from draftopd.cli.recipe_check import recipe_paths
from draftopd.config import load_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
OPD_RECIPES = [r for r in RECIPES if load_config(r).opd.enabled]
IMAGE = "registry.example.com/draftopd:test"
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _dockerfile_uid() -> int:
    users = re.findall(r"^USER\s+(\d+)", (REPO / "Dockerfile").read_text(), re.M)
    return int(users[-1])


def _expect(recipe: Path) -> dict:
    """Nodes, GPUs per node, GPUs and CPUs in all, and the largest actor, from the recipe alone."""
    cfg = load_config(recipe)
    r, lr = cfg.rollout, cfg.learner
    gpus = r.num_workers * r.num_gpus_per_worker + lr.num_learners * lr.num_gpus_per_learner
    cpus = r.num_workers * r.num_cpus_per_worker + lr.num_learners * lr.num_cpus_per_learner
    nodes, per_node = (cfg.cluster.nodes, cfg.cluster.gpus_per_node) if cfg.cluster.nodes else (1, 0)
    assert gpus <= nodes * per_node, f"{recipe.name}: its cluster section has fewer GPUs than its actors ask for"
    biggest = max(r.num_cpus_per_worker, lr.num_cpus_per_learner)
    return {"nodes": nodes, "gpus_per_node": per_node, "gpus": gpus, "cpus": cpus, "biggest_cpus": biggest}


def _render_kuberay(recipe: Path, out: Path, *extra: str) -> tuple[list[dict], list[dict]]:
    """The documents of the two files: [RayCluster, its NetworkPolicy] and [RayJob, its NetworkPolicy]."""
    assert main(["cluster", "kuberay", str(recipe), "--image", IMAGE, "--out", str(out), *extra]) in (0, None)
    docs = [
        list(yaml.safe_load_all((out / f"{recipe.stem}-{kind}.yaml").read_text())) for kind in ("raycluster", "rayjob")
    ]
    assert [[d["kind"] for d in file] for file in docs] == [
        ["RayCluster", "NetworkPolicy"],
        ["RayJob", "NetworkPolicy"],
    ]
    return docs[0], docs[1]


def _templates(spec: dict) -> list[dict]:
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def test_the_launchers_are_checked_on_gpu_and_cpu_only_recipes():
    assert {bool(_expect(r)["gpus"]) for r in OPD_RECIPES} == {True, False}


@pytest.mark.parametrize("recipe", OPD_RECIPES, ids=lambda p: p.stem)
def test_kuberay_manifests_follow_the_recipe(recipe, tmp_path):
    want = _expect(recipe)
    (ray_cluster, _), (ray_job, _) = _render_kuberay(recipe, tmp_path)
    assert (ray_cluster["apiVersion"], ray_cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (ray_job["apiVersion"], ray_job["kind"]) == ("ray.io/v1", "RayJob")
    spec = ray_cluster["spec"]
    # One layout, two ways to start it. They differ only in who reaches the dashboard (the auth test checks that).
    job_spec = copy.deepcopy(ray_job["spec"]["rayClusterSpec"])
    job_spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] = spec["headGroupSpec"]["rayStartParams"][
        "dashboard-host"
    ]
    for template in _templates(job_spec):
        del template["metadata"]
    assert job_spec == spec
    assert ray_job["spec"]["shutdownAfterJobFinishes"] is True
    for doc in (ray_cluster, ray_job):
        assert DNS_LABEL.match(doc["metadata"]["name"]) and len(doc["metadata"]["name"]) <= 50
    assert spec["rayVersion"] == "2.60.0"

    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no actor on the head: every GPU actor on a worker pod
    (group,) = spec["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == want["nodes"]
    params = group["rayStartParams"]
    (worker,) = group["template"]["spec"]["containers"]
    limits, requests = worker["resources"]["limits"], worker["resources"]["requests"]
    assert limits == requests
    cpus = limits["cpu"]
    assert params["num-cpus"] == str(cpus)
    assert cpus >= want["biggest_cpus"] + 1 and cpus * want["nodes"] >= want["cpus"] + want["nodes"]
    if want["gpus"]:
        assert limits["nvidia.com/gpu"] == want["gpus_per_node"] == int(params["num-gpus"])
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in group["template"]["spec"][
            "tolerations"
        ]
    else:
        assert "nvidia.com/gpu" not in limits and "num-gpus" not in params

    uid = _dockerfile_uid()
    for pod in (head["template"]["spec"], group["template"]["spec"]):
        assert pod["securityContext"]["runAsUser"] == uid
        (container,) = pod["containers"]
        assert container["image"] == IMAGE
        assert container["workingDir"] == "/home/draftopd"  # where the image keeps recipes/
        assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims == ["draftopd-data"]

    job = shlex.split(ray_job["spec"]["entrypoint"])
    assert job == ["draftopd", "train", f"recipes/{recipe.name}", "run.out_dir=/data/runs"]


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the evaluator below knows matchLabels only
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _admits(policy: dict, to: dict, port: int, frm: dict, same_namespace: bool = True) -> bool:
    """Whether `policy` lets a pod labelled `frm` reach `port` (TCP) on a pod labelled `to`, by Kubernetes' rules:
    a pod no policy selects takes anything; a selected one takes what some ingress rule admits, a rule admitting
    its peers on its ports (all ports when it names none). A peer's podSelector alone means the policy's own
    namespace; with a namespaceSelector, {} means any namespace."""
    spec = policy["spec"]
    if not _selects(spec["podSelector"], to) or "Ingress" not in spec["policyTypes"]:
        return True
    for rule in spec.get("ingress", []):
        assert rule.get("from"), "a rule without `from` admits every source"
        if "ports" in rule and not any(p["port"] == port and p["protocol"] == "TCP" for p in rule["ports"]):
            continue
        for peer in rule["from"]:
            assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
            namespace_ok = _selects(peer["namespaceSelector"], {}) if "namespaceSelector" in peer else same_namespace
            if namespace_ok and _selects(peer.get("podSelector", {}), frm):
                return True
    return False


def _pod_labels(template: dict, cluster_name: str, node_type: str) -> dict:
    """The labels KubeRay gives a Ray pod: its own, then the template's."""
    return {"ray.io/cluster": cluster_name, "ray.io/node-type": node_type, "app.kubernetes.io/name": "kuberay"} | (
        template.get("metadata", {}).get("labels", {})
    )


def test_kuberay_clusters_take_jobs_only_with_the_token(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "sentinel-token-value")  # never copied into a rendered file
    (ray_cluster, cluster_policy), (ray_job, job_policy) = _render_kuberay(REPO / "recipes/qwen3-8b.yaml", tmp_path)
    texts = [p.read_text() for p in tmp_path.iterdir()]
    assert len(texts) == 2 and not any("sentinel-token-value" in t or "RAY_AUTH" in t for t in texts)
    assert all("KubeRay operator 1.5.1 or newer" in t for t in texts)  # the first with authOptions
    name = ray_cluster["metadata"]["name"]
    for spec in (ray_cluster["spec"], ray_job["spec"]["rayClusterSpec"]):
        assert spec["authOptions"] == {"mode": "token"}  # KubeRay makes the Secret and hands the token around
        assert tuple(int(x) for x in spec["rayVersion"].split(".")[:2]) >= (2, 52)  # Ray's token authentication
        for template in _templates(spec):
            for container in template["spec"]["containers"]:
                assert not any(e["name"].startswith("RAY_AUTH") for e in container["env"])
    head = ray_cluster["spec"]["headGroupSpec"]
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert sorted(ports) == ["client", "dashboard", "gcs-server"]

    # The long-lived cluster: its dashboard on the head's loopback (kubectl port-forward reaches it there), and
    # every pod of it reachable from its own pods alone.
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    cluster_head = _pod_labels(head["template"], name, "head")
    cluster_worker = _pod_labels(ray_cluster["spec"]["workerGroupSpecs"][0]["template"], name, "worker")
    other = {"ray.io/cluster": "draftopd-other", "ray.io/node-type": "worker"}
    notebook = {"app": "notebook"}
    for port in ports.values():
        assert _admits(cluster_policy, cluster_head, port, cluster_worker)
        assert not _admits(cluster_policy, cluster_head, port, other)
        assert not _admits(cluster_policy, cluster_head, port, notebook)
    assert not _admits(cluster_policy, cluster_worker, 52365, notebook)  # the workers' job agents too

    # The RayJob's cluster is named NAME-xxxxx by KubeRay, so its policy selects a label of the pod templates.
    job_spec = ray_job["spec"]["rayClusterSpec"]
    assert job_spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"  # the submitter, the operator
    job_head = _pod_labels(job_spec["headGroupSpec"]["template"], f"{name}-x7k2p", "head")
    job_worker = _pod_labels(job_spec["workerGroupSpecs"][0]["template"], f"{name}-x7k2p", "worker")
    submitter = {"batch.kubernetes.io/job-name": name, "job-name": name}  # Kubernetes labels a Job's pods so
    operator = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/component": "kuberay-operator"}
    for port in ports.values():
        assert _admits(job_policy, job_head, port, job_worker)
        assert _admits(job_policy, job_head, port, submitter) == (port == ports["dashboard"])
        assert _admits(job_policy, job_head, port, operator, same_namespace=False) == (port == ports["dashboard"])
        for stranger in (other, notebook, cluster_worker):
            assert not _admits(job_policy, job_head, port, stranger)
    assert _admits(job_policy, job_worker, 52365, job_head) and not _admits(job_policy, job_worker, 52365, notebook)


def test_kuberay_takes_a_secret_of_the_users(tmp_path):
    (ray_cluster, _), (ray_job, _) = _render_kuberay(
        REPO / "recipes/toy-opd.yaml", tmp_path, "--auth-secret", "my-token"
    )
    for spec in (ray_cluster["spec"], ray_job["spec"]["rayClusterSpec"]):
        assert spec["authOptions"] == {"mode": "token", "secretName": "my-token"}
    assert "KubeRay operator 1.6.0 or newer" in (tmp_path / "toy-opd-rayjob.yaml").read_text()  # secretName's


def test_the_volume_claim_the_manifests_mount_is_shipped():
    pvc = yaml.safe_load((REPO / "cluster/kuberay/data-pvc.yaml").read_text())
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["metadata"]["name"] == cluster.PVC
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # learners and the driver share checkpoints


def _sbatch_options(text: str) -> dict:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", text, re.M))


@pytest.mark.parametrize("recipe", OPD_RECIPES, ids=lambda p: p.stem)
def test_slurm_script_follows_the_recipe(recipe, tmp_path):
    want = _expect(recipe)
    assert main(["cluster", "slurm", str(recipe), "--out", str(tmp_path)]) in (0, None)
    script = tmp_path / f"{recipe.stem}.sbatch"
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    options = _sbatch_options(text)
    assert options["nodes"] == str(want["nodes"]) and options["ntasks-per-node"] == "1"
    cpus = int(options["cpus-per-task"])
    assert cpus >= want["biggest_cpus"] + 1 and cpus * want["nodes"] >= want["cpus"] + want["nodes"]
    if want["gpus"]:
        assert options["gpus-per-node"] == str(want["gpus_per_node"])
    else:
        assert "gpus-per-node" not in options
    assert re.search(rf"^RECIPE=recipes/{re.escape(recipe.name)}$", text, re.M)
    assert re.search(rf"^GPUS={want['gpus_per_node']}$", text, re.M)
    driver = [line for line in text.splitlines() if "draftopd train" in line and not line.startswith("#")]
    assert driver == ['on_node "$HEAD" draftopd train "$RECIPE" ray.address="$ADDRESS" run.out_dir="$RUNS_DIR" "$@"']


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_slurm_scripts_pass_shellcheck(tmp_path):
    scripts = []
    for recipe in OPD_RECIPES:
        main(["cluster", "slurm", str(recipe), "--out", str(tmp_path)])
        scripts.append(str(tmp_path / f"{recipe.stem}.sbatch"))
    scripts += [str(p) for p in (REPO / "cluster/slurm").glob("*.sbatch")]
    done = subprocess.run(["shellcheck", "--shell=bash", *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("recipe", OPD_RECIPES, ids=lambda p: p.stem)
def test_submit_line_runs_the_recipe(recipe, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "a token"))
    # paths not in this checkout are on the cluster's storage (submit refuses them otherwise)
    sets = [f"{k}=/data/{k}" for k, v in recipe_paths(load_config(recipe)).items() if not Path(v).exists()]
    argv = ["cluster", "submit", str(recipe), "--address", "http://10.0.0.1:8265", "--runs-dir", "/shared/runs"]
    main([*argv, *(w for item in sets for w in ("--set", item))])
    comment, token, line = capsys.readouterr().out.strip().splitlines()
    words = shlex.split(line)
    assert words[:2] == ["RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN_PATH={tmp_path / 'a token'}"]
    assert line.startswith(f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={shlex.quote(str(tmp_path / 'a token'))} ray ")
    assert words[2:7] == ["ray", "job", "submit", "--address", "http://10.0.0.1:8265"]
    job = ["draftopd", "train", f"recipes/{recipe.name}", "run.out_dir=/shared/runs", *sets]
    assert words[words.index("--") + 1 :] == job
    assert f"{_expect(recipe)['gpus']:g} GPUs" in comment and "$RAY_AUTH_TOKEN_PATH" in token


def test_submit_line_never_holds_the_token(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    monkeypatch.setenv("RAY_AUTH_TOKEN", "sentinel-token-value")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/elsewhere")  # Ray prefers $RAY_AUTH_TOKEN: the line leaves the path out
    main(["cluster", "submit", str(REPO / "recipes/toy-opd.yaml")])
    out = capsys.readouterr().out
    assert "sentinel-token-value" not in out and "RAY_AUTH_TOKEN_PATH" not in out.splitlines()[-1]
    assert shlex.split(out.splitlines()[-1])[:3] == ["RAY_AUTH_MODE=token", "ray", "job"]
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    main(["cluster", "submit", str(REPO / "recipes/toy-opd.yaml")])
    assert "# Ray token: none found: set RAY_AUTH_TOKEN_PATH" in capsys.readouterr().out


def test_overrides_reach_the_layout_and_the_job(tmp_path):
    toy = REPO / "recipes/toy-opd.yaml"
    sets = ["--set", "rollout.num_gpus_per_worker=1", "--set", "rollout.num_workers=6", "--set", "target.path=/m x"]
    (ray_cluster, _), (ray_job, _) = _render_kuberay(toy, tmp_path, "--gpus-per-node", "4", *sets)
    (group,) = ray_cluster["spec"]["workerGroupSpecs"]
    assert (
        group["replicas"] == 2
        and group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    )
    assert shlex.split(ray_job["spec"]["entrypoint"])[-1] == "target.path=/m x"
    main(["cluster", "slurm", str(toy), "--out", str(tmp_path), *sets, "--gpus-per-node", "4"])
    text = (tmp_path / "toy-opd.sbatch").read_text()
    assert _sbatch_options(text)["nodes"] == "2"
    assert "rollout.num_workers=6 'target.path=/m x' \"$@\"" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["recipes/toy-sft.yaml"], "SFT-only"),
        (["recipes/toy-opd.yaml", "--set", "rollout.num_gpus_per_worker=1"], "--gpus-per-node"),
        (["recipes/toy-opd.yaml", "--set", "rollout.num_gpus_per_worker=2", "--gpus-per-node", "1"], "a node has 1"),
        (["recipes/toy-opd.yaml", "--cpus-per-node", "1"], "too few"),
        (["recipes/toy-opd.yaml", "--set", "rollout.num_workerz=1"], "rollout.num_workers"),
    ],
)
def test_a_layout_that_cannot_work_is_refused(args, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["cluster", "slurm", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_cluster_section_with_too_few_gpus_is_refused(tmp_path, capsys):
    recipe = tmp_path / "big.yaml"
    recipe.write_text(
        "cluster: {nodes: 1, gpus_per_node: 2}\n"
        "rollout: {num_workers: 3, num_gpus_per_worker: 1}\nopd: {enabled: true}\n"
    )
    assert main(["cluster", "kuberay", str(recipe), "--image", IMAGE]) == 2
    assert "do not fit on 1 node(s) of 2 GPUs" in capsys.readouterr().err


def test_the_cluster_section_gives_the_nodes(tmp_path):
    recipe = tmp_path / "big.yaml"
    recipe.write_text("rollout: {num_workers: 5, num_gpus_per_worker: 1}\nopd: {enabled: true}\n")
    layout = cluster.plan(recipe, overrides=["cluster.nodes=3", "cluster.gpus_per_node=2", "cluster.gpu=L4"])
    assert (layout.num_nodes, layout.gpus_per_node, layout.gpu_type) == (3, 2, "L4")
    assert cluster.plan(recipe, overrides=["cluster.gpus_per_node=4"]).num_nodes == 2  # as many as the actors need
    flag = cluster.plan(recipe, gpus_per_node=1, overrides=["cluster.nodes=3", "cluster.gpu=L4"])
    assert (flag.num_nodes, flag.gpus_per_node, flag.gpu_type) == (5, 1, "")  # the flag wins over the section


def test_the_slurm_template_ships_with_the_package():
    """A wheel holds the SLURM template: every file of draftopd/cluster/ besides the modules is package data."""
    section = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.package-data]", 1)[1]
    patterns = re.findall(r'"([^"]+)"', re.search(r"^draftopd = \[(.*)\]$", section, re.M).group(1))
    data = [p.relative_to(REPO / "draftopd").as_posix() for p in (REPO / "draftopd/cluster").iterdir()]
    data = [p for p in data if not p.endswith(".py") and "__pycache__" not in p]
    assert data == ["cluster/slurm.sbatch"]
    assert all(any(fnmatch(p, pattern) for pattern in patterns) for p in data), patterns


def test_kuberay_needs_an_image(capsys):
    assert main(["cluster", "kuberay", str(REPO / "recipes/toy-opd.yaml")]) == 2
    assert "--image" in capsys.readouterr().err


def _committed() -> list[Path]:
    return sorted(p for p in (REPO / "cluster").rglob("*") if p.suffix in (".yaml", ".sbatch") and p.is_file())


def test_committed_examples_equal_a_fresh_render(monkeypatch):
    monkeypatch.chdir(REPO)  # the recorded commands name the recipe and the output folder from the root
    rendered = [p for p in _committed() if "Rendered by: " in p.read_text()]
    kinds = {p.suffix for p in rendered} | {
        doc["kind"] for p in rendered if p.suffix == ".yaml" for doc in yaml.safe_load_all(p.read_text())
    }
    assert {".sbatch", "RayJob", "RayCluster", "NetworkPolicy"} <= kinds
    for path in rendered:
        (command,) = re.findall(r"^# Rendered by: (.+)$", path.read_text(), re.M)
        words = shlex.split(command)
        assert words[0] == "draftopd" and words[words.index("--out") + 1] == path.parent.relative_to(REPO).as_posix()
        args = build_parser().parse_args(words[1:])
        (recipe,) = args.recipes
        fresh = cluster.render(args, recipe)
        assert fresh[path.name] == path.read_text(), f"{path} is stale: run `{command}`"


def test_the_cluster_guides_layout_table_matches_the_recipes():
    section = (REPO / "docs" / "cluster.md").read_text()
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1:]
    for recipe in OPD_RECIPES:
        if recipe.stem not in rows:
            assert not load_config(recipe).cluster.nodes, f"docs/cluster.md's layout table lacks {recipe.stem}"
            continue
        cfg, want = load_config(recipe), _expect(recipe)
        layout = cluster.plan(recipe)
        r, lr = cfg.rollout, cfg.learner
        gpu = f" {layout.gpu_type}" if layout.gpu_type else " (CPU only)"
        assert rows[recipe.stem] == [
            f"{want['nodes']} x {want['gpus_per_node']}{gpu}",
            f"{r.num_workers} x {r.num_gpus_per_worker:g} GPU, {r.num_cpus_per_worker:g} CPU",
            f"{lr.num_learners} x {lr.num_gpus_per_learner:g} GPU, {lr.num_cpus_per_learner:g} CPU",
            str(layout.cpus_per_node),
            f"{layout.memory_gb_per_node} GiB",
        ], recipe.stem
