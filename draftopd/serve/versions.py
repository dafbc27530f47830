"""VersionStore: the drafter versions a serving session promoted, on disk, for rollback and restart.

`run_dir/versions/v{N}/` is a drafter directory (`save_drafter`: config.json + model.safetensors, loadable by
`load_drafter` and servable by vLLM) plus `evidence.json`, the guard's verdict that promoted it (or why it is
there: the starting drafter, a rollback). Only the newest `keep` versions stay; the version numbers only grow.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from draftopd.drafters import load_drafter, save_drafter

_NAME = re.compile(r"^v(\d+)$")


class VersionStore:
    def __init__(self, run_dir: str | Path, keep: int = 5):
        if keep < 2:
            raise ValueError(f"keep ({keep}) must be at least 2: a rollback needs the previous version")
        self.root = Path(run_dir) / "versions"
        self.keep = keep

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def save(self, drafter, version: int, evidence: dict) -> Path:
        """Write version `version` (a temporary folder renamed into place, so a crash leaves no half version),
        then prune to the newest `keep`."""
        out, tmp = self.path(version), self.root / f".v{version}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        save_drafter(drafter, tmp)
        (tmp / "evidence.json").write_text(json.dumps({"version": version, **evidence}, indent=2, default=str) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        self._prune()
        return out

    def list(self) -> list[tuple[int, Path]]:
        """(version, directory) of every saved version, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return [(v, self.path(v)) for v in sorted(int(m.group(1)) for m in found if m)]

    def latest(self) -> tuple[int, Path] | None:
        versions = self.list()
        return versions[-1] if versions else None

    def previous(self, version: int) -> tuple[int, Path] | None:
        """The newest saved version before `version` (what a rollback from it restores)."""
        older = [item for item in self.list() if item[0] < version]
        return older[-1] if older else None

    def evidence(self, version: int) -> dict:
        return json.loads((self.path(version) / "evidence.json").read_text())

    def load(self, version: int, target, kind: str = ""):
        return load_drafter(self.path(version), target, kind)

    def _prune(self) -> None:
        for v, _ in self.list()[: -self.keep]:
            shutil.rmtree(self.path(v), ignore_errors=True)
