"""Training text for the toy target, made here or read from Python's own stdlib.

No model hub or data set is reachable on the machines this project is tested on,
so the toy target learns from two sources it can always rebuild bit for bit:

* synthetic step-by-step arithmetic and word problems, answered inside a
  `<think>` section: long near-deterministic stretches (the digits follow from
  the question) with a few uncertain words (phrasing chosen at random);
* Python functions parsed from the interpreter's own standard library, asked for
  by name with thinking off: copying the header is easy, the body is uncertain.

Every sample is a chat (a list of `{"role", "content"}` messages); the held-out
split is by a hash of the sample's identity, and a held-out prompt whose text a
training prompt repeats (same-named functions of one module) is dropped, so it
never overlaps training.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jon", "Kai", "Lea"]
ITEMS = ["apples", "books", "coins", "marbles", "pens", "stamps", "cards", "shells", "cookies"]
ANSWER_LINES = [
    "The answer is {r}.",
    "So the result is {r}.",
    "Answer: {r}",
    "The final answer is {r}.",
    "{r}",
]
# A few system prompts so that the chat template is not always identical.
SYSTEMS = [None, None, None, "You are a helpful assistant.", "You are a careful math tutor."]


@dataclass(frozen=True)
class Sample:
    """One chat: `messages` end with the assistant turn; `key` identifies it for the split."""

    key: str
    domain: str
    messages: list[dict[str, str]]


def is_held_out(key: str, fraction: float = 0.05) -> bool:
    """Stable split: the same key is held out on every machine and every run."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") < fraction * 2**32


def _add_steps(a: int, b: int) -> str:
    """Column addition, digit by digit, with carries spelled out."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry, lines = 0, []
    places = ["ones", "tens", "hundreds", "thousands"]
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        extra = f" + {carry}" if carry else ""
        lines.append(f"{places[i]}: {x} + {y}{extra} = {s}, write {s % 10}" + (", carry 1" if s >= 10 else ""))
        carry = s // 10
    if carry:
        lines.append("write the last carry 1")
    return "\n".join(lines)


def _mul_steps(a: int, b: int) -> str:
    """Multiplication of a number by one digit, split into tens and ones."""
    tens, ones = a - a % 10, a % 10
    return f"{a} * {b} = {tens} * {b} + {ones} * {b} = {tens * b} + {ones * b} = {a * b}"


def _with_think(rng: random.Random, question: str, steps: str, result: int) -> list[dict[str, str]]:
    answer = rng.choice(ANSWER_LINES).format(r=result)
    msgs = []
    system = rng.choice(SYSTEMS)
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": question})
    if rng.random() < 0.2:  # thinking off: the empty think block of hybrid-thinking chat models
        msgs.append({"role": "assistant", "content": f"<think>\n\n</think>\n\n{answer}"})
    else:
        msgs.append({"role": "assistant", "content": f"<think>\n{steps}\n</think>\n\n{answer}"})
    return msgs


def arithmetic_sample(rng: random.Random) -> Sample:
    """One random arithmetic question with its worked answer."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(10, 1000), rng.randrange(10, 1000)
        q = rng.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}."]).format(a=a, b=b)
        steps, r = f"Add {a} and {b} column by column.\n{_add_steps(a, b)}\nSo {a} + {b} = {a + b}.", a + b
    elif kind == 1:
        a, b = rng.randrange(10, 100), rng.randrange(2, 10)
        q = rng.choice(["What is {a} * {b}?", "Compute {a} times {b}.", "Multiply {a} by {b}."]).format(a=a, b=b)
        steps, r = _mul_steps(a, b), a * b
    elif kind == 2:
        a, b, c = rng.randrange(2, 60), rng.randrange(2, 40), rng.randrange(2, 10)
        q = f"Compute ({a} + {b}) * {c}."
        s = a + b
        steps = f"First the bracket: {a} + {b} = {s}.\nThen multiply: {_mul_steps(s, c)}."
        r = s * c
    else:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randrange(5, 60), rng.randrange(2, 30), rng.randrange(1, 5)
        q = (
            f"{name} has {a} {item}. {name} buys {b} more and then gives away {c}. "
            f"How many {item} does {name} have now?"
        )
        steps = (
            f"{name} starts with {a} {item}.\nAfter buying: {a} + {b} = {a + b}.\n"
            f"After giving away: {a + b} - {c} = {a + b - c}."
        )
        r = a + b - c
    return Sample(key=f"arith:{q}", domain="arithmetic", messages=_with_think(rng, q, steps, r))


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages", "ensurepip"}
    files = [p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts) & skip)]
    return sorted(files)


def code_samples(max_lines: int = 40) -> Iterator[Sample]:
    """Functions of the stdlib, short enough to fit a toy context, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_files():
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
                continue
            body = lines[node.lineno - 1 : node.end_lineno]
            if not 3 <= len(body) <= max_lines or any(len(x) > 100 for x in body):
                continue
            indent = len(body[0]) - len(body[0].lstrip())
            body = [x[indent:] for x in body]
            code = "\n".join(body)
            question = f"Write the Python function `{node.name}` from the `{module}` module:\n```python\n{body[0]}\n```"
            answer = f"<think>\n\n</think>\n\n```python\n{code}\n```"
            yield Sample(
                key=f"code:{module}:{node.name}:{node.lineno}",
                domain="code",
                messages=[{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            )


def build_corpus(num_arithmetic: int, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """All code samples plus `num_arithmetic` arithmetic ones, split into (train, held_out).

    Built once per process and arguments (parsing the stdlib takes seconds, and a run asks for its training
    prompts, its held-out prompts and their domains); each call gets lists of its own to shuffle."""
    train, held = _corpus(num_arithmetic, seed)
    return list(train), list(held)


@functools.lru_cache(maxsize=8)
def _corpus(num_arithmetic: int, seed: int) -> tuple[tuple[Sample, ...], tuple[Sample, ...]]:
    rng = random.Random(seed)
    samples = list(_stdlib_code()) + [arithmetic_sample(rng) for _ in range(num_arithmetic)]
    train = [s for s in samples if not is_held_out(s.key)]
    seen = {json.dumps(prompt_only(s)) for s in train}  # only the held-out side loses duplicates
    held = [s for s in samples if is_held_out(s.key) and json.dumps(prompt_only(s)) not in seen]
    return tuple(train), tuple(held)


@functools.lru_cache(maxsize=1)
def _stdlib_code() -> tuple[Sample, ...]:
    """The code samples, parsed once per process: every seed's corpus shares them."""
    return tuple(code_samples())


def prompt_only(sample: Sample) -> list[dict[str, str]]:
    """The chat without its final assistant turn: what a rollout is asked to answer."""
    assert sample.messages[-1]["role"] == "assistant"
    return sample.messages[:-1]
