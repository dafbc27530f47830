"""Prompt files: reading them, checking them, and turning them into token ids with a chat template.

A prompt file is JSONL, one object per line: `{"prompt": "..."}` (a single user
turn) or `{"messages": [{"role": ..., "content": ...}, ...]}` (a chat whose last
turn is answered). A malformed line is a `PromptError` naming the file and line.
A line may name its split (`"split": "train"` or `"held_out"`): then one file can
serve as both `data.prompts` and `data.eval_prompts`, each reading its own lines.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftopd.data.io import PromptError

ROLES = {"system", "user", "assistant", "tool"}


def _parse_line(obj, where: str) -> list[dict[str, str]]:
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise PromptError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise PromptError(f"{where}: message {i} needs a 'role' in {sorted(ROLES)} and a string 'content'")
        if msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]  # a reference answer: the prompt is everything before it
        if not msgs:
            raise PromptError(f"{where}: no turns left before the assistant answer")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    if isinstance(obj.get("prompt"), str):
        return [{"role": "user", "content": obj["prompt"]}]
    raise PromptError(f"{where}: needs a string 'prompt' or a 'messages' list (keys: {sorted(obj)})")


def read_prompt_file(path: str | Path, split: str | None = None) -> list[list[dict[str, str]]]:
    """All chats in a JSONL prompt file; blank lines are skipped. With `split`, a line that names a split is
    kept only in its own (`train`, or held-out for any other name, as pools split)."""
    p = Path(path)
    if not p.is_file():
        raise PromptError(f"prompt file {p} not found")
    chats = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptError(f"{p}:{n}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if split is not None and isinstance(obj, dict) and "split" in obj:
                if (obj["split"] == "train") != (split == "train"):
                    continue
            chats.append(_parse_line(obj, f"{p}:{n}"))
    if not chats:
        raise PromptError(f"prompt file {p} has no prompts")
    return chats


def toy_prompts(
    split: str, limit: int, seed: int = 0, domain: str | None = None, num_arithmetic: int = 4000
) -> list[list[dict[str, str]]]:
    """Prompts of the toy corpus (`train` or `held_out`), mixed across domains (or one) in a fixed order. A larger
    `num_arithmetic` draws more arithmetic prompts after the same first 4,000 (the code prompts are fixed)."""
    import random

    from draftopd.toy.corpus import build_corpus, prompt_only

    train, held = build_corpus(num_arithmetic=num_arithmetic, seed=1000 + seed)
    samples = [s for s in (train if split == "train" else held) if domain is None or s.domain == domain]
    random.Random(seed).shuffle(samples)
    return [prompt_only(s) for s in samples[:limit]]


def encode_chats(tokenizer, chats: list[list[dict[str, str]]], enable_thinking: bool = True) -> list[list[int]]:
    """Token ids of each chat rendered with the tokenizer's chat template and the assistant prefix."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise PromptError("the target's tokenizer has no chat template")
    out = []
    for chat in chats:
        text = tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def load_prompts(spec: str, split: str, limit: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`spec` is a JSONL path, a pool folder made by `draftopd prepare-data` (its training prompts for
    split `train`, its held-out prompts otherwise), or `toy`; returns at most `limit` chats."""
    if spec == "toy":
        return toy_prompts(split, limit, seed)
    if Path(spec).is_dir():
        from draftopd.data.pool import pool_prompts

        return pool_prompts(spec, split)[:limit]
    return read_prompt_file(spec, split)[:limit]


def check_distinct_sources(prompts: str, eval_prompts: str) -> None:
    """One JSONL file as both training and held-out prompts is refused unless every line names its split."""
    p, q = Path(prompts), Path(eval_prompts)
    if prompts == "toy" or not p.is_file() or not q.is_file() or p.resolve() != q.resolve():
        return
    with p.open(encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    try:
        if lines and all("split" in json.loads(line) for line in lines):
            return
    except (json.JSONDecodeError, TypeError):
        pass  # a malformed line is reported where the file is read
    raise PromptError(
        f"{p} is both data.prompts and data.eval_prompts: the held-out prompts would be training prompts; "
        'give each line a "split" ("train" or "held_out") or a held-out file of its own'
    )
