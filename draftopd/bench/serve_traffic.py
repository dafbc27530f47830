"""Traffic for the serving benches: the shifted prompt mix, OpenAI clients sending it, and the check that every
response equals the target's alone.

The shift (default): toy prompts rendered with thinking off (the chat template's empty think block), sent as
chat requests with vLLM's `chat_template_kwargs={"enable_thinking": false}`; the shipped toy EAGLE-3 drafter was
trained on responses that mostly think first. Another: long context (background text before each request).
Every request asks for its token ids (`return_token_ids`), so a response is checked token for token against the
native engine decoding the same prompt ids with the target alone at temperature 0 (tests/test_export_serving.py
checks that engine against vLLM without a drafter).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Reply:
    """One request's outcome. `error` is '' for a served request; the ids are the server's own (its rendering
    of the chat, its output tokens, the stop token included when it stopped on one)."""

    index: int
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    latency_s: float = 0.0
    completion_tokens: int = 0
    error: str = ""
    finished_at: float = 0.0


SHIFTS = ("thinking-off", "long-context")


def shifted_chats(
    n: int, seed: int, shift: str = "thinking-off", domain: str | None = None, tokenizer=None, split: str = "held_out"
) -> list:
    """`n` toy chats of `split` (the seed picks the draw; one domain or all) under a shift: `thinking-off` (the
    chats as they are, rendered with thinking off), or `long-context` (each request after ~384 tokens of
    background text, as `draftopd eval`'s long_context variant builds it; needs the tokenizer; thinking on).

    The split holds 589 held-out prompts at the corpus's default size (a few arithmetic ones twice). More requests
    than that (day 0 runs 2,000) are distinct prompts of a corpus whose arithmetic part grows until it holds `n`,
    so the mix leans further to arithmetic (`traffic_mix` says how far). Raises ValueError when one domain cannot
    hold `n`."""
    import json

    from draftopd.data.prompts import toy_prompts

    chats, num_arithmetic = toy_prompts(split, n, seed, domain), 4000
    while len(chats) < n and domain != "code" and num_arithmetic < 64000:
        num_arithmetic *= 2
        seen: set[str] = set()
        chats = []
        for chat in toy_prompts(split, 10**9, seed, domain, num_arithmetic):  # the first of each prompt, in order
            if len(chats) == n:
                break
            key = json.dumps(chat)
            if key not in seen:
                seen.add(key)
                chats.append(chat)
    if len(chats) < n:
        raise ValueError(f"the toy corpus's {split} split holds {len(chats)} prompts of that kind, not {n}")
    if shift == "long-context":
        from draftopd.eval.suite import first_turn, padding_text

        padding = padding_text(tokenizer, 384)
        chats = [first_turn("long_context", c, padding) for c in chats]
    elif shift != "thinking-off":
        raise ValueError(f"unknown shift {shift!r} (one of {', '.join(SHIFTS)})")
    return chats


def write_shift_prompts(path: Path, shift: str, tokenizer, num_train: int, num_eval: int, seed: int = 0) -> None:
    """The shift's prompts for an isolated baseline, as a prompt file with a split per line: `num_train` chats of
    the toy corpus's train split (never served: the bench's traffic is held-out) and `num_eval` held-out ones,
    each changed as the shift changes requests. The template flag is not in the file: `thinking(shift)` gives
    it."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for split, n in (("train", num_train), ("held_out", num_eval)):
            for chat in shifted_chats(n, seed, shift, tokenizer=tokenizer, split=split):
                f.write(json.dumps({"messages": chat, "split": split}) + "\n")


def traffic_mix(chats: list) -> dict[str, int]:
    """Requests per toy domain, read from each chat's last turn as the rejection explorer reads it."""
    from collections import Counter

    from draftopd.serve.records import traffic_domain

    return dict(Counter(traffic_domain(chat[-1]["content"]) for chat in chats))


def thinking(shift: str) -> bool:
    """The chat template's enable_thinking under a shift."""
    return shift != "thinking-off"


class ChatClient:
    """Chat requests through the `openai` client (one per thread), greedy, the template's thinking flag given,
    token ids returned."""

    def __init__(
        self,
        base_url: str,
        max_tokens: int,
        enable_thinking: bool = False,
        api_key: str = "none",
        timeout_s: float = 300.0,
    ):
        self.base_url, self.max_tokens = base_url.rstrip("/") + "/v1", max_tokens
        self.template = {"enable_thinking": enable_thinking}
        self.api_key, self.timeout_s = api_key, timeout_s
        self._local = threading.local()
        self.model = self._client().models.list().data[0].id

    def _client(self):
        if not hasattr(self._local, "client"):
            from openai import OpenAI

            # no retries: a failed request is counted, not hidden
            self._local.client = OpenAI(
                base_url=self.base_url, api_key=self.api_key, timeout=self.timeout_s, max_retries=0
            )
        return self._local.client

    def send(self, index: int, chat: list[dict]) -> Reply:
        t0 = time.perf_counter()
        try:
            resp = self._client().chat.completions.create(
                model=self.model,
                messages=chat,
                max_tokens=self.max_tokens,
                temperature=0.0,
                extra_body={"chat_template_kwargs": self.template, "return_token_ids": True},
            )
            choice = resp.choices[0]
            prompt_ids, output_ids = getattr(resp, "prompt_token_ids", None), getattr(choice, "token_ids", None)
            if prompt_ids is None or output_ids is None:
                raise ValueError("the response carries no token ids (return_token_ids)")
            tokens = resp.usage.completion_tokens if resp.usage is not None else len(output_ids)
            return Reply(
                index,
                list(prompt_ids),
                list(output_ids),
                time.perf_counter() - t0,
                tokens,
                finished_at=time.monotonic(),
            )
        except Exception as exc:  # a failure is data: counted and reported
            return Reply(
                index,
                latency_s=time.perf_counter() - t0,
                error=f"{type(exc).__name__}: {exc}"[:300],
                finished_at=time.monotonic(),
            )


