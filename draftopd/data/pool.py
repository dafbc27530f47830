"""A prepared pool on disk (what `draftopd prepare-data` writes): shards, held-out prompts, manifest.

Writing is atomic per file (a temporary name, then a rename), so a shard or a
manifest on disk is always whole. Reading serves recipes: `data.prompts` takes
the training prompts, `data.eval_prompts` the held-out ones, and the SFT
pipeline the regenerated responses, when the pool was made for its target and
template.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from draftopd.data.io import PrepareError, read_rows

MANIFEST = "manifest.json"
HELDOUT = "heldout.jsonl"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


def write_json(path: Path, obj) -> None:
    _write_atomic(path, lambda p: p.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8"))


def write_rows(path: Path, rows: list[dict]) -> None:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        _write_atomic(path, lambda p: pq.write_table(pa.Table.from_pylist(rows), p))
    else:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        _write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))


def shard_name(index: int, fmt: str) -> str:
    return f"train-{index:05d}.{fmt}"


def is_pool(spec: str | Path) -> bool:
    return Path(spec).is_dir() and (Path(spec) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict:
    p = Path(path)
    if not is_pool(p):
        raise PrepareError(f"{p} is not a prepared pool (no {MANIFEST}); make one with draftopd prepare-data")
    manifest = json.loads((p / MANIFEST).read_text(encoding="utf-8"))
    if not manifest.get("complete"):
        raise PrepareError(
            f"the pool in {p} is incomplete; rerun draftopd prepare-data with the same flags to finish it"
        )
    return manifest


def pool_rows(path: str | Path, split: str) -> list[dict]:
    """Rows of the `train` shards, in order, or of the held-out file (any other split name)."""
    p = Path(path)
    manifest = read_manifest(p)
    if split != "train":
        return read_rows(p / manifest["heldout"]["file"])
    return [row for sh in manifest["shards"] for row in read_rows(p / sh["file"])]


def pool_prompts(path: str | Path, split: str) -> list[list[dict]]:
    chats = [row["messages"] for row in pool_rows(path, split)]
    if not chats:
        raise PrepareError(f"the pool in {path} has no {split} prompts")
    return chats


def pool_trajectories(path: str, target: str, enable_thinking: bool, limit: int):
    """The pool's regenerated responses as trajectories, or None when `path` is not a pool made for this
    target and template (the caller then has the target answer the prompts itself)."""
    from draftopd.loading import resolve_target_path
    from draftopd.messages import Trajectory

    if not is_pool(path):
        return None
    manifest = read_manifest(path)
    same_target = manifest["target"] == str(resolve_target_path(target).resolve())
    if not same_target or manifest["template"]["enable_thinking"] != enable_thinking:
        print(f"{path} was made for another target or template: the target answers its prompts anew")
        return None
    gen = manifest["generation"]
    print(f"using the responses in {path} ({gen['backend']}, temperature {gen['temperature']})")
    rows = pool_rows(path, "train")[:limit]
    return [
        Trajectory(list(r["input_ids"][: r["prompt_len"]]), list(r["input_ids"][r["prompt_len"] :]), prompt_index=i)
        for i, r in enumerate(rows)
    ]
