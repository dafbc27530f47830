"""Reports as strict JSON: JSON has no NaN or infinity, and its readers choke on them, so every report, status
body and bench result draftopd writes goes through `finite` first. Below every room that writes one (the
command line, the server, the benches), so none of them reaches up into another for it."""

from __future__ import annotations

import json
import math
from pathlib import Path


def finite(obj):
    """`obj` with every NaN or infinite float replaced by None (dicts, lists and tuples walked)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path: Path, obj) -> None:
    """A report as strict JSON (non-finite floats as null), its folder made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(obj), indent=2, allow_nan=False) + "\n")
