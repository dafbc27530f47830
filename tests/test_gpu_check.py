"""The device check (scripts/gpu-check) runs on the device machine's package set, and its checks can fail.

The device machine has torch and transformers, and nothing of this project's other dependencies (no Ray,
DeepSpeed, MLflow, OmegaConf, vLLM, pyarrow, datasets, pandas, matplotlib). The test runs the check's quick
CPU mode in a Python that has only torch, transformers and what they require: site-packages is replaced by a
folder of links to those distributions (`python -S`), so everything else is absent the way an uninstalled
package is (no module, no metadata), not merely refused on import.
"""

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
ABSENT = (
    "ray",
    "deepspeed",
    "mlflow",
    "omegaconf",
    "vllm",
    "pyarrow",
    "datasets",
    "pandas",
    "matplotlib",
    "scipy",
    "sklearn",
)
SHIPPED_DRAFTERS = sorted(p.name for p in (ROOT / "draftopd" / "assets").iterdir() if p.name.startswith("toy-eagle3"))


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _required_closure(roots: list[str]) -> set[str]:
    """The installed distributions `roots` need, transitively (requirements without extras)."""
    seen, todo = set(), list(roots)
    while todo:
        name = _canon(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _site_packages_of(roots: list[str], into: Path) -> Path:
    """A folder of links to the site-packages entries of `roots` and their requirements, and nothing else."""
    dists = _required_closure(roots)
    modules = {m for m, ds in metadata.packages_distributions().items() if any(_canon(d) in dists for d in ds)}
    site = Path(metadata.distribution("torch").locate_file(""))
    into.mkdir()
    for entry in site.iterdir():
        is_meta = entry.name.endswith((".dist-info", ".egg-info"))
        if _canon(entry.name.split("-")[0]) in dists if is_meta else entry.name.split(".")[0] in modules:
            (into / entry.name).symlink_to(entry)
    return into


def _python(tmp_path: Path) -> tuple[list[str], dict]:
    site = _site_packages_of(["torch", "transformers"], tmp_path / "site")
    return [sys.executable, "-S"], {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"}


def test_the_restricted_python_has_torch_and_transformers_alone(tmp_path):
    python, env = _python(tmp_path)
    probe = f"import importlib.util as u; print([n for n in {ABSENT!r} if u.find_spec(n)]); import torch, transformers"
    out = subprocess.run([*python, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_quick_check_passes_with_torch_and_transformers_alone(tmp_path):
    python, env = _python(tmp_path)
    report = tmp_path / "gpu-check.json"
    cmd = [*python, str(ROOT / "scripts" / "gpu-check"), "--device", "cpu", "--quick", "--threads", "2"]
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


def test_a_parting_at_a_near_tie_is_followed_and_one_beyond_it_fails(monkeypatch):
    """bf16's rule: where the engine parts from the target alone, the target's two logits must be within the
    tolerance; the walk then runs the target alone on from the engine's token and checks the rest."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_identity as gci

    from draftopd.loading import eos_ids, load_target, load_tokenizer

    torch.set_num_threads(1)
    target, eos = load_target("toy", gci.AUX), eos_ids(load_tokenizer("toy"), "toy")
    prompt = gci.toy_prompts(1, arithmetic_only=True)[0]
    (ref,), _ = gci._decode(target, None, [prompt], 0, 16, eos, "cpu", 1)
    other = next(t for t in range(20, 400) if t not in eos and t != ref[3])
    (tail,), _ = gci._decode(target, None, [prompt + ref[:3] + [other]], 0, 12, eos, "cpu", 1)
    spec = ref[:3] + [other] + tail  # the target alone after one changed token: one parting, at position 3
    assert gci.bf16_spacing(6.0) == 2.0**-5 and gci.bf16_spacing(-0.75) == 2.0**-8
    monkeypatch.setattr(gci, "TIE_ULPS", 1e9)  # every parting a tie: followed to the end
    walk = gci._follow(target, prompt, ref, spec, eos, "cpu", 16)
    assert walk["lossless"] and [x["position"] for x in walk["partings"]] == [3]
    assert walk["partings"][0]["spec_token"] == other and walk["partings"][0]["target_margin"] > 0
    wrong_tail = spec[:5] + [t for t in range(30, 41) if t not in eos][: len(spec) - 5]
    walk = gci._follow(target, prompt, ref, wrong_tail, eos, "cpu", 16)  # past the tie: not the target's tokens
    assert len(walk["partings"]) >= 2 and walk["partings"][1]["position"] >= 5
    monkeypatch.setattr(gci, "TIE_ULPS", 0)  # nothing is a tie: the first parting fails
    walk = gci._follow(target, prompt, ref, spec, eos, "cpu", 16)
    assert not walk["lossless"] and len(walk["partings"]) == 1 and not walk["partings"][0]["near_tie"]


def test_a_lossy_verification_rule_fails_the_identity_check(monkeypatch):
    """With a rule that keeps every draft (lossy), the check reports a mismatch: it can fail."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_identity as gci

    from draftopd.engine import speculative

    def keep_every_draft(drafts, target_logits):
        return torch.full((drafts.shape[0],), drafts.shape[1]), target_logits[:, -1].argmax(-1)

    monkeypatch.setattr(speculative, "greedy_verify", keep_every_draft)
    torch.set_num_threads(1)
    case = [c for c in gci.drafter_cases() if c.name == "toy-eagle3"]
    checks = gci.check_dtype("float32", gci.toy_prompts(2, arithmetic_only=True), 24, "cpu", 2, case)
    assert not checks[1]["identical"] and not checks[1]["passed"] and checks[1]["first_mismatch"]["position"] >= 0
    checks = gci.check_dtype("bfloat16", gci.toy_prompts(2, arithmetic_only=True), 24, "cpu", 1, case)
    assert not checks[1]["passed"] and not checks[1]["partings"][-1]["near_tie"]  # bf16's tolerance does not hide it


def test_the_tracked_tree_travels_to_the_device_machine():
    """The device machine receives the tracked files: at most 64 MiB."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / f for f in files.decode().split("\0") if f]
    total = sum(p.stat().st_size for p in paths if p.is_file())
    assert total < 64 * 2**20, f"tracked files: {total / 2**20:.1f} MiB"
