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
