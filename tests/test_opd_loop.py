"""Draft-OPD end to end on real Ray actors, real DeepSpeed (2 gloo ranks) and a real MLflow store."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from draftopd.config import load_config
from draftopd.opd.driver import run_opd
from draftopd.ports import free_port
from draftopd.tracking import resolve_tracking_uri

# Short decodes: no check reads a length, and the rounds still replay rejected drafts (loss_rejected is logged).
TINY = [
    "data.num_train_prompts=8",
    "data.max_new_tokens=32",
    "sft.epochs=1",
    "sft.batch_size=8",
    "sft.ttt_depth=3",
    "sft.max_seq_len=192",
    "rollout.prompts_per_round=8",
    "rollout.max_new_tokens=32",
    "rollout.batch_size=4",
    "learner.batch_size=4",
    "learner.rej_coef=1.0",  # the recipe turns the rejected stream off; the loop's test keeps it on
    "learner.max_seq_len=192",
    "opd.num_rounds=2",
    "opd.steps_per_round=1",
    "opd.checkpoint_every=1",
    "opd.eval_every=1",
    "opd.num_eval_prompts=2",
    "eval.max_new_tokens=16",
]


RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "toy-opd.yaml"
DRAFTOPD = Path(sys.executable).parent / "draftopd"


def _wait_for(predicate, seconds: float, proc):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"driver exited with {proc.returncode} first: {proc.stderr.read()[-3000:]}")
        time.sleep(0.1)
    raise TimeoutError("condition not reached")


def _checkpoint_state(run_dir: Path) -> dict:
    pointer = run_dir / "checkpoints" / "latest.json"
    if not pointer.is_file():
        return {"round": -1}
    ckpt = run_dir / "checkpoints" / json.loads(pointer.read_text())["dir"]
    return json.loads((ckpt / "driver_state.json").read_text())


def _learner_pids(ray_session, driver_pid: int) -> list[int]:
    """PIDs of the live DraftLearner actors of the Ray job whose driver process is `driver_pid`, as Ray reports
    them: the test kills only the processes of the run it started.

    Read from the GCS tables: the public state API (ray.util.state) needs the dashboard, which this Ray session
    runs without.
    """
    from ray._private.state import state

    jobs = {j["JobID"] for j in state.job_table() if j["DriverPid"] == driver_pid and not j["IsDead"]}
    actors = state.actor_table(None).values()
    return [
        a["Pid"]
        for a in actors
        if a["JobID"] in jobs and a["ActorClassName"] == "DraftLearner" and a["State"] == "ALIVE" and a["Pid"]
    ]


@pytest.fixture(scope="module")
def opd_run(ray_session, tmp_path_factory):
    """Two overlapped rounds (opd.max_policy_lag 1) and two crashes: the driver is SIGKILLed after round 1, then
    the resumed driver's learners as soon as both are alive (before round 2).

    Each crash is followed by a resume; the last one runs round 2 to the end in this process.
    """
    out = tmp_path_factory.mktemp("runs")
    # 2 learner ranks; each round decodes beside the learning on the round before (the synchronous loop runs on
    # Ray in test_vllm_backend.py and test_ray_job.py, in process in test_session.py)
    args = [f"run.out_dir={out}", *TINY, "rollout.num_workers=1", "opd.max_policy_lag=1"]
    run_dir = out / "toy-opd"
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    pipes = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    driver = subprocess.Popen([str(DRAFTOPD), "train", str(RECIPE), *args], **pipes)
    _wait_for(lambda: _checkpoint_state(run_dir)["round"] >= 1, 600, driver)
    driver.kill()
    assert driver.wait(60) == -signal.SIGKILL
    killed_at = _checkpoint_state(run_dir)

    driver = subprocess.Popen([str(DRAFTOPD), "train", str(run_dir)], **pipes)  # a run directory resumes
    _wait_for(lambda: len(_learner_pids(ray_session, driver.pid)) == 2, 600, driver)
    for pid in _learner_pids(ray_session, driver.pid):  # the driver does not restart learners
        os.kill(pid, signal.SIGKILL)
    _, learner_stderr = driver.communicate(timeout=300)

    cfg = load_config(RECIPE, [*args, "run.resume=true"])
    return cfg, run_opd(cfg, ["test", "resume"]), killed_at, driver.returncode, learner_stderr


def test_opd_run_trains_and_logs_curves(opd_run):
    cfg, result, _, _, _ = opd_run
    run_dir = result["run_dir"]
    phases = {json.loads(x)["phase"] for x in open(f"{run_dir}/metrics.jsonl")}
    assert {"sft", "sft_end", "rollout", "opd"} <= phases
    history = result["history"]
    opd_rows = [r for r in history if r["phase"] == "opd" and "loss" in r]
    assert opd_rows and all("loss_accepted" in r and "loss_rejected" in r for r in opd_rows)
    versions = [r["policy_version"] for r in history if r["phase"] != "eval"]  # an evaluation read late: its own
    assert versions == sorted(versions) and versions[-1] == 1 + 2  # 1 SFT step + 2 rounds of 1 OPD step
    lags = [r["rollout/policy_lag_max"] for r in history if "rollout/tau" in r]
    assert lags == [0.0, 1.0]  # round 1 decoded while the learner learned from round 0

    client = MlflowClient(resolve_tracking_uri(run_dir))
    run = client.search_runs([client.get_experiment_by_name("draftopd").experiment_id])[0]
    assert run.info.status == "FINISHED"
    for key in [
        "rollout/tau",
        "rollout/tokens_per_s",
        "eval/toy/tau",
        "loss_accepted",
        "loss_rejected",
        "sync_seconds",
        "rollout/buffer/size",
        "rollout/buffer/num_stale_discarded",
        "rollout/buffer/replayed_share",
        "learner/samples_per_s",
    ]:
        assert client.get_metric_history(run.info.run_id, key), key
    taus = client.get_metric_history(run.info.run_id, "eval/toy/tau")
    assert all(1.0 <= m.value <= cfg.rollout.num_draft_tokens + 1 for m in taus)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"plots", "drafter", "config.yaml", "provenance.json", "rejections"} <= artifacts
    assert run.data.params["learner.zero_stage"] == "0"


def test_crashes_resume_into_the_same_run(opd_run):
    """A killed driver and killed learners each leave a checkpoint; resuming continues version and MLflow run."""
    cfg, result, killed_at, learner_rc, learner_stderr = opd_run
    assert killed_at["round"] >= 1
    assert learner_rc == 1, learner_stderr[-3000:]
    # The driver's own last line (Ray forwards the actors' output to the same stream, sometimes after it).
    message = [line for line in learner_stderr.splitlines() if line.startswith("draftopd train:")][-1]
    assert message.startswith("draftopd train: stopped: a learner rank died during"), learner_stderr[-3000:]
    assert "resumable checkpoint" in message and "run.resume=true" in message
    client = MlflowClient(resolve_tracking_uri(result["run_dir"]))
    runs = client.search_runs([client.get_experiment_by_name("draftopd").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == killed_at["mlflow_run_id"]
    steps = [m.step for m in client.get_metric_history(killed_at["mlflow_run_id"], "loss_rejected")]
    assert max(steps) == result["history"][-1]["policy_version"] == 3
    rounds = {m.step for m in client.get_metric_history(killed_at["mlflow_run_id"], "rollout/tau")}
    assert len(rounds) == 2, rounds


def test_killed_rollout_worker_is_restarted_and_its_work_redone(ray_session):
    """A worker that dies with a generate call in flight is restarted; the call is redone there, to the same result.

    The worker is frozen (SIGSTOP) before the call is sent and killed while frozen, so the call is in flight when
    it dies on every machine, however fast; a kill after a fixed sleep could come after the call had returned.
    """
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.engine.speculative import SamplingConfig
    from draftopd.loading import load_tokenizer
    from draftopd.opd.actors import rollout_actors

    cfg = load_config(
        None, ["target.aux_layer_ids=[1,2,3]", "rollout.num_workers=1", "rollout.num_cpus_per_worker=0.5"]
    )
    [worker] = rollout_actors(cfg, [2])
    prompts = encode_chats(load_tokenizer("toy"), toy_prompts("held_out", 4))
    call = (prompts, list(range(4)), SamplingConfig(32), None, 2)  # in flight by the freeze, whatever its size
    pid = ray_session.get(worker.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    ref = worker.generate.remote(*call)
    ready, _ = ray_session.wait([ref], timeout=1)
    assert not ready  # a frozen worker cannot have answered
    os.kill(pid, signal.SIGKILL)
    trajs = ray_session.get(ref, timeout=300)
    assert ray_session.get(worker.pid.remote()) != pid
    assert [t.prompt_index for t in trajs] == list(range(4)) and all(t.output_ids for t in trajs)
    again = ray_session.get(worker.generate.remote(*call), timeout=300)  # greedy: an undisturbed call
    assert [t.output_ids for t in trajs] == [t.output_ids for t in again]
    ray_session.kill(worker)


def test_a_worker_killed_in_an_overlapped_round_is_restarted_and_the_round_redone(ray_session, tmp_path, monkeypatch):
    """opd.max_policy_lag 1: the only rollout worker dies while round 1 decodes beside the learner's step on round
    0. Ray restarts it and retries the call there; the round's trajectories are those a fresh worker decodes from
    the same call (same weights, same seeds), and the run goes on to its end with the round's lag logged.

    The worker is frozen before round 1 is sent and killed while frozen, so the call is in flight when it dies."""
    from draftopd.opd.actors import rollout_actors
    from draftopd.opd.pipeline import RolloutPipeline

    seen = {}
    start, finish = RolloutPipeline._start, RolloutPipeline._finish

    def start_then_kill(self, q):
        if q != 1:
            return start(self, q)
        [worker] = self.s.workers
        seen["pid"] = pid = ray_session.get(worker.pid.remote())
        os.kill(pid, signal.SIGSTOP)
        start(self, q)
        d = self.rounds[q]
        ready, _ = ray_session.wait(d.refs, num_returns=len(d.refs), timeout=1)
        assert not ready  # a frozen worker cannot have answered
        os.kill(pid, signal.SIGKILL)
        seen.update(decode=d, update=self.s.update)

    def finish_and_look(self, q):
        metrics = finish(self, q)
        if q == 1:
            seen["pid_after"] = ray_session.get(self.s.workers[0].pid.remote())
        return metrics

    monkeypatch.setattr(RolloutPipeline, "_start", start_then_kill)
    monkeypatch.setattr(RolloutPipeline, "_finish", finish_and_look)
    over = [f"run.out_dir={tmp_path}", *TINY, "rollout.num_workers=1", "learner.num_learners=1"]
    cfg = load_config(RECIPE, [*over, "opd.max_policy_lag=1"])
    result = run_opd(cfg, ["test"])

    assert seen["pid_after"] != seen["pid"]  # restarted
    rounds = [r for r in result["history"] if "rollout/tau" in r]
    assert [r["rollout/policy_lag_max"] for r in rounds] == [0.0, 1.0]  # round 1 was decoded beside learning
    assert all(r["rollout/error_states_added"] > 0 for r in rounds)
    assert result["history"][-1]["policy_version"] == 1 + 2  # 1 SFT step + 2 rounds of 1 step: the run ended
    d = seen["decode"]
    got = [t for chunk in ray_session.get(d.refs) for t in chunk]
    assert {t.policy_version for t in got} == {seen["update"].policy_version}
    [fresh] = rollout_actors(cfg, [2])
    bs = cfg.rollout.batch_size
    calls = [fresh.generate.remote(d.prompts[i : i + bs], d.indices[i : i + bs], d.sampling, seen["update"], bs)
             for _, i in d.chunks]  # fmt: skip
    want = [t for chunk in ray_session.get(calls) for t in chunk]
    assert [t.output_ids for t in got] == [t.output_ids for t in want] and len(got) == len(d.prompts)
    assert [[(x.num_accepted, x.rejected) for x in t.steps] for t in got] == [
        [(x.num_accepted, x.rejected) for x in t.steps] for t in want
    ]
    ray_session.kill(fresh)


# The learner's skip and the weight transport are the same code for every family: one family runs them on Ray.
# What differs by family, the in-place load of a pushed state, is checked for each in test_drafters.py.
@pytest.mark.parametrize("tiny_pair", ["eagle3"], indirect=True)
def test_nonfinite_loss_skips_the_step(ray_session, tiny_pair, tmp_path):
    """A NaN in the replayed records gives a NaN loss: the step is skipped and counted, weights unchanged.
    (k3 against the recorded full-vocabulary log-probs reads the records; the default scores a fresh target pass.)"""
    import math

    import torch

    from draftopd.config import DrafterConfig
    from draftopd.drafters import save_drafter
    from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
    from draftopd.messages import ErrorState
    from draftopd.opd.learner import DraftLearner, LearnerSpec
    from draftopd.opd.replay import OPDLossConfig

    target, drafter = tiny_pair
    target.model.save_pretrained(tmp_path / "tiny")
    init = str(save_drafter(drafter, tmp_path / "drafter"))
    spec = LearnerSpec(
        str(tmp_path / "tiny"), target.aux_layer_ids, "float64", DrafterConfig(kind=drafter.kind), init, lr=1e-2
    )
    learner = ray_session.remote(DraftLearner).options(num_cpus=0.5).remote(spec, 0, 1, "127.0.0.1", 0)
    ray_session.get(learner.setup.remote(4, ("127.0.0.1", free_port())))
    trajs = SpeculativeEngine(target, drafter, [1]).generate([[3, 4, 5], [6, 7]], SamplingConfig(30, 0.0, 4), 0)
    states = [ErrorState(t, i, 0) for t in trajs for i, s in enumerate(t.steps) if s.rejected]
    before = ray_session.get(learner.weights.remote())
    for s in states:
        s.step.target_logprobs = [math.nan] * len(s.step.target_logprobs)
    m = ray_session.get(learner.opd_step.remote(states, 4, 0.8, 128, OPDLossConfig(k3_full_vocab_target=True)))
    assert m["skipped_nonfinite"] == 1 and m["num_nonfinite_total"] == 1
    after = ray_session.get(learner.weights.remote())
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(t.dtype == torch.float64 for t in before.values() if t.is_floating_point())  # in their own dtype
    ray_session.kill(learner)


@pytest.mark.parametrize("tiny_pair", ["eagle3"], indirect=True)
def test_collective_weight_sync_reaches_every_worker(ray_session, sync_actors):
    """Learner rank 0 broadcasts into two workers' drafters; a restarted worker refuses, and a new publish heals it."""
    import torch

    from draftopd.engine.speculative import SamplingConfig
    from draftopd.opd.runtime import RayRuntime
    from draftopd.opd.weight_sync import CollectiveSync, StaleWeights
    from draftopd.sft.trainer import SFTExample

    learner, workers = sync_actors
    sync = CollectiveSync(RayRuntime(), "gloo", timeout_s=300)  # actor start-up on busy cores

    def same_weights():
        want = ray_session.get(learner.weights.remote())
        got = ray_session.get([w.weights.remote() for w in workers])
        return all(g is not None and all(torch.equal(want[k], g[k].to(want[k].dtype)) for k in want) for g in got)

    config = ray_session.get(learner.drafter_config.remote())
    sync.publish([learner], workers, config, 0)
    assert same_weights()
    start = ray_session.get(learner.weights.remote())
    ray_session.get(learner.sft_step.remote([SFTExample([3, 4, 5, 6, 7, 8, 9, 10], 3)], 2, 0.8, 64, 0.05))
    update = sync.publish([learner], workers, config, 1)
    assert same_weights() and ray_session.get(workers[0].apply_update.remote(update)) == 1
    moved = ray_session.get(workers[1].weights.remote())
    assert any(not torch.equal(start[k], moved[k].to(start[k].dtype)) for k in start)

    first_group = sync.group
    os.kill(ray_session.get(workers[1].pid.remote()), signal.SIGKILL)
    with pytest.raises(StaleWeights, match="holds policy version -1, not 1"):
        ray_session.get(workers[1].generate.remote([[3, 4, 5]], [0], SamplingConfig(8, 0.0, 2), update, 1))
    sync.publish([learner], workers, config, 1)
    assert sync.group != first_group and same_weights()
    trajs = ray_session.get(workers[1].generate.remote([[3, 4, 5]], [0], SamplingConfig(8, 0.0, 2), update, 1))
    assert trajs[0].policy_version == 1 and trajs[0].output_ids


