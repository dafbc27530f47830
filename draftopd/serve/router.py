"""FleetRouter: the fleet's OpenAI ingress. It sends each request to a replica in rotation, hands the client vLLM's
own response, and keeps the request's record for the learner.

Records come from the responses: the router asks the replica for the token ids (`return_token_ids`) and, when
streaming, for the final usage chunk (`stream_options.include_usage`), which carry the prompt and output ids and
vLLM's per-request detailed spec-decode metrics; what the client did not ask for is taken out again, so an
OpenAI client sees the body and stream stock vLLM gives it, plus one header, `x-draftopd-drafter-version`, the
drafter version of the replica that served it. A record is labelled with that version when no push reached the
replica while the request ran (the replica's push count at start and end agree), else it is `mixed` (two
drafters drafted it: counted, never trained on). Records wait in a bounded queue that drops the oldest first and
counts what it dropped, so a slow or absent learner costs serving nothing.

Rotation: a replica serves only while `in_rotation`; the fleet takes one out to push to it (after its requests
in flight drain), when a push fails or times out, and when it dies, and puts it back once it serves the fleet's
version. A non-streamed request whose replica fails is sent to another (the client never sees the failure); a
streamed one that already sent tokens ends with an error event, which the OpenAI client raises. Every route
needs the fleet's key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

VERSION_HEADER = "x-draftopd-drafter-version"
ROUTES = ("/v1/completions", "/v1/chat/completions")


class RecordQueue:
    """Finished requests' records, oldest dropped first beyond `capacity` (counted in `dropped`)."""

    def __init__(self, capacity: int = 4096):
        self._items: deque = deque(maxlen=capacity)
        self.added = self.dropped = 0

    def put(self, record: dict) -> None:
        if len(self._items) == self._items.maxlen:
            self.dropped += 1
        self._items.append(record)
        self.added += 1

    def take(self, n: int | None = None) -> list[dict]:
        n = len(self._items) if n is None else min(n, len(self._items))
        return [self._items.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class Member:
    """One replica as the router sees it. `pushes` counts pushes begun on it (a request that saw it change was
    drafted by two versions)."""

    index: int
    url: str
    version: int
    in_rotation: bool = False
    inflight: int = 0
    pushes: int = 0
    served: int = 0
    state: str = "starting"  # starting, serving, syncing, out (a failed push), down (its process gone)
    why: str = ""


class FleetRouter:
    def __init__(self, api_key: str, capacity: int = 4096, connect_timeout_s: float = 5.0):
        self.key, self.records = api_key, RecordQueue(capacity)
        self.members: dict[int, Member] = {}
        self.counts = {"requests": 0, "retried": 0, "failed": 0, "stream_failed": 0, "unavailable": 0}
        self.connect_timeout_s = connect_timeout_s
        self.status_extra = lambda: {}  # the fleet adds its own fields to /draftopd/status
        self.control = None  # async (action, body) -> (status code, dict): the fleet's /draftopd/* actions
        self._client = None
        self._next = 0

    # -- membership, from the fleet ----------------------------------------------------------------------

    def join(self, index: int, url: str, version: int) -> None:
        """Replica `index` at `url` is known, not yet in rotation (it starts, or is synced first)."""
        m = self.members.get(index)
        if m is None or m.url != url:
            self.members[index] = Member(index, url, version)

    def admit(self, index: int, url: str, version: int) -> None:
        """Replica `index` at `url` serves `version`: into rotation."""
        self.join(index, url, version)
        m = self.members[index]
        m.version, m.in_rotation, m.state, m.why = version, True, "serving", ""

    def hold(self, index: int, state: str, why: str = "") -> None:
        """Out of rotation (`state`: syncing, out, down, starting), with the reason shown in the status."""
        m = self.members.get(index)
        if m is not None:
            m.in_rotation, m.state, m.why = False, state, why

    def begin_push(self, index: int) -> None:
        self.members[index].pushes += 1

    async def drain(self, index: int, timeout_s: float) -> bool:
        """Wait until replica `index` has no request in flight (it is out of rotation already); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.members[index].inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.members[index].inflight

    def pick(self, exclude: set) -> Member | None:
        """The member in rotation with the fewest requests in flight (ties in turn)."""
        ready = [m for m in self.members.values() if m.in_rotation and m.index not in exclude]
        if not ready:
            return None
        self._next += 1
        return min(ready, key=lambda m: (m.inflight, (m.index - self._next) % (len(self.members) or 1)))

    def status(self) -> dict:
        replicas = [
            {k: getattr(m, k) for k in ("index", "version", "state", "in_rotation", "inflight", "served", "why")}
            for m in sorted(self.members.values(), key=lambda m: m.index)
        ]
        queue = {"queued": len(self.records), "added": self.records.added, "dropped": self.records.dropped}
        return {"replicas": replicas, "requests": dict(self.counts), "records": queue, **self.status_extra()}

    # -- the app ----------------------------------------------------------------------------------------

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        routes = [Route(p, self._generate, methods=["POST"]) for p in ROUTES]
        routes += [Route("/v1/models", self._models, methods=["GET"])]
        routes += [Route("/draftopd/status", self._status, methods=["GET"])]
        routes += [Route("/draftopd/{action}", self._control, methods=["POST"])]
        routes += [Route("/health", self._health, methods=["GET"])]
        routes += [Route("/metrics", self._metrics, methods=["GET"])]
        return Starlette(routes=routes, lifespan=self._lifespan)

    def _allowed(self, request) -> bool:
        got = request.headers.get("authorization", "")
        return bool(self.key) and hmac.compare_digest(got.encode(), f"Bearer {self.key}".encode())

    def _denied(self):
        from starlette.responses import JSONResponse

        return JSONResponse({"error": "Unauthorized"}, status_code=401)

    def client(self):
        import httpx

        if self._client is None:
            timeout = httpx.Timeout(None, connect=self.connect_timeout_s)
            self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=256))
        return self._client

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _health(self, request):
        from starlette.responses import JSONResponse

        up = sum(m.in_rotation for m in self.members.values())
        return JSONResponse({"replicas_in_rotation": up}, status_code=200 if up else 503)

    async def _status(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse(self.status()) if self._allowed(request) else self._denied()

    async def _control(self, request):
        from starlette.responses import JSONResponse

        if not self._allowed(request):
            return self._denied()
        if self.control is None:
            return JSONResponse({"error": "no fleet behind this router"}, status_code=404)
        body = await request.json() if await request.body() else {}
        code, out = await self.control(request.path_params["action"], body)
        return JSONResponse(out, status_code=code)

    async def _metrics(self, request):
        """Every replica's Prometheus metrics in one scrape, each sample labelled `replica="i"` (a replica that
        restarted starts its counters again from zero: per replica, a scraper sees the reset)."""
        from starlette.responses import PlainTextResponse

        if not self._allowed(request):
            return self._denied()
        members = sorted((m for m in self.members.values() if m.state != "starting"), key=lambda m: m.index)
        got = await asyncio.gather(
            *(self.client().get(m.url + "/metrics", headers=self._headers()) for m in members), return_exceptions=True
        )
        texts = [
            (f'replica="{m.index}"', r.text)
            for m, r in zip(members, got)
            if not isinstance(r, BaseException) and r.status_code == 200
        ]
        return PlainTextResponse(merge_metrics(texts), media_type="text/plain; version=0.0.4")

    async def _models(self, request):
        from starlette.responses import JSONResponse

        if not self._allowed(request):
            return self._denied()
        m = self.pick(set())
        if m is None:
            return _unavailable()
        r = await self.client().get(m.url + "/v1/models", headers=self._headers())
        return JSONResponse(r.json(), status_code=r.status_code)

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}

    async def _generate(self, request):
        import httpx

        if not self._allowed(request):
            return self._denied()
        body = await request.json()
        self.counts["requests"] += 1
        wants = Wants.of(body)
        sent = {**body, "return_token_ids": True}
        if wants.stream:
            sent["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        tried: set[int] = set()
        while True:
            m = self.pick(tried)
            if m is None:
                self.counts["unavailable" if not tried else "failed"] += 1
                return _unavailable()
            tried.add(m.index)
            m.inflight += 1
            pushes = m.pushes
            try:
                if wants.stream:
                    return await self._stream(m, request.url.path, sent, wants, pushes)
                return await self._unary(m, request.url.path, sent, wants, pushes)
            except (httpx.TransportError, ReplicaGone) as exc:
                self.hold(m.index, "down", f"{type(exc).__name__}: {exc}"[:200])
                self.counts["retried"] += 1
                log.warning("draftopd fleet: replica %d failed a request (%s); sent to another", m.index, exc)
            finally:
                if not wants.stream:
                    m.inflight -= 1

    async def _unary(self, m: Member, path: str, sent: dict, wants: Wants, pushes: int):
        from starlette.responses import JSONResponse

        r = await self.client().post(m.url + path, content=json.dumps(sent), headers=self._headers())
        if r.status_code >= 500:
            raise ReplicaGone(f"answered {r.status_code}")
        out = r.json()
        if r.status_code == 200:
            m.served += 1
            self._keep(out, sent, m, pushes, chat=path.endswith("chat/completions"))
            wants.strip(out)
        return JSONResponse(out, status_code=r.status_code, headers={VERSION_HEADER: str(m.version)})

    async def _stream(self, m: Member, path: str, sent: dict, wants: Wants, pushes: int):
        """Opens the replica's stream before answering (a replica that cannot start one is retried elsewhere),
        then relays it chunk by chunk."""
        from starlette.responses import JSONResponse, StreamingResponse

        client = self.client()
        req = client.build_request("POST", m.url + path, content=json.dumps(sent), headers=self._headers())
        try:
            resp = await client.send(req, stream=True)
        except BaseException:
            m.inflight -= 1
            raise
        if resp.status_code != 200:
            raw = await resp.aread()
            await resp.aclose()
            m.inflight -= 1
            if resp.status_code >= 500:
                raise ReplicaGone(f"answered {resp.status_code}")
            return JSONResponse(json.loads(raw or b"{}"), status_code=resp.status_code)
        version = m.version
        relay = self._relay(m, resp, sent, wants, pushes, chat=path.endswith("chat/completions"))
        return StreamingResponse(relay, media_type="text/event-stream", headers={VERSION_HEADER: str(version)})

    async def _relay(self, m: Member, resp, sent: dict, wants: Wants, pushes: int, chat: bool):
        import httpx

        got, held = StreamRecord(), None
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    if held is not None:
                        yield _event(held)
                    if got.finished:
                        m.served += 1
                        self._keep(got.response(), sent, m, pushes, chat)
                    yield "data: [DONE]\n\n"
                    return
                chunk = json.loads(data)
                got.add(chunk)
                wants.strip(chunk)
                if wants.usage:
                    yield _event(chunk)
                elif not chunk.get("choices"):  # the usage chunk asked for the records: its fingerprint is the
                    if held is not None:  # one stock vLLM puts on the last chunk when usage is not asked for
                        held["system_fingerprint"] = chunk.get("system_fingerprint")
                else:
                    if held is not None:
                        yield _event(held)
                    held = chunk if any(c.get("finish_reason") for c in chunk["choices"]) else None
                    if held is None:
                        yield _event(chunk)
            raise ReplicaGone("the stream ended without [DONE]")
        except (httpx.TransportError, ReplicaGone) as exc:  # tokens went out already: fail the stream cleanly
            self.counts["stream_failed"] += 1
            self.hold(m.index, "down", f"{type(exc).__name__}: {exc}"[:200])
            error = {"error": {"message": f"the replica serving this stream failed: {exc}", "type": "server_error"}}
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            m.inflight -= 1
            await resp.aclose()

    def _keep(self, out: dict, sent: dict, m: Member, pushes: int, chat: bool) -> None:
        """The record of a finished response (one choice only: n > 1 is served, not recorded)."""
        choices = out.get("choices") or []
        if len(choices) != 1 or sent.get("n", 1) != 1:
            return
        c = choices[0]
        prompt = out.get("prompt_token_ids") if chat else c.get("prompt_token_ids")
        spec = ((out.get("metrics") or {}).get("speculative_decoding")) or None
        mixed = m.pushes != pushes
        self.records.put(
            {
                "prompt_ids": list(prompt or []),
                "output_ids": list(c.get("token_ids") or []),
                "finish_reason": c.get("finish_reason"),
                "stop_reason": c.get("stop_reason") if isinstance(c.get("stop_reason"), int) else None,
                "metrics": spec,
                "versions": [m.version, -1] if mixed else [m.version],
                "mixed": mixed,
                "temperature": float(sent.get("temperature", 1.0) if sent.get("temperature") is not None else 1.0),
                "max_tokens": sent.get("max_tokens") or sent.get("max_completion_tokens"),
                "replica": m.index,
                "time": time.time(),
            }
        )


class ReplicaGone(RuntimeError):
    """A replica that answered with a server error or ended a stream early."""


@dataclass
class Wants:
    """What the client asked for of what the router always asks the replica for."""

    stream: bool
    token_ids: bool
    usage: bool

    @classmethod
    def of(cls, body: dict) -> Wants:
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return cls(bool(body.get("stream")), bool(body.get("return_token_ids")), usage)

    def strip(self, obj: dict) -> None:
        """Token ids out again when the client did not ask (vLLM then sends them as null)."""
        if self.token_ids:
            return
        if "prompt_token_ids" in obj:
            obj["prompt_token_ids"] = None
        for c in obj.get("choices") or []:
            for key in ("token_ids", "prompt_token_ids"):
                if key in c:
                    c[key] = None
            delta = c.get("delta")
            if isinstance(delta, dict) and "token_ids" in delta:
                del delta["token_ids"]


class StreamRecord:
    """A streamed response gathered into the unary response's shape (one choice)."""

    def __init__(self):
        self.prompt: list[int] | None = None
        self.tokens: list[int] = []
        self.finish = self.stop = self.metrics = None
        self.finished = False

    def add(self, chunk: dict) -> None:
        if chunk.get("prompt_token_ids") is not None and self.prompt is None:
            self.prompt = list(chunk["prompt_token_ids"])
        for c in chunk.get("choices") or []:
            if c.get("prompt_token_ids") is not None and self.prompt is None:
                self.prompt = list(c["prompt_token_ids"])
            ids = c.get("token_ids")
            if ids is None and isinstance(c.get("delta"), dict):
                ids = c["delta"].get("token_ids")
            self.tokens += list(ids or [])
            if c.get("finish_reason") is not None:
                self.finish, self.stop, self.finished = c["finish_reason"], c.get("stop_reason"), True
        if chunk.get("metrics"):
            self.metrics = chunk["metrics"]

    def response(self) -> dict:
        choice = {"token_ids": self.tokens, "finish_reason": self.finish, "stop_reason": self.stop}
        choice["prompt_token_ids"] = self.prompt
        return {"choices": [choice], "prompt_token_ids": self.prompt, "metrics": self.metrics}


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Prometheus texts, one per (label, text), as one: every sample gets its text's label and each family's
    samples stay together under its HELP and TYPE lines (written once), as the text format wants."""
    families: dict[str, dict] = {}
    for label, text in texts:
        fam = families.setdefault("", {"head": [], "samples": []})  # samples before any header
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    fam = families.setdefault(parts[2], {"head": [], "samples": []})
                    if not any(h.split(" ", 2)[1] == parts[1] for h in fam["head"]):
                        fam["head"].append(line)
            elif line:
                name, brace, rest = line.partition("{")
                if not brace:
                    name, _, value = line.partition(" ")
                    rest = f"}} {value}"
                fam["samples"].append(f"{name}{{{label}{'' if rest.startswith('}') else ','}{rest}")
    out = [line for fam in families.values() for line in fam["head"] + fam["samples"]]
    return "\n".join(out) + "\n" if out else ""


def _event(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


def _unavailable():
    from starlette.responses import JSONResponse

    error = {"message": "no replica is in rotation", "type": "service_unavailable", "code": 503}
    return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "1"})
