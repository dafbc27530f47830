"""The cluster launchers rendered from each recipe ask the cluster for what the recipe asks Ray for.

The expected numbers are worked out here from the recipe's own fields and its `# layout:` line, not through
draftopd.cluster, so a slip in the renderer shows up as a disagreement.
"""

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from draftopd import cluster
from draftopd.cli import build_parser, main
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
    m = re.search(r"^#\s*layout:\s*nodes=(\d+)\s+gpus_per_node=(\d+)", recipe.read_text(), re.M)
    nodes, per_node = (int(m.group(1)), int(m.group(2))) if m else (1, 0)
    assert gpus <= nodes * per_node, f"{recipe.name}: its layout line has fewer GPUs than its actors ask for"
    biggest = max(r.num_cpus_per_worker, lr.num_cpus_per_learner)
    return {"nodes": nodes, "gpus_per_node": per_node, "gpus": gpus, "cpus": cpus, "biggest_cpus": biggest}


def _render_kuberay(recipe: Path, out: Path, *extra: str) -> tuple[dict, dict]:
    assert main(["cluster", "kuberay", str(recipe), "--image", IMAGE, "--out", str(out), *extra]) in (0, None)
    name = recipe.stem
    ray_cluster = yaml.safe_load((out / f"{name}-raycluster.yaml").read_text())
    ray_job = yaml.safe_load((out / f"{name}-rayjob.yaml").read_text())
    return ray_cluster, ray_job


def test_every_opd_recipe_is_covered():
    assert OPD_RECIPES, "no Draft-OPD recipe in recipes/"
    assert any(_expect(r)["gpus"] for r in OPD_RECIPES) or len(OPD_RECIPES) == 1


@pytest.mark.parametrize("recipe", OPD_RECIPES, ids=lambda p: p.stem)
def test_kuberay_manifests_follow_the_recipe(recipe, tmp_path):
    want = _expect(recipe)
    ray_cluster, ray_job = _render_kuberay(recipe, tmp_path)
    assert (ray_cluster["apiVersion"], ray_cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (ray_job["apiVersion"], ray_job["kind"]) == ("ray.io/v1", "RayJob")
    spec = ray_cluster["spec"]
    assert ray_job["spec"]["rayClusterSpec"] == spec  # one layout, two ways to start it
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
def test_submit_line_runs_the_recipe(recipe, capsys):
    main(["cluster", "submit", str(recipe), "--address", "http://10.0.0.1:8265", "--runs-dir", "/shared/runs"])
    comment, line = capsys.readouterr().out.strip().splitlines()
    words = shlex.split(line)
    assert words[:5] == ["ray", "job", "submit", "--address", "http://10.0.0.1:8265"]
    assert words[words.index("--") + 1 :] == ["draftopd", "train", f"recipes/{recipe.name}", "run.out_dir=/shared/runs"]
    assert f"{_expect(recipe)['gpus']:g} GPUs" in comment


def test_overrides_reach_the_layout_and_the_job(tmp_path):
    toy = REPO / "recipes/toy-opd.yaml"
    sets = ["--set", "rollout.num_gpus_per_worker=1", "--set", "rollout.num_workers=6", "--set", "target.path=/m x"]
    ray_cluster, ray_job = _render_kuberay(toy, tmp_path, "--gpus-per-node", "4", *sets)
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


def test_a_layout_line_with_too_few_gpus_is_refused(tmp_path, capsys):
    recipe = tmp_path / "big.yaml"
    recipe.write_text(
        "# layout: nodes=1 gpus_per_node=2\nrollout: {num_workers: 3, num_gpus_per_worker: 1}\nopd: {enabled: true}\n"
    )
    assert main(["cluster", "kuberay", str(recipe), "--image", IMAGE]) == 2
    assert "do not fit on 1 node(s) of 2 GPUs" in capsys.readouterr().err


def test_kuberay_needs_an_image(capsys):
    assert main(["cluster", "kuberay", str(REPO / "recipes/toy-opd.yaml")]) == 2
    assert "--image" in capsys.readouterr().err


def _committed() -> list[Path]:
    return sorted(p for p in (REPO / "cluster").rglob("*") if p.suffix in (".yaml", ".sbatch") and p.is_file())


def test_committed_examples_equal_a_fresh_render(monkeypatch):
    monkeypatch.chdir(REPO)  # the recorded commands name the recipe and the output folder from the root
    rendered = [p for p in _committed() if "Rendered by: " in p.read_text()]
    kinds = {p.suffix for p in rendered} | {
        yaml.safe_load(p.read_text())["kind"] for p in rendered if p.suffix == ".yaml"
    }
    assert {".sbatch", "RayJob", "RayCluster"} <= kinds
    for path in rendered:
        (command,) = re.findall(r"^# Rendered by: (.+)$", path.read_text(), re.M)
        words = shlex.split(command)
        assert words[0] == "draftopd" and words[words.index("--out") + 1] == path.parent.relative_to(REPO).as_posix()
        args = build_parser().parse_args(words[1:])
        (recipe,) = args.recipes
        fresh = cluster.render(args, recipe)
        assert fresh[path.name] == path.read_text(), f"{path} is stale: run `{command}`"


def test_readme_layout_table_matches_the_recipes():
    section = (REPO / "README.md").read_text().split("## Running on a cluster", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1:]
    for recipe in OPD_RECIPES:
        if recipe.stem not in rows:
            assert "layout:" not in recipe.read_text(), f"README's cluster table lacks {recipe.stem}"
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
