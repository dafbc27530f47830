"""Sources of training prompts, read from local copies in their published layouts (never downloaded).

A source is a kind (how its rows look), a place (a file, a folder searched for
the kind's published file names, or, with no path, the local Hugging Face
datasets cache) and a mixing weight. Each row becomes one chat: the messages
before the answer the target will regenerate. Multi-turn rows (ShareGPT,
UltraChat, `messages` lists) keep their earlier turns, assistant answers
included, as context and end at their last user turn; the reference answers of
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
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from draftopd.data.eval_sets import hf_cache_root, read_rows
from draftopd.data.prompts import PromptError

Chat = list[dict[str, str]]


class PrepareError(PromptError):
    """A source, mix or output folder that cannot be used, with what was tried."""


class Malformed(ValueError):
    """A row its source's kind cannot turn into a chat."""


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


def _messages(row: dict) -> Chat:
    msgs = row.get("messages")
    if isinstance(msgs, list) and msgs:
        return _conversation([(m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None) for m in msgs])
    return _text("prompt")(row)


def _sharegpt(row: dict) -> Chat:
    conv = row.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise Malformed("no 'conversations' list")
    return _conversation([(m.get("from"), m.get("value")) if isinstance(m, dict) else (None, None) for m in conv])


def _text(*keys: str) -> Callable[[dict], Chat]:
    def chat(row: dict) -> Chat:
        for k in keys:
            if isinstance(row.get(k), str) and row[k].strip():
                return [{"role": "user", "content": row[k]}]
        raise Malformed(f"no non-empty string in {' / '.join(keys)}")

    return chat


def _aops(row: dict) -> Chat:
    keys = ("problem", "question", "rewritten_question", "original_question")
    if any(isinstance(row.get(k), str) and row[k].strip() for k in keys) or "messages" not in row:
        return _text(*keys)(row)
    return _messages(row)


def _codealpaca(row: dict) -> Chat:
    instruction, extra = row.get("instruction"), row.get("input") or ""
    if not isinstance(instruction, str) or not instruction.strip() or not isinstance(extra, str):
        raise Malformed("needs a non-empty string 'instruction' (and a string 'input')")
    return [{"role": "user", "content": instruction + (f"\n\n{extra}" if extra.strip() else "")}]


@dataclass(frozen=True)
class Kind:
    files: tuple[str, ...]  # glob patterns of the published files, in order of preference (the first that hits wins)
    hf_dirs: tuple[str, ...]  # folder names in a Hugging Face datasets cache
    splits: tuple[str, ...]  # split names of a cache's Arrow files, in order of preference
    chat: Callable[[dict], Chat]


KINDS = {
    "sharegpt": Kind(
        ("ShareGPT*.json", "*.json", "*.jsonl", "*.parquet"),
        ("anon8231489123___ShareGPT_Vicuna_unfiltered",),
        ("train",),
        _sharegpt,
    ),
    "ultrachat": Kind(
        ("train_sft-*.parquet", "*.parquet", "*.jsonl"), ("HuggingFaceH4___ultrachat_200k",), ("train_sft",), _messages
    ),
    "chat": Kind(("*.jsonl", "*.parquet", "*.json"), (), ("train",), _messages),
    "gsm8k": Kind(
        ("train.jsonl", "train-*.parquet", "*.jsonl"), ("openai___gsm8k", "gsm8k"), ("train",), _text("question")
    ),
    "math": Kind(
        ("train-*.parquet", "train.jsonl", "train/*/*.json", "*.jsonl", "*.parquet", "*.json"),
        ("EleutherAI___hendrycks_math", "hendrycks___competition_math", "competition_math"),
        ("train",),
        _text("problem", "question"),
    ),
    "aops": Kind(
        ("train-*.parquet", "*.parquet", "*.jsonl", "*.json"),
        ("AI-MO___aops", "DeepStudentLlama___AoPS-Instruct", "AI-MO___NuminaMath-CoT"),
        ("train",),
        _aops,
    ),
    "codealpaca": Kind(
        ("code_alpaca_20k.json", "code_alpaca_data.json", "*.json", "*.jsonl", "train-*.parquet"),
        ("sahil2801___CodeAlpaca-20k",),
        ("train",),
        _codealpaca,
    ),
}
CACHE_METADATA = {"dataset_info.json", "state.json", "dataset_dict.json"}  # files of a datasets cache, not data


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


