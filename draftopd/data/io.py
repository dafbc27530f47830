"""Reading data from disk: row readers, the local Hugging Face datasets cache, and the data errors.

Every other module of `data/` builds on this one and it imports none of them,
so readers and errors have one home. A file is read by its name: JSONL (also
gzipped), a JSON list, parquet, or an Arrow file. A cached Hugging Face data
set is read through the `datasets` library in offline mode, with its
repository, config and split named: a cache that lacks the config or the split
is an error naming what it holds, never a guess.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class DataError(ValueError):
    """Data that cannot be found or read, with the place that was tried."""


class PromptError(DataError):
    """A prompt file or line that cannot be used, with its location in the message."""


class PrepareError(PromptError):  # a PromptError too: callers that report bad prompt input report these alike
    """A source, mix or output folder that cannot be used, with what was tried."""


class EvalSetError(DataError):
    """A set that cannot be found or read, with the place that was tried."""


class Malformed(ValueError):
    """A row its layout cannot turn into a chat (counted per source, not fatal by itself)."""


CACHE_METADATA = {"dataset_info.json", "state.json", "dataset_dict.json"}  # files of a datasets cache, not data


def read_rows(path: Path) -> list[dict]:
    """Rows of one file in any of the supported formats."""
    name = path.name
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if name.endswith(".arrow"):
        import pyarrow as pa

        with pa.memory_map(str(path)) as source:
            try:
                return pa.ipc.open_stream(source).read_all().to_pylist()  # the datasets cache writes streams
            except pa.ArrowInvalid:
                return pa.ipc.open_file(source).read_all().to_pylist()
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if ".jsonl" in name:
            return [json.loads(line) for line in f if line.strip()]
        data = json.load(f)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of rows")
    return data


def file_rows(path: Path) -> Iterator[tuple[str, object]]:
    """(location, row) of every row; a JSONL line that is not JSON comes as a `Malformed` row, not an error.
    A JSON file holding one object is one row (the MATH tree: one problem per file)."""
    name = path.name
    if ".jsonl" in name:
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"{path}:{n}", json.loads(line)
                    except json.JSONDecodeError as exc:
                        yield f"{path}:{n}", Malformed(f"not valid JSON ({exc.msg})")
        return
    if name.endswith(".json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            yield str(path), data
            return
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of rows or one JSON object")
    else:
        data = read_rows(path)  # parquet, Arrow, gzipped JSON
    for i, row in enumerate(data):
        yield f"{path}[{i}]", row


def published_files(root: Path, patterns: tuple[str, ...]) -> list[Path]:
    """Files under `root` matching the first of `patterns` (glob, in order of preference) that matches any."""
    for pattern in patterns:
        hits = sorted(p for p in root.rglob(pattern) if p.is_file() and p.name not in CACHE_METADATA)
        if hits:
            return hits
    return []


def hf_cache_root() -> Path:
    """The local Hugging Face datasets cache: `HF_DATASETS_CACHE`, else `$HF_HOME/datasets`."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"])
    hf_home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    return Path(hf_home) / "datasets"


def cache_folder(repo: str) -> str:
    """The folder of repository `repo` in a datasets cache, named as the `datasets` library names it."""
    from datasets.naming import camelcase_to_snakecase

    *namespace, name = repo.split("/")
    return "___".join([*namespace, camelcase_to_snakecase(name)])


@contextmanager
def _offline() -> Iterator[None]:
    """`datasets` offline for the duration: the cache only, no request to the hub. Its notes that the hub
    was not reached and that the cached version is used are silenced: that is the point."""
    import datasets

    saved_env, saved_flag = os.environ.get("HF_DATASETS_OFFLINE"), datasets.config.HF_HUB_OFFLINE
    saved_verbosity = datasets.logging.get_verbosity()
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    datasets.config.HF_HUB_OFFLINE = True  # the library reads the variable once, at its import
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(saved_verbosity)
        datasets.config.HF_HUB_OFFLINE = saved_flag
        if saved_env is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = saved_env


def _load(repo: str, config: str, split: str | None, cache_dir: Path):
    import datasets

    with _offline():
        return datasets.load_dataset(repo, name=config, split=split, cache_dir=str(cache_dir))


@dataclass(frozen=True)
class CachedSplit:
    """One split of one config of a data set in a local datasets cache, known to be there."""

    repo: str
    config: str
    split: str
    cache_dir: Path

    def __str__(self) -> str:
        return f"{self.repo} (config {self.config}, split {self.split}) in the datasets cache {self.cache_dir}"

    def rows(self) -> Iterator[tuple[str, object]]:
        """(location, row) of every row, as `file_rows` gives them for a file."""
        for i, row in enumerate(_load(self.repo, self.config, self.split, self.cache_dir)):
            yield f"{self}[{i}]", row


def cached_split(repo: str, config: str, split: str, cache_dir: Path) -> CachedSplit | None:
    """Split `split` of `repo`'s config `config` in the datasets cache at `cache_dir`; None if the cache holds
    nothing of `repo`, a `DataError` naming what it holds if the config or the split is not there."""
    folder = cache_dir / cache_folder(repo)
    if not folder.is_dir():
        return None
    configs = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if config not in configs:
        raise DataError(
            f"{repo} in the datasets cache {cache_dir} has config(s) {', '.join(configs) or '(none)'}, not {config!r}"
        )
    splits = list(_load(repo, config, None, cache_dir))
    if split not in splits:
        raise DataError(
            f"{repo} (config {config}) in the datasets cache {cache_dir} has split(s) {', '.join(splits)}, "
            f"not {split!r}"
        )
    return CachedSplit(repo, config, split, cache_dir)


def found_rows(found: Path | CachedSplit) -> Iterator[tuple[str, object]]:
    """(location, row) of every row of a file or of a cached split."""
    return found.rows() if isinstance(found, CachedSplit) else file_rows(found)
