"""vLLM's records of a request -> `VerificationStep`s, with the native engine's conventions, in two ways.

* `stock_steps`: from vLLM's own per-request detailed speculative-decoding metrics
  (`per_request_spec_decode_metrics="detailed"`: `per_step_accepted`, `per_step_drafted`,
  `vllm/v1/metrics/stats.py::RequestSpecDecodeMetrics`) and the emitted tokens. The scheduler keeps
  them, so they are the same on either model runner and for every speculative method; they give each
  step's boundaries, accepted tokens and number of drafts, which is all the accepted stream of Draft-OPD
  (and live tau) needs. The steps are marked `scored=False` (messages.py).
* `hook_steps`: from the recording hook's `HookStep`s (hook.py, opt-in `rollout.record: full`), which also
  carry the drafted tokens and both models' log-probs of them: what the rejected stream needs.

Both cut the last step's `emitted` where the output ended (end-of-sequence or the token budget) and refuse,
with `VllmRecordError`, records that do not cover the output. Nothing here imports vLLM: the records arrive as
plain values, so the tests drive these functions with hand-made ones too.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftopd.messages import Trajectory, VerificationStep

UNKNOWN = -1  # a draft token that stock records do not show (a rejected draft, or one past the output's end)


class VllmRecordError(RuntimeError):
    """vLLM's per-request metrics and the tokens (or the hook's records) disagree: the records cannot be trusted."""


@dataclass
class HookStep:
    """One verification step as the recording hook saw it in vLLM's worker, for one request.

    Invariants: `drafts`, `target_logprobs` and `target_logz` have one entry per draft the scheduler sent
    (NaN where a request ended with drafts in flight); `draft_logprobs` has as many, or is None when the
    drafter's logits could not be read for this step (the engine then refuses the records); `emitted` are the
    tokens the rejection sampler emitted (placeholders removed), `num_accepted = len(emitted) - 1`.
    """

    drafts: list[int]
    target_logprobs: list[float]
    draft_logprobs: list[float] | None
    num_accepted: int
    emitted: list[int]
    target_logz: list[float]

    @classmethod
    def of(cls, value) -> HookStep:
        """A HookStep from what crossed vLLM's RPC: vLLM's serialiser sends a dataclass as its fields' dict."""
        return value if isinstance(value, cls) else cls(**value)


def stock_steps(traj: Trajectory, metrics: dict | None) -> list[VerificationStep]:
    """Steps from vLLM's per-request metrics and the trajectory's tokens (`output_ids[0]` is the prefill's)."""
    if len(traj.output_ids) <= 1:  # the prefill's token alone: no verification step
        return []
    if not metrics or "per_step_accepted" not in metrics or "per_step_drafted" not in metrics:
        raise VllmRecordError("vLLM returned no per-request detailed speculative metrics for this request")
    accepted, drafted = list(metrics["per_step_accepted"]), list(metrics["per_step_drafted"])
    if len(accepted) != len(drafted):
        raise VllmRecordError(f"{len(accepted)} accepted counts for {len(drafted)} drafted counts")
    steps, cursor, out = [], 1, traj.output_ids
    for a, k in zip(accepted, drafted):
        if k == 0:  # a step that verified no drafts (none were scheduled): not a verification step
            continue
        if not 0 <= a <= k:
            raise VllmRecordError(f"a step accepted {a} of {k} drafts")
        if cursor >= len(out):
            break
        emitted = out[cursor : cursor + a + 1]
        known = emitted[:a] + [UNKNOWN] * (a - len(emitted[:a]))
        drafts = known + [UNKNOWN] * (k - a)
        steps.append(VerificationStep(len(traj.prompt_ids) + cursor, drafts, [], [], a, emitted, scored=False))
        cursor += len(emitted)
    if cursor != len(out) and len(out) > 1:
        raise VllmRecordError(f"vLLM's metrics cover {cursor} of {len(out)} output tokens")
    return steps


def hook_steps(traj: Trajectory, records: list[HookStep], metrics: dict | None) -> list[VerificationStep]:
    """The hook's steps -> VerificationSteps, `emitted` cut where the output ended; checked against vLLM's
    per-request metrics when given."""
    steps, cursor, out = [], 1, traj.output_ids
    for r in map(HookStep.of, records):
        if cursor >= len(out):
            break
        emitted = r.emitted[: len(out) - cursor]
        if out[cursor : cursor + len(emitted)] != emitted:
            raise VllmRecordError(
                f"recorded tokens {emitted} are not the output's {out[cursor : cursor + len(emitted)]}"
            )
        if r.draft_logprobs is None or len(r.draft_logprobs) != len(r.drafts):  # drafter logits not read
            raise VllmRecordError(f"no drafter log-probs recorded for the drafts {r.drafts}")
        position = len(traj.prompt_ids) + cursor
        steps.append(
            VerificationStep(
                position,
                r.drafts,
                r.draft_logprobs,
                r.target_logprobs,
                r.num_accepted,
                emitted,
                target_draft_logz=r.target_logz,
            )
        )
        cursor += len(emitted)
    if cursor != len(out) and len(out) > 1:
        raise VllmRecordError(f"records cover {cursor} of {len(out)} output tokens")
    if metrics and "per_step_accepted" in metrics:
        ours = [s.num_accepted for s in steps]
        if ours != list(metrics["per_step_accepted"][: len(ours)]):
            raise VllmRecordError(f"accepted counts {ours} differ from vLLM's {metrics['per_step_accepted']}")
    return steps


def metrics_of(completion) -> dict | None:
    """vLLM's per-request speculative metrics as a dict, from a `CompletionOutput` (vllm/outputs.py)."""
    m = getattr(completion, "spec_decode_metrics", None)
    if m is None:
        return None
    return m if isinstance(m, dict) else getattr(m, "__dict__", None)
