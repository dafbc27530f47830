"""What every drafter family provides to the engine, the trainers, the exporters and the serving backends.

A family is one module in `draftopd/drafters/` with a class that satisfies
`Drafter` and a `Proposer` it hands the engine for each decode call. The engine,
verification, step records, divergences, replay buffer and messages never look
inside a family: they speak to these two protocols only.

The training grid is shared by SFT and Draft-OPD replay: `score` returns
logits [B, D, n, Vd] where row t (0..n-1, n = sequence length - 1) and depth d
hold the drafter's prediction of token t + 2 + d when its context ends at token
t + 1 and its own drafts sit at t + 2 .. t + 1 + d. `depth_tokens[:, d, t]`
(d >= 1) names the draft fed at depth d (default: teacher-forced text), so
replaying a recorded step's drafts at its row reproduces the rollout exactly.
A family whose rows are independent (DFlash: one block per row) also takes
`rows` [B, R], the only rows to compute, and then returns [B, D, R, Vd]: SFT
scores a fresh random subset of rows each step this way (`sft.num_anchors`).
A family that trains more than one set of rows at those anchors (D²SD: its
variable-prefix drafter) also has `training_rows(rows, real, generator)`,
which names its `RowSet`s; the trainer scores each with the set's keyword
arguments and sums their losses.

A family whose proposer drafts several candidate rows per step (D²SD) gives a
`RowProposer`; the engine then verifies all rows in one target pass and
accepts along the first row that still agrees with the target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from draftopd.models.layers import at_least_fp32

# What a family reads from the target: `aux` = hidden states at `aux_layer_ids` (TargetOutput.aux_hidden).
TARGET_NEEDS = ("aux", "none")

Pick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""The engine's token choice from [B, Vd] logits: (choice [B], probabilities [B, Vd] or None when greedy)."""


def pick_block(logits: torch.Tensor, b: int, k: int, pick: Pick):
    """A one-pass proposer's return from logits [b * k, V] of all its drafts: (drafts [b, k], their
    distributions [b, k, V] or None, the drafter's log-probs of its drafts [b, k])."""
    choice, p = pick(logits)
    logps = torch.log_softmax(logits.to(at_least_fp32(logits.dtype)), -1).gather(1, choice[:, None])
    q = p.reshape(b, k, -1) if p is not None else None
    return choice.reshape(b, k), q, logps.reshape(b, k)


class Proposer(Protocol):
    """The drafter's inference state for one batch; rows follow the engine's shrinking batch."""

    def begin(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, first: torch.Tensor, out) -> None:
        """After the target's prefill of left-padded `ids` [B, L] (`out`: TargetOutput), with `first` [B] emitted."""

    def propose(self, k: int, pick: Pick) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """K drafts: target ids [B, K], probabilities over the target vocabulary [B, K, V] or None, log-probs [B, K]."""

    def commit(self, out, emitted: torch.Tensor, num_emitted: torch.Tensor, positions: torch.Tensor) -> None:
        """After verification of [pending, d_1..d_K] at `positions` [B, K+1]: the first `num_emitted` are committed."""

    def select(self, keep: torch.Tensor) -> None:
        """Keep only batch rows `keep` (finished rows retire)."""


class RowProposer(Proposer, Protocol):
    """A proposer of several candidate rows per step, all continuing the same pending token."""

    def propose_rows(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [B, R, K] of drafts (target ids, fixed before verification) and their drafter log-probs [B, R, K].

        The engine's `commit` then receives the winning row's target output, emitted tokens and positions."""


@dataclass
class RowSet:
    """Grid rows a family trains in one `score` call: rows [B, R], whether each is real [B, R], how many depths
    each row has (None: all; a row's depths d >= num_depths carry no loss) and `score`'s extra arguments."""

    rows: torch.Tensor
    real: torch.Tensor
    num_depths: torch.Tensor | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


class Drafter(Protocol):
    """A drafter family's model. Checkpoints are `config()` (config.json) + `state()` (model.safetensors)."""

    kind: ClassVar[str]
    needs: ClassVar[str]  # one of TARGET_NEEDS
    vocab_size: int
    aux_layer_ids: list[int]

    def draft_to_target_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft-vocabulary id."""

    def proposer(self) -> Proposer: ...

    def features(self, out) -> torch.Tensor | None:
        """What `score` reads from a TargetOutput of the whole sequence."""

    def score(self, input_ids, features, valid, depth: int, depth_tokens=None, rows=None) -> torch.Tensor:
        """Logits [B, D, n, Vd] on the shared (row, depth) grid; with `rows` [B, R], [B, D, R, Vd] (optional)."""

    scores_rows: ClassVar[bool]
    """Whether `score` takes `rows` and then computes those rows alone (its cost falls with them), the same rows in
    every batch row: Draft-OPD's replay then scores only the rows its loss weighs, not a long prompt's."""

    def config(self) -> dict[str, Any]: ...

    def state(self) -> dict[str, torch.Tensor]: ...

    @classmethod
    def from_state(cls, config: dict, state: dict[str, torch.Tensor], target) -> Drafter: ...

    learner_context: ClassVar[int]
    """Prompt tokens the serving fleet's learner keeps before a response (its last ones). A drafter that reads the
    target's states learns from a bounded window; one that reads nothing but its tokens (PARD) learns what a long
    prompt does to it only from the whole prompt, so its window is the serving length."""

    live_push: ClassVar[bool]
    """Whether a running vLLM engine takes this family's new weights in place (a push); otherwise a new engine."""

    @staticmethod
    def max_drafts(cfg) -> int | None:
        """The most drafts one step can hold (a block family: block_size - 1), None for any K. `cfg`: the recipe's
        drafter section or a built drafter; the config loader, the proposers and the benches all ask this."""

    @staticmethod
    def config_refusal(cfg) -> str:
        """Why a resolved recipe (the whole Config) cannot run with this family, in one line; '' when it can."""

    @staticmethod
    def speculative_config(path: str | Path, num_draft_tokens: int) -> dict:
        """vLLM's `speculative_config` serving an exported directory of this family."""

    @staticmethod
    def target_layers(config: dict) -> list[int]:
        """The target layers (this project's aux-id convention) a checkpoint's config.json says it reads: what
        its target must be loaded with; [] for the target's defaults."""
