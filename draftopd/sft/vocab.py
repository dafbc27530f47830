"""The draft vocabulary: the target tokens the drafter can propose, chosen by frequency."""

from __future__ import annotations

from collections import Counter

import torch


def build_draft_vocab(sequences: list[list[int]], size: int, vocab_size: int, always: list[int] = ()) -> torch.Tensor:
    """The `size` most frequent tokens of `sequences` (plus `always`), as sorted target ids.

    Sorted ids make `d2t = ids - arange` non-negative, as EAGLE-3 checkpoints have it.
    Ties and unseen tokens are filled in id order, so the result is deterministic.
    """
    size = min(size, vocab_size)
    counts = Counter(t for seq in sequences for t in seq)
    chosen = list(dict.fromkeys(list(always) + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]))
    chosen = chosen[:size]
    if len(chosen) < size:
        taken = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(sequences: list[list[int]], draft_ids: torch.Tensor) -> float:
    """Fraction of tokens in `sequences` that the draft vocabulary can express."""
    allowed = set(draft_ids.tolist())
    total = sum(len(s) for s in sequences)
    return sum(t in allowed for s in sequences for t in s) / max(total, 1)
