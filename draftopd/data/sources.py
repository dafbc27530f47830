"""Published data sets: one registry of their layouts, and the training sources of `draftopd prepare-data`.

A layout says where a data set lies (its published file names, its Hugging Face
repositories with the config read), which split training and evaluation read,
and how one row reads as the messages before each answer. Data are read from
local copies only (never downloaded): a file, a folder searched for the
layout's published files, or the local Hugging Face datasets cache.

A training source is a kind (the name of a layout with a training split), a
place and a mixing weight. Each row becomes one chat: the messages before the
answer the target will regenerate. Multi-turn rows (ShareGPT, UltraChat,
`messages` lists) keep their earlier turns, assistant answers included, as
context and end at their last user turn; the reference answers of
single-turn sources are dropped. Rows a kind cannot read are counted per source
with the first one's location, and only fail the run past a threshold.

Published fields, per kind:
* `sharegpt`: a JSON list of `{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}`;
* `ultrachat` (ultrachat_200k, split `train_sft`) and `chat`: `{"messages": [{"role", "content"}]}`
  or `{"prompt": ...}`;
* `gsm8k`: `{"question", "answer"}`;
* `math`: `{"problem", "solution", "level", "type"}`, as parquet/JSONL or the original MATH tree
  of one JSON object per file (`train/<subject>/<n>.json`);
* `aops`: `{"problem"|"question"|"rewritten_question", "solution"|"answer"...}` (AI-MO/aops,
  NuminaMath) or `{"messages"}` (AoPS-Instruct);
* `codealpaca`: `{"instruction", "input", "output"}` (code_alpaca_20k.json).
The evaluation sets (`mt_bench`, `gsm8k`, `math500`, `humaneval`, `mbpp`, `alpaca`, `cnn_dm`) are read by
`data/eval_sets.py` from the same registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftopd.data.io import (
    CachedSplit,
    DataError,
    Malformed,
    PrepareError,
    cache_folder,
    cached_split,
    found_rows,
    hf_cache_root,
    published_files,
)

Chat = list[dict[str, str]]
Turns = list[Chat]  # the messages added before each answer, one list per turn

ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


def _conversation(turns: list[tuple[str, object]]) -> Chat:
    """Leading answers dropped (no question before them), trailing answers cut: the chat ends on a user turn."""
    chat = []
    for role, content in turns:
        if role not in ROLE_NAMES:
            raise Malformed(f"unknown role {role!r}")
        if not isinstance(content, str):
            raise Malformed(f"a {role} turn without string content")
        chat.append({"role": ROLE_NAMES[role], "content": content})
    users = [i for i, m in enumerate(chat) if m["role"] == "user"]
    if not users:
        raise Malformed("no user turn")
    if not chat[users[-1]]["content"].strip():
        raise Malformed("the last user turn is empty")
    system = [m for m in chat[: users[0]] if m["role"] == "system"]
    return system + chat[users[0] : users[-1] + 1]


def _user(text: str) -> Turns:
    return [[{"role": "user", "content": text}]]


def _text(*keys: str) -> Callable[[dict], Turns]:
    def turns(row: dict) -> Turns:
        for k in keys:
            if isinstance(row.get(k), str) and row[k].strip():
                return _user(row[k])
        raise Malformed(f"no non-empty string in {' / '.join(keys)}")

    return turns


def _messages(row: dict) -> Turns:
    msgs = row.get("messages")
    if isinstance(msgs, list) and msgs:
        pairs = [(m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None) for m in msgs]
        return [_conversation(pairs)]
    return _text("prompt")(row)


def _sharegpt(row: dict) -> Turns:
    conv = row.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise Malformed("no 'conversations' list")
    return [_conversation([(m.get("from"), m.get("value")) if isinstance(m, dict) else (None, None) for m in conv])]


def _aops(row: dict) -> Turns:
    keys = ("problem", "question", "rewritten_question", "original_question")
    if any(isinstance(row.get(k), str) and row[k].strip() for k in keys) or "messages" not in row:
        return _text(*keys)(row)
    return _messages(row)


def _alpaca(row: dict) -> Turns:
    """Alpaca and CodeAlpaca: the instruction, then its input after a blank line."""
    instruction, extra = row.get("instruction"), row.get("input") or ""
    if not isinstance(instruction, str) or not instruction.strip() or not isinstance(extra, str):
        raise Malformed("needs a non-empty string 'instruction' (and a string 'input')")
    return _user(instruction + (f"\n\n{extra}" if extra.strip() else ""))


def _cnn_dm(row: dict) -> Turns:
    if not isinstance(row.get("article"), str):
        raise Malformed("no string 'article'")
    return _user(f"Summarize the following article in a few sentences.\n\n{row['article']}")


def _mt_bench(row: dict) -> Turns:
    turns = row.get("turns") or row.get("prompt")
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise Malformed("no 'turns' list of strings")
    return [turn for t in turns for turn in _user(t)]


@dataclass(frozen=True)
class Hub:
    """A data set's repository on the Hugging Face hub, as found in the local datasets cache."""

    repo: str
    configs: tuple[str, ...] = ("default",)  # the configs read, all of them, in order