def send_all(client: ChatClient, chats: list, concurrency: int, first_index: int = 0, pace=None) -> list[Reply]:
    """Send every chat, `concurrency` at a time (a client per thread); replies in the chats' order. `pace(i)`:
    the monotonic time request i may start at (None: at once)."""

    def send(i: int, chat: list[dict]) -> Reply:
        if pace is not None:
            time.sleep(max(0.0, pace(i) - time.monotonic()))
        return client.send(i, chat)

    with ThreadPoolExecutor(concurrency, thread_name_prefix="client") as pool:
        return list(pool.map(send, range(first_index, first_index + len(chats)), chats))


def send_for(client: ChatClient, chats: list, concurrency: int, duration_s: float) -> tuple[list[Reply], float]:
    """`concurrency` clients, each sending the chats in turn (cycling, from its own offset) back to back
    until `duration_s` has passed; requests in flight then finish. Returns the replies and the wall seconds
    from the first send to the last reply."""
    deadline = time.monotonic() + duration_s
    counter = iter(range(10**12))
    lock = threading.Lock()

    def loop(_):
        out = []
        while time.monotonic() < deadline:
            with lock:
                i = next(counter)
            out.append(client.send(i, chats[i % len(chats)]))
        return out

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency, thread_name_prefix="client") as pool:
        replies = [r for rs in pool.map(loop, range(concurrency)) for r in rs]
    end = max([r.finished_at for r in replies], default=t0)
    return sorted(replies, key=lambda r: r.index), end - t0


class Reference:
    """The target alone at temperature 0 (native engine, no drafter): its output for a prompt's ids, decoded in
    batches and kept by prompt."""

    def __init__(self, target, eos: list[int], max_new_tokens: int, batch_size: int = 16):
        from draftopd.engine.speculative import SpeculativeEngine
        from draftopd.messages import SamplingConfig

        self.engine = SpeculativeEngine(target, None, eos)
        self.cfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
        self.batch_size = batch_size
        self.outputs: dict[tuple[int, ...], list[int]] = {}

    def prepare(self, prompts: list[list[int]]) -> None:
        todo = list(dict.fromkeys(tuple(p) for p in prompts if tuple(p) not in self.outputs))
        for i in range(0, len(todo), self.batch_size):
            batch = todo[i : i + self.batch_size]
            for p, t in zip(batch, self.engine.generate([list(p) for p in batch], self.cfg)):
                self.outputs[p] = list(t.output_ids)

    def output(self, prompt_ids: list[int]) -> list[int]:
        self.prepare([prompt_ids])
        return self.outputs[tuple(prompt_ids)]


def lossless_check(
    replies: list[Reply], reference: Reference, expected_prompts: dict | None = None, keep: int = 5
) -> dict:
    """Every served reply against the target alone on the prompt ids the server used: the count of replies that
    differ, the first `keep` differences (where they part), and how many prompts the server rendered otherwise
    than the tokenizer's chat template here (`expected_prompts`: index -> ids; a rendering difference is not a
    losslessness failure, the output is still checked against the target on the server's prompt)."""
    served = [r for r in replies if not r.error]
    reference.prepare([r.prompt_ids for r in served])
    diffs, rendered_otherwise = [], 0
    for r in served:
        if expected_prompts is not None and expected_prompts.get(r.index) not in (None, r.prompt_ids):
            rendered_otherwise += 1
        want = reference.output(r.prompt_ids)
        if r.output_ids != want:
            at = next(
                (i for i, (a, b) in enumerate(zip(r.output_ids, want)) if a != b), min(len(r.output_ids), len(want))
            )
            diffs.append(
                {
                    "request": r.index,
                    "at_token": at,
                    "served": r.output_ids[at : at + 8],
                    "target_alone": want[at : at + 8],
                    "served_len": len(r.output_ids),
                    "target_len": len(want),
                }
            )
    return {
        "checked": len(served),
        "failures": len(diffs),
        "first": diffs[:keep],
        "prompts_rendered_otherwise": rendered_otherwise,
    }