def _search(kind: Kind, root: Path) -> list[Path]:
    for pattern in kind.files:
        hits = sorted(p for p in root.rglob(pattern) if p.is_file() and p.name not in CACHE_METADATA)
        if hits:
            return hits
    arrows = sorted(root.rglob("*.arrow"))  # a datasets cache: <builder>-<split>[-NNNNN-of-NNNNN].arrow
    for split in kind.splits:
        picked = [p for p in arrows if f"-{split}." in p.name or f"-{split}-" in p.name]
        if picked:
            return picked
    return arrows


def find_files(spec: SourceSpec) -> list[Path]:
    """The files of a source: the given file, the kind's files under the given folder, or in the datasets cache."""
    kind = KINDS[spec.kind]
    if spec.path is not None:
        p = Path(spec.path)
        if p.is_file():
            return [p]
        if not p.is_dir():
            raise PrepareError(f"source {spec.name}: {p} does not exist")
        if not (files := _search(kind, p)):
            raise PrepareError(f"source {spec.name}: no file of the {spec.kind} layout under {p}")
        return files
    for folder in kind.hf_dirs:
        d = hf_cache_root() / folder
        if d.is_dir() and (files := _search(kind, d)):
            return files
    raise PrepareError(
        f"source {spec.name}: no path given ({spec.name}=PATH) and none of {list(kind.hf_dirs)} "
        f"in the datasets cache {hf_cache_root()}"
    )


def file_rows(path: Path) -> Iterator[tuple[str, object]]:
    """(location, row) of every row; a JSONL line that is not JSON comes as a `Malformed` row, not an error."""
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
        if isinstance(data, dict):  # the MATH tree: one problem per file
            yield str(path), data
            return
        if not isinstance(data, list):
            raise PrepareError(f"{path}: expected a JSON list of rows or one JSON object")
    else:
        data = read_rows(path)  # parquet, Arrow (datasets cache), gzipped JSON
    for i, row in enumerate(data):
        yield f"{path}[{i}]", row


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


def read_source(spec: SourceSpec, max_malformed_fraction: float) -> SourceRows:
    """Every chat of a source; a `PrepareError` if more than the allowed fraction of its rows is malformed."""
    from tqdm import tqdm

    files = find_files(spec)
    out = SourceRows(spec, [str(f) for f in files])
    to_chat = KINDS[spec.kind].chat
    for f in tqdm(files, desc=f"read {spec.name}", unit="file", disable=len(files) < 20):
        for where, row in file_rows(f):
            out.num_rows += 1
            try:
                if isinstance(row, Exception):
                    raise row
                if not isinstance(row, dict):
                    raise Malformed(f"expected an object, got {type(row).__name__}")
                out.chats.append(to_chat(row))
            except (Malformed, KeyError, TypeError, AttributeError) as exc:
                out.num_malformed += 1
                out.first_malformed = out.first_malformed or f"{where}: {exc}"
    if out.num_rows == 0:
        raise PrepareError(f"source {spec.name}: no rows in {', '.join(out.files)}")
    if out.malformed_fraction > max_malformed_fraction:
        raise PrepareError(
            f"source {spec.name}: {out.num_malformed} of {out.num_rows} rows are malformed "
            f"({out.malformed_fraction:.1%} > --max-malformed-fraction {max_malformed_fraction:g}); "
            f"first: {out.first_malformed}"
        )
    return out