@dataclass(frozen=True)
class Layout:
    """How a published data set lies on disk and in the datasets cache, and how its rows read as turns."""

    files: tuple[str, ...]  # glob patterns of its published files, in order of preference; {split}: the split read
    hub: tuple[Hub, ...]  # its repositories, in order of preference (the first one cached is read)
    turns: Callable[[dict], Turns]
    train_split: str | None = None  # the split a training source reads (None: not a source kind)
    eval_split: str | None = None  # the split an eval set reads (None: not an eval set)


MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
LAYOUTS = {
    "sharegpt": Layout(
        ("ShareGPT*.json", "*.json", "*.jsonl", "*.parquet"),
        (Hub("anon8231489123/ShareGPT_Vicuna_unfiltered"),),
        _sharegpt,
        train_split="train",
    ),
    "ultrachat": Layout(
        ("{split}-*.parquet", "*.parquet", "*.jsonl"),
        (Hub("HuggingFaceH4/ultrachat_200k"),),
        _messages,
        train_split="train_sft",
    ),
    "chat": Layout(("*.jsonl", "*.parquet", "*.json"), (), _messages, train_split="train"),
    "gsm8k": Layout(
        ("{split}.jsonl", "{split}-*.parquet", "*.jsonl"),
        (Hub("openai/gsm8k", ("main",)),),
        _text("question"),
        train_split="train",
        eval_split="test",
    ),
    "math": Layout(
        ("{split}-*.parquet", "{split}.jsonl", "{split}/*/*.json", "*.jsonl", "*.parquet", "*.json"),
        (Hub("EleutherAI/hendrycks_math", MATH_SUBJECTS), Hub("hendrycks/competition_math")),
        _text("problem", "question"),
        train_split="train",
    ),
    "aops": Layout(
        ("{split}-*.parquet", "*.parquet", "*.jsonl", "*.json"),
        (Hub("AI-MO/aops"), Hub("DeepStudentLlama/AoPS-Instruct"), Hub("AI-MO/NuminaMath-CoT")),
        _aops,
        train_split="train",
    ),
    "codealpaca": Layout(
        ("code_alpaca_20k.json", "code_alpaca_data.json", "*.json", "*.jsonl", "{split}-*.parquet"),
        (Hub("sahil2801/CodeAlpaca-20k"),),
        _alpaca,
        train_split="train",
    ),
    "mt_bench": Layout(
        ("question.jsonl", "*.parquet"), (Hub("HuggingFaceH4/mt_bench_prompts"),), _mt_bench, eval_split="train"
    ),
    "math500": Layout(
        ("{split}.jsonl", "{split}-*.parquet"), (Hub("HuggingFaceH4/MATH-500"),), _text("problem"), eval_split="test"
    ),
    "humaneval": Layout(
        ("HumanEval.jsonl", "HumanEval.jsonl.gz", "{split}-*.parquet"),
        (Hub("openai/openai_humaneval", ("openai_humaneval",)),),
        _text("prompt"),
        eval_split="test",
    ),
    "mbpp": Layout(
        ("mbpp.jsonl", "sanitized-mbpp.json", "{split}-*.parquet"),
        (Hub("google-research-datasets/mbpp", ("full",)),),
        _text("text", "prompt"),
        eval_split="test",
    ),
    "alpaca": Layout(
        ("alpaca_data.json", "{split}-*.parquet"), (Hub("tatsu-lab/alpaca"),), _alpaca, eval_split="train"
    ),
    "cnn_dm": Layout(
        ("{split}-*.parquet", "{split}.jsonl"), (Hub("abisee/cnn_dailymail", ("3.0.0",)),), _cnn_dm, eval_split="test"
    ),
}
KINDS = [name for name, layout in LAYOUTS.items() if layout.train_split]

Found = list[Path | CachedSplit]


def _cached(layout: Layout, split: str, cache_dir: Path) -> Found:
    """Every config of the first of the layout's repositories found in the datasets cache at `cache_dir`."""
    for hub in layout.hub:
        found = [cached_split(hub.repo, config, split, cache_dir) for config in hub.configs]
        if all(found):  # all None when the repository is not cached; a missing config raises, naming what is
            return found
    return []


def _cache_dir_at(layout: Layout, root: Path) -> Path | None:
    """`root` as a datasets cache holding one of the layout's repositories, or as such a repository's folder."""
    folders = {cache_folder(hub.repo) for hub in layout.hub}
    if any((root / folder).is_dir() for folder in folders):
        return root
    return root.parent if root.name in folders else None


def locate(name: str, split: str, path: str | None = None) -> Found:
    """The data of layout `name`'s split `split`: the given file; under a given folder the published files, or
    the split in the datasets cache the folder holds; without a path the datasets cache. Empty if not cached;
    a `DataError` (without the name) if the path cannot be read as this layout."""
    layout = LAYOUTS[name]
    if path is None:
        return _cached(layout, split, hf_cache_root())
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise DataError(f"{p} does not exist")
    if (cache_dir := _cache_dir_at(layout, p)) and (found := _cached(layout, split, cache_dir)):
        return found
    found = published_files(p, tuple(pattern.format(split=split) for pattern in layout.files))
    if not found:
        raise DataError(f"no file of the {name} layout under {p}")
    return found


