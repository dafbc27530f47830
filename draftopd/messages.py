"""Typed records that cross role boundaries: verification steps, trajectories, error states, weight updates.

These are what Draft-OPD learns from: every verification step of a
target-assisted rollout exposes where the drafter was wrong. They are plain
dataclasses of Python ints/floats/lists, so they pickle cheaply through Ray and
serialise to JSON lines.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SamplingConfig:
    """How to decode: temperature 0 is greedy; K drafts per verification step."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    num_draft_tokens: int = 4
    seed: int = 0


@dataclass
class VerificationStep:
    """One draft-then-verify step of one sequence.

    Invariants:
    * `position` is the absolute index (prompt + response) of the first drafted
      token; the block's anchor (the last committed token, fed to the target with
      the drafts) sits at `position - 1`;
    * `draft_tokens`, `draft_logprobs` and `target_logprobs` all have length K (a `scored` step's; see below);
      the log-probs are raw log-softmax values (temperature 1) of the drafter and
      the target for each drafted token, the target's conditioned on the anchor
      and the drafts before it (so entries past the first rejection are
      conditioned on the drafter's own rejected prefix);
    * `0 <= num_accepted <= K`; the first `num_accepted` drafts were accepted,
      draft `num_accepted` (0-based) is the rejection position when
      `num_accepted < K`;
    * `emitted` = accepted drafts + the correction or bonus token, i.e.
      `num_accepted + 1` tokens, fewer only when the sequence ended inside this
      step (end-of-sequence or the token budget);
    * `row` is the candidate row the drafts come from when the drafter proposed
      several (D²SD: 0 is the first drafter's block, j >= 1 the j-th re-drafted
      row); the fields above describe that row, which gave the `emitted` tokens.
      0 for single-row families;
    * `target_draft_logz`, when recorded, has length K: entry d is the log of the target's total probability
      (temperature 1, the same context as `target_logprobs[d]`) over the drafter's draft vocabulary,
      logsumexp(log_softmax(target logits)[draft-vocabulary ids]); 0.0 where the draft vocabulary is the
      target's. `target_logprobs[d] - target_draft_logz[d]` is then the target's log-prob of draft d restricted
      to the draft vocabulary, what the rejected stream's k3 compares the drafter with, without another target
      pass. Empty: not recorded (records made before it, or by a backend that does not record it).
    * `scored` is False for a step read from vLLM's per-request metrics (stock recording, which sees the
      scheduler's accepted and drafted counts and the emitted tokens, nothing more): `draft_tokens` still has
      one entry per draft (so `num_drafted` and `rejected` hold), the accepted ones where the output shows them
      and -1 for the rest; `draft_logprobs`, `target_logprobs` and `target_draft_logz` are empty. Such a step
      feeds the accepted stream only (no rejected-stream token can be scored from it).
    """

    position: int
    draft_tokens: list[int]
    draft_logprobs: list[float]
    target_logprobs: list[float]
    num_accepted: int
    emitted: list[int]
    row: int = 0
    target_draft_logz: list[float] = field(default_factory=list)
    scored: bool = True

    @property
    def num_drafted(self) -> int:
        return len(self.draft_tokens)

    @property
    def rejected(self) -> bool:
        return self.num_accepted < len(self.draft_tokens)


@dataclass
class Trajectory:
    """One generated sequence with its verification records.

    Invariants: `output_ids[0]` comes from the target's prefill; the
    concatenation of `steps[i].emitted` equals `output_ids[1:]`; every step was
    drafted by the drafter of `policy_version` (-1: no drafter, target alone).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    steps: list[VerificationStep] = field(default_factory=list)
    finish_reason: str = "length"
    policy_version: int = -1
    temperature: float = 0.0
    num_draft_tokens: int = 0
    prompt_index: int = -1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        d = dict(d)
        d["steps"] = [VerificationStep(**s) for s in d.get("steps", [])]
        return cls(**d)

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class ErrorState:
    """A verification step worth replaying, with the trajectory that gives its context.

    Invariants: `trajectory.steps[step_index]` is the step; its prefix is
    `trajectory.full_ids[: step.position]` (the anchor is the last token of it);
    the rejected draft block is `step.draft_tokens[step.num_accepted:]` with the
    target's log-probs `step.target_logprobs[step.num_accepted:]`; the accepted
    stream around it is the rest of `trajectory.output_ids`. `policy_version` is
    the drafter version that drafted it; `weight` is its sampling weight (> 0).
    """

    trajectory: Trajectory
    step_index: int
    policy_version: int
    weight: float = 1.0

    @property
    def step(self) -> VerificationStep:
        return self.trajectory.steps[self.step_index]


@dataclass
class WeightUpdate:
    """The drafter a rollout worker must generate with: what every generate call carries.

    Invariants: `policy_version` counts learner steps (0 is the starting drafter)
    and only grows within a run; `drafter_config` is the drafter's config.json
    dict; exactly one of `state_ref` (a Ray object reference to the weights as tensors,
    the object-store transport) and `group` (the collective group the weights
    were broadcast over) is set. A worker that holds `policy_version` already
    ignores the rest; one that does not fetches `state_ref`, or, with only a
    `group`, refuses (it was restarted after the broadcast).
    """

    policy_version: int
    drafter_config: dict
    state_ref: Any = None
    group: str = ""
