"""ResponseTap: every finished request's record, read from the outputs vLLM's engine hands its own OpenAI server.

Stock recording (`--record stock`, the default): vLLM's `AsyncLLM.generate`, which every route of vLLM's server
calls, is wrapped so that each output passes through unchanged, in order, to the route that asked for it (what a
client receives does not change), while the tap keeps what a trajectory needs: the prompt's and the output's token
ids (deltas joined when the route streams), the finish and stop reasons, vLLM's per-request detailed speculative
metrics (`per_step_accepted`, `per_step_drafted`), its weight-version spans (which drafter version drafted which
tokens), and the request's temperature, token budget and stop ids. The scheduler keeps those metrics, so nothing
runs inside vLLM's worker and vLLM picks its model runner. Requests that end without a final output (a client gone)
and those with n > 1 are not kept. The tap holds at most `capacity` finished records between two `take`s; when the
session falls behind, the oldest go first and are counted in `dropped`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

log = logging.getLogger(__name__)


class ResponseTap:
    def __init__(self, capacity: int = 4096):
        self._done: deque = deque()
        self.capacity = capacity
        self.dropped = 0  # finished records pushed out before the session took them
        self.errors = 0  # outputs the tap could not read (the request itself is unaffected)
        self._lock = threading.Lock()

    def install(self, engine) -> None:
        """Wrap `engine.generate` (vLLM's `AsyncLLM.generate`, an async generator of `RequestOutput`s)."""
        generate = engine.generate

        async def tapped(prompt, sampling_params, request_id, *args, **kwargs):
            reading = _Reading(sampling_params)
            async for out in generate(prompt, sampling_params, request_id, *args, **kwargs):
                reading.read(out, self)
                yield out
            reading.finish(self)

        engine.generate = tapped

    def take(self) -> list[dict]:
        """The finished records since the last take, oldest first."""
        with self._lock:
            done, self._done = list(self._done), deque()
        return done

    def _keep(self, record: dict) -> None:
        with self._lock:
            if len(self._done) >= self.capacity:
                self._done.popleft()
                self.dropped += 1
            self._done.append(record)


class _Reading:
    """One request's outputs as they pass: the token ids so far and, once it finished, its record."""

    def __init__(self, params):
        from vllm.sampling_params import RequestOutputKind

        self.params = params
        self.delta = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
        self.tokens: list[int] = []
        self.prompt: list[int] | None = None
        self.record: dict | None = None
        self.skip = getattr(params, "n", 1) != 1  # one record per request: its single sequence

    def read(self, out, tap: ResponseTap) -> None:
        if self.skip:
            return
        try:
            if self.prompt is None and out.prompt_token_ids is not None:
                self.prompt = list(out.prompt_token_ids)
            c = out.outputs[0]
            self.tokens = self.tokens + list(c.token_ids) if self.delta else list(c.token_ids)
            if out.finished:
                self.record = self._record(c)
        except Exception:  # reading is best effort: the output still goes to the client
            self.skip = True
            tap.errors += 1
            log.exception("draftopd: reading a request's output for its record failed (serving is unaffected)")

    def _record(self, c) -> dict:
        from draftopd.vllm_backend.steps import metrics_of

        p = self.params
        return {
            "prompt_ids": self.prompt or [],
            "output_ids": self.tokens,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason if isinstance(c.stop_reason, int) else None,
            "metrics": metrics_of(c),
            "versions": [span.version for span in (c.weight_versions or [])],
            "temperature": float(getattr(p, "temperature", 0.0) or 0.0),
            "max_tokens": getattr(p, "max_tokens", None),
            "stop_ids": sorted(getattr(p, "all_stop_token_ids", ()) or ()),
        }

    def finish(self, tap: ResponseTap) -> None:
        if self.record is not None and not self.skip:
            tap._keep(self.record)
