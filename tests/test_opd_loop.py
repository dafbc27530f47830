"""Draft-OPD end to end on real Ray actors, real DeepSpeed (2 gloo ranks) and a real MLflow store."""

import json

import pytest
from mlflow.tracking import MlflowClient

from draftopd.config import load_config
from draftopd.opd.driver import run_opd
from draftopd.tracking import resolve_tracking_uri

TINY = [
    "data.num_train_prompts=16",
    "data.max_new_tokens=48",
    "sft.epochs=1",
    "sft.batch_size=8",
    "sft.ttt_depth=3",
    "sft.max_seq_len=192",
    "rollout.prompts_per_round=8",
    "rollout.max_new_tokens=48",
    "rollout.batch_size=4",
    "learner.batch_size=4",
    "learner.max_seq_len=192",
    "opd.num_rounds=2",
    "opd.steps_per_round=1",
    "opd.checkpoint_every=1",
    "opd.eval_every=1",
    "opd.num_eval_prompts=4",
    "eval.max_new_tokens=32",
]


@pytest.fixture(scope="module")
def opd_run(ray_session, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "toy-opd.yaml"
    cfg = load_config(recipe, [f"run.out_dir={out}", *TINY])
    return cfg, run_opd(cfg, ["test"])


def test_opd_run_trains_and_logs_curves(opd_run):
    cfg, result = opd_run
    run_dir = result["run_dir"]
    state_rows = [json.loads(x) for x in open(f"{run_dir}/metrics.jsonl")]
    phases = {r["phase"] for r in state_rows}
    assert {"sft", "sft_end", "rollout", "opd"} <= phases
    opd_rows = [r for r in state_rows if r["phase"] == "opd" and "loss" in r]
    assert opd_rows and all("loss_accepted" in r and "loss_rejected" in r for r in opd_rows)
    versions = [r["policy_version"] for r in state_rows]
    assert versions == sorted(versions) and versions[-1] == 2 + 2  # 2 SFT steps + 2 OPD steps

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
        "buffer/size",
        "buffer/num_stale_discarded",
        "learner/samples_per_s",
    ]:
        assert client.get_metric_history(run.info.run_id, key), key
    taus = client.get_metric_history(run.info.run_id, "eval/toy/tau")
    assert all(1.0 <= m.value <= cfg.rollout.num_draft_tokens + 1 for m in taus)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"plots", "drafter", "config.yaml", "provenance.json"} <= artifacts
    assert run.data.params["learner.zero_stage"] == "0"


def test_resume_continues_the_same_run(opd_run):
    """A second invocation with run.resume=true picks up version, buffer and MLflow run from the checkpoint."""
    cfg, first = opd_run
    run_dir = first["run_dir"]
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "toy-opd.yaml"
    state = json.loads(open(f"{run_dir}/checkpoints/latest/driver_state.json").read())
    buffer_before = json.loads(open(f"{run_dir}/checkpoints/latest/buffer.json").read())
    cfg2 = load_config(recipe, [f"run.out_dir={cfg.run.out_dir}", *TINY, "opd.num_rounds=3", "run.resume=true"])
    second = run_opd(cfg2, ["test", "resume"])
    rows = [r for r in second["history"] if r["phase"] != "sft"]
    assert rows[-1]["policy_version"] == state["policy_version"] + 1  # one more round of one step
    assert state["round"] == 2 and len(buffer_before["states"]) > 0
    client = MlflowClient(resolve_tracking_uri(run_dir))
    runs = client.search_runs([client.get_experiment_by_name("draftopd").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == state["mlflow_run_id"]
    steps = [m.step for m in client.get_metric_history(state["mlflow_run_id"], "loss_rejected")]
    assert max(steps) == state["policy_version"] + 1


def test_killed_rollout_worker_is_restarted_and_its_work_redone(ray_session):
    import os
    import signal
    import time

    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.engine.speculative import SamplingConfig
    from draftopd.loading import load_tokenizer
    from draftopd.opd.actors import rollout_actors

    cfg = load_config(
        None, ["target.aux_layer_ids=[1,2,3]", "rollout.num_workers=1", "rollout.num_cpus_per_worker=0.5"]
    )
    [worker] = rollout_actors(cfg, [2])
    prompts = encode_chats(load_tokenizer("toy"), toy_prompts("held_out", 8))
    pid = ray_session.get(worker.pid.remote())
    ref = worker.generate.remote(prompts, list(range(8)), SamplingConfig(96), None, None, -1, 2)
    time.sleep(3)
    os.kill(pid, signal.SIGKILL)
    trajs = ray_session.get(ref, timeout=300)
    assert [t.prompt_index for t in trajs] == list(range(8)) and all(t.output_ids for t in trajs)
    assert ray_session.get(worker.pid.remote()) != pid


def test_nonfinite_loss_skips_the_step(ray_session, tiny_pair, tmp_path):
    """A NaN in the replayed records gives a NaN loss: the step is skipped and counted, weights unchanged."""
    import math

    import numpy as np

    from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
    from draftopd.messages import ErrorState
    from draftopd.opd.learner import DraftLearner, LearnerSpec
    from draftopd.opd.replay import OPDLossConfig

    target, drafter = tiny_pair
    target.model.save_pretrained(tmp_path / "tiny")
    state = {
        k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in drafter.checkpoint_state().items()
    }
    cfg = drafter.cfg.to_hf()
    spec = LearnerSpec(str(tmp_path / "tiny"), target.aux_layer_ids, "float64", cfg, state, lr=1e-2)
    learner = ray_session.remote(DraftLearner).options(num_cpus=0.5).remote(spec, 0, 1, "127.0.0.1", 0)
    ray_session.get(learner.setup.remote(4, ("127.0.0.1", _free_port())))
    trajs = SpeculativeEngine(target, drafter, [1]).generate([[3, 4, 5], [6, 7]], SamplingConfig(30, 0.0, 4), 0)
    states = [ErrorState(t, i, 0) for t in trajs for i, s in enumerate(t.steps) if s.rejected]
    before = ray_session.get(learner.weights.remote())
    for s in states:
        s.step.target_logprobs = [math.nan] * len(s.step.target_logprobs)
    m = ray_session.get(learner.opd_step.remote(states, 4, 0.8, 128, OPDLossConfig()))
    assert m["skipped_nonfinite"] == 1 and m["num_nonfinite_total"] == 1
    after = ray_session.get(learner.weights.remote())
    assert all(np.array_equal(before[k], after[k]) for k in before)
    ray_session.kill(learner)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
