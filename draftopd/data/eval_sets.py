"""Named evaluation sets, read from local copies in their published layouts (never downloaded).

A set is a list of conversations, each a list of turns, each turn the messages
added before the model answers (a user message, with a system message in the
first turn where the source has one). MT-Bench has two turns; the rest one. Where a set comes from:

* `name=PATH` on the command line: PATH is a file (JSONL, JSONL.gz, JSON list,
  parquet, or an Arrow file of a Hugging Face datasets cache) or a directory
  searched for the set's published file names;
* otherwise the local Hugging Face datasets cache (`HF_DATASETS_CACHE`, else
  `~/.cache/huggingface/datasets`), under the set's usual repository folders;
* the toy sets (`toy`, `toy-arithmetic`, `toy-code`) come from the toy corpus.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class EvalSetError(ValueError):
    """A set that cannot be found or read, with the place that was tried."""


def _text(*keys: str) -> Callable[[dict], list[str]]:
    def turns(row: dict) -> list[str]:
        for k in keys:
            if isinstance(row.get(k), str) and row[k].strip():
                return [row[k]]
        raise KeyError(f"none of {keys}")

    return turns


def _alpaca(row: dict) -> list[str]:
    extra = row.get("input") or ""
    return [row["instruction"] + (f"\n\n{extra}" if extra.strip() else "")]


def _cnn_dm(row: dict) -> list[str]:
    return [f"Summarize the following article in a few sentences.\n\n{row['article']}"]


def _mt_bench(row: dict) -> list[str]:
    turns = row.get("turns") or row.get("prompt")
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise KeyError("turns")
    return list(turns)


@dataclass(frozen=True)
class Layout:
    files: tuple[str, ...]  # glob patterns of the published files, in order of preference
    hf_dirs: tuple[str, ...]  # folder names in a Hugging Face datasets cache
    turns: Callable[[dict], list[str]]


LAYOUTS = {
    "mt_bench": Layout(("question.jsonl", "*.parquet"), ("HuggingFaceH4___mt_bench_prompts",), _mt_bench),
    "gsm8k": Layout(("test.jsonl", "test-*.parquet", "*.jsonl"), ("openai___gsm8k", "gsm8k"), _text("question")),
    "math500": Layout(("test.jsonl", "test-*.parquet"), ("HuggingFaceH4___math-500",), _text("problem")),
    "humaneval": Layout(
        ("HumanEval.jsonl", "HumanEval.jsonl.gz", "test-*.parquet"),
        ("openai___openai_humaneval", "openai_humaneval"),
        _text("prompt"),
    ),
    "mbpp": Layout(
        ("mbpp.jsonl", "sanitized-mbpp.json", "test-*.parquet"),
        ("google-research-datasets___mbpp", "mbpp"),
        _text("text", "prompt"),
    ),
    "alpaca": Layout(("alpaca_data.json", "train-*.parquet"), ("tatsu-lab___alpaca",), _alpaca),
    "cnn_dm": Layout(("test-*.parquet", "test.jsonl"), ("abisee___cnn_dailymail", "cnn_dailymail"), _cnn_dm),
}
TOY_SETS = ("toy", "toy-arithmetic", "toy-code")


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
        raise EvalSetError(f"{path}: expected a JSON list of rows")
    return data


def hf_cache_root() -> Path:
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"])
    hf_home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    return Path(hf_home) / "datasets"


def _find_file(name: str, root: Path) -> Path | None:
    """The set's file under `root`: published names first, then Arrow files of a datasets cache."""
    layout = LAYOUTS[name]
    for pattern in layout.files:
        hits = sorted(root.rglob(pattern))
        if hits:
            return hits[0]
    arrows = sorted(root.rglob("*.arrow"))
    preferred = [p for p in arrows if "test" in p.name] or arrows
    return preferred[0] if preferred else None


def locate(name: str, path: str | None = None) -> Path | None:
    """Where set `name` lives: the given file or directory, else the datasets cache; None if absent."""
    if name not in LAYOUTS:
        raise EvalSetError(f"unknown eval set {name!r}; known: {', '.join([*TOY_SETS, *LAYOUTS])}")
    if path is not None:
        p = Path(path)
        if p.is_file():
            return p
        if not p.is_dir():
            raise EvalSetError(f"{name}: {p} does not exist")
        found = _find_file(name, p)
        if found is None:
            raise EvalSetError(f"{name}: no file of its published layout under {p}")
        return found
    for folder in LAYOUTS[name].hf_dirs:
        d = hf_cache_root() / folder
        if d.is_dir() and (found := _find_file(name, d)):
            return found
    return None


@dataclass
class EvalSet:
    name: str
    conversations: list[list[list[dict]]]  # conversation -> turns -> messages added before each answer
    source: str
    num_malformed: int = 0


def user_turns(texts: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": t}] for t in texts]


def load_set(name: str, path: str | None = None, limit: int | None = None, seed: int = 0) -> EvalSet:
    """The first `limit` conversations of a set; rows the layout cannot read are counted, not fatal."""
    if name in TOY_SETS:
        from draftopd.data.prompts import toy_prompts

        domain = None if name == "toy" else name.split("-", 1)[1]
        chats = toy_prompts("held_out", limit or 10**9, seed, domain=domain)
        return EvalSet(name, [[chat] for chat in chats], "toy corpus")
    file = locate(name, path)
    if file is None:
        raise EvalSetError(f"{name}: not given (use {name}=PATH) and not in the datasets cache {hf_cache_root()}")
    convs, bad = [], 0
    for row in read_rows(file):
        try:
            convs.append(user_turns(LAYOUTS[name].turns(row)))
        except (KeyError, TypeError):
            bad += 1
        if limit and len(convs) >= limit:
            break
    if not convs:
        raise EvalSetError(f"{name}: {file} has no row in the {name} layout ({bad} unreadable)")
    return EvalSet(name, convs, str(file), bad)


def available_sets(given: dict[str, str]) -> list[str]:
    """Toy sets, every set given a path, and every set found in the datasets cache."""
    found = [n for n in LAYOUTS if n in given or locate(n) is not None]
    return [*TOY_SETS, *found]
