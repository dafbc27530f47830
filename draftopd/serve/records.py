"""From served requests' records to `Trajectory` records, traffic domains and live tau.

A record comes one of two ways, and either becomes one `Trajectory` with the offline engine's conventions
(`output_ids[0]` from the prefill, the last step's `emitted` cut where the output ended), checked by the same code
as the offline engine's records (`vllm_backend.steps`):

* `from_response` (stock recording, the default): what `tap.ResponseTap` read from the outputs vLLM's engine gave
  its server: the token ids as vLLM ended them, vLLM's per-request detailed speculative metrics and its
  weight-version spans (`stock_steps`: the accepted stream and live tau, no drafted-token scores);
* `from_hook` (`--record full`): the recording hook's records of a request vLLM's worker no longer holds
  (`draftopd_take_finished`), with the drafted tokens and both models' log-probs of them (`hook_steps`); the output
  cut at the first stop id and at max_tokens as vLLM cuts its response.

Plain functions and one small class: nothing here touches vLLM or the network, so the tests drive them with
hand-made records.

Live tau is vLLM's own convention, (accepted + steps) / steps: the mean tokens a verification step yields when
nothing is cut, the figure `vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts + 1` gives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from draftopd.messages import Trajectory

THINK_OFF = "<think>\n\n</think>"  # the empty think block hybrid-thinking chat templates add with thinking off


class RecordSkipped(ValueError):
    """A finished request whose records cannot make a trajectory (the reason says why); it is counted, not kept."""


@dataclass
class Finished:
    """One finished request as the server keeps it: its trajectory, traffic domain and acceptance counts.

    Invariant: `accepted` and `steps` are the sums over `trajectory.steps`; `mixed` is True when the request's
    steps were drafted by more than one drafter version (a swap happened while it ran): such a trajectory counts
    for no version's live tau and is not trained on (its draft log-probs come from two drafters)."""

    trajectory: Trajectory
    domain: str
    accepted: int
    steps: int
    mixed: bool = False


def cut_output(ids: list[int], stop_ids: list[int], max_tokens: int | None) -> tuple[list[int], str]:
    """The response's token ids as vLLM ends it: up to and with the first stop id, at most max_tokens; and why
    it ended ("stop", "length", or "abort" for a request ended early: a client gone, a stop string)."""
    out = list(ids)
    stop = next((i for i, t in enumerate(out) if t in set(stop_ids)), None)
    if stop is not None:
        out = out[: stop + 1]
    if max_tokens is not None and len(out) > max_tokens:
        out = out[:max_tokens]
    if out and stop is not None and len(out) == stop + 1:
        return out, "stop"
    return out, "length" if max_tokens is not None and len(out) == max_tokens else "abort"


def from_response(record: dict, start_version: int, num_draft_tokens: int, domain: str = "") -> Finished:
    """A `ResponseTap` record -> `Finished`; RecordSkipped when vLLM's metrics do not cover its output.

    `start_version` names the drafter vLLM started with (its tokens carry no weight-version label until a push)."""
    from draftopd.vllm_backend.steps import VllmRecordError, stock_steps

    output = list(record.get("output_ids") or [])
    stop = record.get("stop_reason")  # a stop id vLLM reports as the stop reason only is put back
    if record.get("finish_reason") == "stop" and isinstance(stop, int) and (not output or output[-1] != stop):
        output.append(stop)
    reason = record.get("finish_reason") or "abort"
    versions = {int(v) for v in record.get("versions") or [] if str(v).lstrip("-").isdigit()} or {start_version}
    traj = _trajectory(record, output, reason, versions, num_draft_tokens)
    try:
        traj.steps = stock_steps(traj, record.get("metrics"))
    except VllmRecordError as exc:
        raise RecordSkipped(str(exc)) from None
    return _finished(traj, domain, versions)


