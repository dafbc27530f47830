"""The device check (scripts/gpu-check) runs on the device machine's package set, and its checks can fail.

The device machine has torch and transformers but no Ray, DeepSpeed, MLflow, OmegaConf, vLLM, pyarrow,
datasets, pandas or matplotlib. The test runs the check's quick CPU mode in a Python that lacks exactly
those: site-packages is replaced by a folder of links to everything else in it (`python -S`), so they are
absent the way an uninstalled package is (no module, no metadata), not merely refused on import.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABSENT = ("ray", "deepspeed", "mlflow", "omegaconf", "antlr4", "vllm", "pyarrow", "datasets", "pandas", "matplotlib")
SHIPPED_DRAFTERS = sorted(p.name for p in (ROOT / "draftopd" / "assets").iterdir() if p.name.startswith("toy-eagle3"))


def _site_packages_without(absent: tuple[str, ...], into: Path) -> Path:
    """A folder of links to this environment's site-packages entries, less the `absent` distributions."""
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    into.mkdir()
    for entry in site.iterdir():
        name = entry.name.split("-")[0].split(".")[0].lower()
        if name.startswith(absent) or entry.suffix == ".pth":
            continue
        (into / entry.name).symlink_to(entry)
    return into


def _python(tmp_path: Path) -> tuple[list[str], dict]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{_site_packages_without(ABSENT, tmp_path / 'site')}"}
    return [sys.executable, "-S"], env


def test_the_restricted_python_lacks_the_absent_packages(tmp_path):
    python, env = _python(tmp_path)
    probe = f"import importlib.util as u; print([n for n in {ABSENT!r} if u.find_spec(n)]); import torch, transformers"
    out = subprocess.run([*python, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_quick_check_passes_without_ray_deepspeed_mlflow_omegaconf(tmp_path):
    python, env = _python(tmp_path)
    report = tmp_path / "gpu-check.json"
    cmd = [*python, str(ROOT / "scripts" / "gpu-check"), "--device", "cpu", "--quick", "--threads", "1"]
    out = subprocess.run(
        [*cmd, "--out", str(report)], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["exit_status"] == 0 and {"environment", "sections", "total_seconds"} <= r.keys()
    assert {"torch", "transformers", "device_name"} <= r["environment"].keys()
    ident = r["sections"]["identity"]
    drafted = [c for c in ident["checks"] if "identical" in c]
    assert ident["ok"] and drafted and all(c["identical"] and c["tokens"] > 0 for c in drafted)
    for dtype in ("float32", "bfloat16"):
        names = {c["drafter"] for c in drafted if c["dtype"] == dtype}
        assert set(SHIPPED_DRAFTERS) <= names and {"dflash (random)", "d2sd (random)", "pard (toy draft LM)"} <= names
    learner = r["sections"]["learner"]
    for step in ("sft", "opd"):
        assert learner[step]["ok"] and learner[step]["weights_changed"] and learner[step]["skipped_nonfinite"] == 0
    mem = r["sections"]["memory"]
    assert mem["ok"] and mem["saved_activation_gib"] > 0
    if mem["plan"]["available"]:  # the planner's figure at the same shape: the seam passes the shape right
        assert 0.8 <= mem["plan"]["measured_over_plan"] <= 1.2, mem["plan"]
    assert all("seconds" in s for s in r["sections"].values())


def test_a_different_output_is_reported_with_the_targets_margin():
    """The identity check's comparison finds the first differing token and prices it by the target's logits."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check_identity import AUX, _first_mismatch

    from draftopd.loading import load_target

    target = load_target("toy", AUX)
    prompt, ref = [1, 10, 20], [30, 40, 50]
    assert _first_mismatch(target, [prompt], [ref], [list(ref)], "cpu") is None
    got = _first_mismatch(target, [prompt], [ref], [[30, 41, 50]], "cpu")
    assert got["position"] == 1 and got["target_token"] == 40 and got["spec_token"] == 41
    assert isinstance(got["target_margin"], float)
    assert _first_mismatch(target, [prompt], [ref], [ref[:2]], "cpu")["spec_len"] == 2


def test_the_tracked_tree_travels_to_the_device_machine():
    """The device machine receives the tracked files: at most 64 MiB."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / f for f in files.decode().split("\0") if f]
    total = sum(p.stat().st_size for p in paths if p.is_file())
    assert total < 64 * 2**20, f"tracked files: {total / 2**20:.1f} MiB"