@dataclass
class SourceSpec:
    """One entry of the mix: `name` labels it in the pool and the manifest, `kind` says how its rows look."""

    name: str
    kind: str
    path: str | None = None
    weight: float = 1.0


def parse_source_arg(text: str) -> SourceSpec:
    """`KIND[=PATH][:WEIGHT]` from the command line; without PATH the datasets cache is searched."""
    weight = 1.0
    head, sep, tail = text.rpartition(":")
    if sep:
        try:
            weight, text = float(tail), head
        except ValueError:
            pass  # a colon inside the path
    name, _, path = text.partition("=")
    return _checked(SourceSpec(name, name, path or None, weight), f"--source {text}")


def read_mix_file(path: str | Path) -> list[SourceSpec]:
    """A YAML mix: `sources:` a list of `{name, kind (default: name), path (default: the cache), weight (1)}`;
    a relative path is taken from the mix file's folder."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise PrepareError(f"mix file {p} not found")
    doc = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    if not isinstance(doc, dict) or set(doc) != {"sources"} or not isinstance(doc["sources"], list):
        raise PrepareError(f"{p}: expected one key, 'sources', holding a list")
    specs = []
    for i, entry in enumerate(doc["sources"]):
        if not isinstance(entry, dict) or "name" not in entry or set(entry) - {"name", "kind", "path", "weight"}:
            raise PrepareError(f"{p}: source {i} needs a 'name' and may have only 'kind', 'path' and 'weight'")
        path = entry.get("path")
        if path is not None:  # relative to the mix file
            path = str(p.parent / Path(str(path)).expanduser())
        spec = SourceSpec(str(entry["name"]), str(entry.get("kind", entry["name"])), path, entry.get("weight", 1.0))
        specs.append(_checked(spec, f"{p}: source {i}"))
    return specs


def _checked(spec: SourceSpec, where: str) -> SourceSpec:
    if spec.kind not in KINDS:
        raise PrepareError(f"{where}: unknown source kind {spec.kind!r}; known: {', '.join(KINDS)}")
    if not isinstance(spec.weight, (int, float)) or spec.weight <= 0:
        raise PrepareError(f"{where}: the weight must be a positive number, got {spec.weight!r}")
    spec.weight = float(spec.weight)
    return spec


@dataclass
class SourceRows:
    """What was read from one source: its chats, and how many rows could not be read."""

    spec: SourceSpec
    files: list[str]
    chats: list[Chat] = field(default_factory=list)
    num_rows: int = 0
    num_malformed: int = 0
    first_malformed: str | None = None  # "location: reason"

    @property
    def malformed_fraction(self) -> float:
        return self.num_malformed / max(self.num_rows, 1)


def find_files(spec: SourceSpec) -> Found:
    """The data of a source: the given file, the kind's files under the given folder, or its training split in
    the datasets cache (the one the given folder holds, else the local one)."""
    layout = LAYOUTS[spec.kind]
    try:
        found = locate(spec.kind, layout.train_split, spec.path)
    except DataError as exc:
        raise PrepareError(f"source {spec.name}: {exc}") from None
    if not found:
        raise PrepareError(
            f"source {spec.name}: no path given ({spec.name}=PATH) and none of "
            f"{[hub.repo for hub in layout.hub]} in the datasets cache {hf_cache_root()}"
        )
    return found


def read_source(spec: SourceSpec, max_malformed_fraction: float) -> SourceRows:
    """Every chat of a source; a `PrepareError` if more than the allowed fraction of its rows is malformed."""
    from tqdm import tqdm

    files = find_files(spec)
    out = SourceRows(spec, [str(f) for f in files])
    turns = LAYOUTS[spec.kind].turns
    try:
        for f in tqdm(files, desc=f"read {spec.name}", unit="file", disable=len(files) < 20):
            for where, row in found_rows(f):
                out.num_rows += 1
                try:
                    if isinstance(row, Exception):
                        raise row
                    if not isinstance(row, dict):
                        raise Malformed(f"expected an object, got {type(row).__name__}")
                    [chat] = turns(row)  # the layouts of training sources read one turn per row
                    out.chats.append(chat)
                except (Malformed, KeyError, TypeError, AttributeError) as exc:
                    out.num_malformed += 1
                    out.first_malformed = out.first_malformed or f"{where}: {exc}"
    except DataError as exc:
        raise PrepareError(f"source {spec.name}: {exc}") from None
    if out.num_rows == 0:
        raise PrepareError(f"source {spec.name}: no rows in {', '.join(out.files)}")
    if out.malformed_fraction > max_malformed_fraction:
        raise PrepareError(
            f"source {spec.name}: {out.num_malformed} of {out.num_rows} rows are malformed "
            f"({out.malformed_fraction:.1%} > --max-malformed-fraction {max_malformed_fraction:g}); "
            f"first: {out.first_malformed}"
        )
    return out