class _Peer:
    """One end of a weight-sync group, without the models around it."""

    def join(self, rank: int, host: str, port: int, backend: str):
        from draftopd.opd.weight_sync import join_group

        self.group = join_group(backend, host, port, rank, 2, 60)

    def exchange(self, backend: str, items: list, state):
        from draftopd.opd.weight_sync import broadcast_state

        return broadcast_state(self.group, backend, items, state)


@pytest.mark.gpu
def test_nccl_broadcast_between_two_gpus(ray_session, tiny_pair):
    """The GPU transport of CollectiveSync: the same functions over NCCL, one GPU per rank."""
    import torch

    from draftopd.opd.weight_sync import manifest

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL weight sync needs two GPUs (one per rank)")
    state = tiny_pair[1].state()
    items = manifest(state)
    peers = [ray_session.remote(_Peer).options(num_cpus=0.25, num_gpus=1).remote() for _ in range(2)]
    port = free_port()
    ray_session.get([p.join.remote(r, "127.0.0.1", port, "nccl") for r, p in enumerate(peers)])
    _, got = ray_session.get(
        [peers[0].exchange.remote("nccl", items, state), peers[1].exchange.remote("nccl", items, None)]
    )
    assert all(torch.equal(state[k], got[k]) and got[k].dtype == state[k].dtype for k in state)


def test_a_local_run_starts_its_own_ray_beside_another(ray_session):
    """Without RAY_ADDRESS (set by `ray job submit`), a run never joins another cluster running on the machine."""
    code = (
        "import ray; from draftopd.config import load_config; from draftopd.opd.session import start_ray; "
        "start_ray(load_config(None, ['ray.object_store_memory_mb=128', 'ray.num_cpus=1'])); "
        "print(ray.get_runtime_context().gcs_address); ray.shutdown()"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    own = out.stdout.strip().splitlines()[-1]
    assert own.startswith("127.0.0.1:") and own != ray_session.get_runtime_context().gcs_address
