"""Weight-sync groups that fail cleanly, and rendezvous on rank 0's node.

A rollout worker killed in the middle of a collective broadcast (gloo here; NCCL runs the same code with its
own timeout) ends the publish with one error naming the group and the members that failed, within the group's
timeout, and the next publish forms a new group with the restarted worker. DeepSpeed's MASTER_ADDR/PORT come
from learner rank 0 itself, not from the driver's host.
"""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "toy-opd.yaml"


def _in_thread(fn, seconds: float):
    """fn() with a deadline: its result, or its exception, or a failure (not a hang) when it runs past `seconds`."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds} s: a sync that cannot fail cleanly hangs")
    return out, time.monotonic() - t0


@pytest.mark.parametrize("tiny_pair", ["eagle3"], indirect=True)
def test_a_worker_killed_mid_broadcast_fails_the_sync_and_a_new_group_heals_it(ray_session, sync_actors):
    from draftopd.opd.runtime import RayRuntime
    from draftopd.opd.weight_sync import CollectiveSync, WeightSyncError

    learner, workers = sync_actors  # started: joins are quick
    timeout_s = 8.0
    sync = CollectiveSync(RayRuntime(), "gloo", timeout_s=timeout_s)
    config = ray_session.get(learner.drafter_config.remote())
    sync.publish([learner], workers, config, 0)
    first_group = sync.group

    pid = ray_session.get(workers[1].pid.remote())

    class KillMidBroadcast(RayRuntime):
        """Real Ray; once the driver has checked the group, worker 1 freezes (rank 0's broadcast then waits on
        it), and a second after the driver starts waiting on the broadcast, worker 1 is killed."""

        def __init__(self):
            super().__init__()
            self.stage, self.get, self.wait = "check", self._get, self._wait  # RayRuntime binds Ray's own

        def _get(self, refs, timeout=None):
            values = ray_session.get(refs, timeout=timeout)
            if self.stage == "check":
                self.stage = "broadcast"
                os.kill(pid, signal.SIGSTOP)
            return values

        def _wait(self, refs, num_returns=1, timeout=None):
            if self.stage == "broadcast":
                self.stage = "killed"
                time.sleep(1.0)
                os.kill(pid, signal.SIGKILL)
            return ray_session.wait(refs, num_returns=num_returns, timeout=timeout)

    sync.rt = KillMidBroadcast()

    def publish():
        return sync.publish([learner], workers, config, 1)

    result, seconds = _in_thread(publish, timeout_s + 30)
    assert "error" in result, result
    err = result["error"]
    assert isinstance(err, WeightSyncError), repr(err)
    message = str(err)
    assert first_group in message and "rollout worker 1" in message and "learner rank 0" in message, message
    assert "\n" not in message
    assert sync.rt.stage == "killed" and seconds < timeout_s, seconds
    sync.rt = RayRuntime()

    # The restart path: the next publish forms a new group (the old one closed on every member), and it works.
    update, seconds = _in_thread(lambda: sync.publish([learner], workers, config, 1), 120)
    assert "error" not in update, update.get("error")
    assert sync.group not in ("", first_group) and update["value"].group == sync.group
    assert ray_session.get(workers[1].pid.remote()) != pid
    want = ray_session.get(learner.weights.remote())
    for got in ray_session.get([w.weights.remote() for w in workers]):
        assert all(torch.equal(want[k], got[k].to(want[k].dtype)) for k in want)


def test_deepspeed_rendezvous_comes_from_rank_0(tmp_path):
    """The driver receives MASTER_ADDR and MASTER_PORT from learner rank 0 (a port free on its node) and sets the
    ranks up with them; it no longer picks the port on its own host. Every role in this process (`ray.in_process`)."""
    from types import SimpleNamespace

    from draftopd.config import load_config
    from draftopd.loading import ASSETS
    from draftopd.opd.runtime import InProcessRuntime
    from draftopd.opd.session import DriverState, Session

    received = []
    cfg = load_config(RECIPE, ["ray.in_process=true", "learner.num_learners=1"])
    s = SimpleNamespace(cfg=cfg, rt=InProcessRuntime(observe=received.append), state=DriverState())
    s._learners_get = lambda *a: Session._learners_get(s, *a)
    saved = dict(os.environ)
    try:
        Session.place_learners(s, init_path=str(ASSETS / "toy-eagle3"))
        rank0 = s.learners[0].obj
        host, port = rank0.master
        assert (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])) == (host, port)
        assert host == rank0.node_ip()
        # what the driver received from the roles: rank 0's answer is the rendezvous, the port included
        answers = [a for v in received for a in (v if isinstance(v, list) else [v])]  # `get` of a list: a list
        assert (host, port) in [tuple(a) for a in answers if isinstance(a, tuple)], received
    finally:
        Session.close(SimpleNamespace(rt=s.rt, learners=getattr(s, "learners", [])))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def test_vllm_rollouts_need_a_family_that_takes_pushes_and_full_records_for_the_rejected_stream():
    """Draft-OPD with vLLM rollouts, CPU or GPU: every family that takes live pushes into vLLM is accepted; the
    rejected stream (rej_coef > 0) needs rollout.record=full; each refusal is one line naming the fix."""
    from draftopd.config import ConfigError, load_config

    for recipe in ("toy-dflash-opd.yaml", "toy-opd.yaml"):  # PARD's own refusal: test_pard.py
        for layout in ([], ["sync.backend=gloo"], ["sync.backend=nccl", "rollout.num_gpus_per_worker=1"]):
            cfg = load_config(RECIPE.parent / recipe, ["rollout.backend=vllm", "learner.rej_coef=0", *layout])
            assert cfg.rollout.backend == "vllm" and cfg.rollout.record == "stock"
    with pytest.raises(ConfigError, match="rollout.record=full") as err:
        load_config(RECIPE.parent / "toy-opd.yaml", ["rollout.backend=vllm", "learner.rej_coef=1"])
    assert "\n" not in str(err.value)
    cfg = load_config(
        RECIPE.parent / "toy-opd.yaml", ["rollout.backend=vllm", "learner.rej_coef=1", "rollout.record=full"]
    )
    assert cfg.learner.rej_coef == 1
    with pytest.raises(ConfigError, match="rollout.record"):
        load_config(RECIPE.parent / "toy-opd.yaml", ["rollout.record=partial"])


def test_a_vllm_transfer_join_only_joins():
    """vLLM's trainer rendezvous waits five minutes at most for every member, so a join never starts an engine:
    the engine is started and warmed up by `prepare_transfer` before the group forms, and a join without one is
    refused at once (before any rendezvous)."""
    pytest.importorskip("vllm")
    from draftopd.loading import ASSETS
    from draftopd.vllm_backend.rollout import VllmOptions, VllmRollout

    rollout = VllmRollout(str(ASSETS / "toy-target"), [1], VllmOptions())
    with pytest.raises(RuntimeError, match="prepare_transfer comes before a join"):
        rollout.join_transfer("weights-0", "127.0.0.1", 1, 1, 2, 5.0, {"architectures": []}, [])
    assert rollout.engine is None and rollout.transfer == ""


def _needs_two_gpus():
    if torch.cuda.device_count() < 2:  # NCCL refuses two ranks on one GPU
        pytest.skip("a GPU push needs two GPUs: learner rank 0's and the vLLM rollout worker's")
    pytest.importorskip("vllm")


@pytest.mark.gpu
def test_gpu_pushes_go_through_vllms_weight_transfer_engine(ray_session):
    """Learner rank 0 (GPU) pushes by NCCL into a vLLM rollout worker's draft model (GPU): the engine drafts with
    what was pushed (its records equal the native engine's with the learner's weights), and the rollout actor
    itself never opened a CUDA context."""
    from draftopd.config import DrafterConfig
    from draftopd.drafters import family
    from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
    from draftopd.loading import ASSETS, load_target
    from draftopd.opd.learner import DraftLearner, LearnerSpec
    from draftopd.opd.rollout import RolloutWorker
    from draftopd.opd.runtime import RayRuntime
    from draftopd.opd.weight_sync import CollectiveSync
    from draftopd.sft.trainer import SFTExample
    from draftopd.vllm_backend.rollout import VllmOptions

    _needs_two_gpus()
    aux, k = [1, 2, 3], 4
    spec = LearnerSpec("toy", aux, "float32", DrafterConfig(kind="eagle3"), str(ASSETS / "toy-eagle3"))
    learner = ray_session.remote(DraftLearner).options(num_cpus=0.5, num_gpus=1).remote(spec, 0, 1, "127.0.0.1", 0)
    ray_session.get(learner.setup.remote(2, ray_session.get(learner.free_port.remote())))
    options = VllmOptions("float32", memory_fraction=0.3, num_draft_tokens=k, record="full")  # scores compared
    worker = (
        ray_session.remote(RolloutWorker)
        .options(num_cpus=0.5, num_gpus=1)
        .remote("toy", aux, "float32", [1], 1, 0, "vllm", options)
    )
    sync = CollectiveSync(RayRuntime(), "vllm", timeout_s=300)
    config = ray_session.get(learner.drafter_config.remote())
    ray_session.get(
        learner.sft_step.remote([SFTExample(list(range(3, 40)), 3)], 2, 0.8, 64, 0.05)
    )  # not the shipped one
    update = sync.publish([learner], [worker], config, 1)

    prompts, greedy = [[3, 4, 5, 6], [7, 8, 9]], SamplingConfig(24, 0.0, k)
    got = ray_session.get(worker.generate.remote(prompts, [0, 1], greedy, update, 2))
    target = load_target("toy", aux, "float32")
    pushed = family("eagle3").from_state(config, ray_session.get(learner.weights.remote()), target)
    want = SpeculativeEngine(target, pushed.eval(), [1]).generate(prompts, greedy, policy_version=1)
    assert [t.output_ids for t in got] == [t.output_ids for t in want]
    for g, w in zip(got, want):
        assert [s.draft_tokens for s in g.steps] == [s.draft_tokens for s in w.steps]
        assert torch.allclose(
            torch.tensor([p for s in g.steps for p in s.draft_logprobs]),
            torch.tensor([p for s in w.steps for p in s.draft_logprobs]),
            atol=1e-3,
        )
    assert not ray_session.get(worker.__ray_call__.remote(lambda self: torch.cuda.is_initialized()))
    for actor in (learner, worker):
        ray_session.kill(actor)