def from_hook(record: dict, start_version: int, num_draft_tokens: int, domain: str = "") -> Finished:
    """A `draftopd_take_finished` record -> `Finished`; RecordSkipped when its records do not cover its output.

    `start_version` names the drafter vLLM started with (the hook reports None until the first reload)."""
    from draftopd.vllm_backend.steps import HookStep, VllmRecordError, hook_steps

    steps = [HookStep.of(s) for s in record.get("steps") or []]
    output = record.get("output_ids")
    if output is None or any(t < 0 for t in output):  # no request state, or placeholders of async scheduling
        output = list(record.get("output_before") or []) + [t for s in steps for t in s.emitted]
    output, reason = cut_output(output, record.get("stop_ids") or [], record.get("max_tokens"))
    versions = {start_version if v is None else int(v) for v in record.get("versions") or [None]}
    traj = _trajectory(record, output, reason, versions, num_draft_tokens)
    if len(record.get("output_before") or []) != 1:  # the first step did not follow the prefill's token
        raise RecordSkipped(f"its first recorded step follows {len(record.get('output_before') or [])} tokens, not 1")
    try:
        traj.steps = hook_steps(traj, steps, None)
    except VllmRecordError as exc:
        raise RecordSkipped(str(exc)) from None
    return _finished(traj, domain, versions)


def _trajectory(record: dict, output: list[int], reason: str, versions: set, k: int) -> Trajectory:
    return Trajectory(
        prompt_ids=list(record.get("prompt_ids") or []),
        output_ids=output,
        finish_reason=reason,
        policy_version=max(versions),
        temperature=float(record.get("temperature", 0.0)),
        num_draft_tokens=k,
    )


def _finished(traj: Trajectory, domain: str, versions: set) -> Finished:
    accepted = sum(s.num_accepted for s in traj.steps)
    return Finished(traj, domain, accepted, len(traj.steps), mixed=len(versions) > 1)


def traffic_domain(prompt_text: str) -> str:
    """The rejection explorer's kind of domain, read from a prompt: the toy corpus's topic where it shows
    (`code`, `arithmetic`), else `other`; `/think-off` when the chat template's empty think block ends it."""
    text = prompt_text
    if "Write the Python function" in text:
        topic = "code"
    elif any(w in text for w in ("What is ", "Compute ", "Add ", "Multiply ", "How many ")):
        topic = "arithmetic"
    else:
        topic = "other"
    return f"{topic}/think-off" if text.rstrip().endswith(THINK_OFF) else topic


class Tally:
    """Accepted drafts and verification steps over requests; tau = (accepted + steps) / steps."""

    def __init__(self):
        self.accepted = self.steps = self.requests = 0

    def add(self, accepted: int, steps: int) -> None:
        self.accepted, self.steps, self.requests = self.accepted + accepted, self.steps + steps, self.requests + 1

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else float("nan")

    def row(self) -> dict:
        return {"tau": self.tau, "requests": self.requests, "steps": self.steps}


class LiveTau:
    """Live tau per drafter version and per traffic domain over the session, and over each version's last
    `window` requests (what automatic rollback compares)."""

    def __init__(self, window: int = 32):
        self.window = window
        self.versions: dict[int, Tally] = {}
        self.domains: dict[str, Tally] = {}
        self.recent: dict[int, deque] = {}

    def add(self, f: Finished) -> None:
        if f.steps == 0 or f.mixed:
            return
        v = f.trajectory.policy_version
        self.versions.setdefault(v, Tally()).add(f.accepted, f.steps)
        self.domains.setdefault(f.domain or "other", Tally()).add(f.accepted, f.steps)
        self.recent.setdefault(v, deque(maxlen=self.window)).append((f.accepted, f.steps))

    def recent_tau(self, version: int) -> tuple[float, int]:
        """(tau, requests) over the version's last `window` requests."""
        rows = self.recent.get(version, ())
        steps = sum(s for _, s in rows)
        return ((sum(a for a, _ in rows) + steps) / steps if steps else float("nan")), len(rows)

    def summary(self) -> dict:
        return {
            "live": {str(v): t.row() for v, t in sorted(self.versions.items())},
            "domains": {d: t.row() for d, t in sorted(self.domains.items())},
        }
