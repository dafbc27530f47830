"""The Draft-OPD driver without Ray: every role in this process (`ray.in_process`), the same Session code.

What is checked is the driver's own accounting: policy versions, when it syncs,
evaluates and checkpoints, and that drafter weights never reach it (they go
from the learner to the workers and to disk by reference only).
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from draftopd.config import load_config
from draftopd.drafters import read_checkpoint
from draftopd.opd.driver import run_opd
from draftopd.opd.runtime import InProcessRuntime

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "toy-opd.yaml"
SMALL = [
    "ray.in_process=true",
    "learner.num_learners=1",
    "rollout.num_workers=1",
    "data.num_train_prompts=8",
    "data.max_new_tokens=32",
    "sft.epochs=1",
    "sft.batch_size=4",
    "sft.ttt_depth=3",
    "rollout.prompts_per_round=4",
    "rollout.max_new_tokens=32",
    "learner.batch_size=4",
    "opd.num_rounds=3",
    "opd.steps_per_round=2",
    "opd.sync_every=2",
    "opd.eval_every=4",
    "opd.checkpoint_every=1",
    "opd.num_eval_prompts=2",
    "eval.max_new_tokens=16",
    "eval.num_draft_tokens=[3,5]",  # the periodic eval uses the first, not the rollout's K (4)
    "learner.replay_depth=2",  # nor does the learner's replay
]


def _arrays(value) -> list:
    """Every tensor or array inside a received value (dicts, lists, tuples, dataclass-like objects)."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return [value]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, list | tuple):
        return [a for v in value for a in _arrays(v)]
    return [a for v in getattr(value, "__dict__", {}).values() for a in _arrays(v)]


@pytest.fixture
def clean_process_group():
    """The in-process learner initialises torch.distributed here: leave the process as it was."""
    saved = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def test_driver_accounting_without_ray(tmp_path, clean_process_group):
    received = []
    runtime = InProcessRuntime(observe=received.append)
    cfg = load_config(RECIPE, [f"run.out_dir={tmp_path}", *SMALL])
    result = run_opd(cfg, ["test"], runtime)

    # The driver never holds drafter weights: nothing it received carries a tensor or an array.
    assert received and [a for v in received for a in _arrays(v)] == []
    assert _arrays({"w": [torch.zeros(1)]})  # the walk finds weights where they are

    rows = [json.loads(x) for x in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in rows if r["phase"] == "sft"]
    opd = [r for r in rows if r["phase"] == "opd"]
    assert [r["policy_version"] for r in sft] == list(range(1, len(sft) + 1))  # one version per learner step
    n_sft = len(sft)
    assert [r["policy_version"] for r in opd] == list(range(n_sft + 1, n_sft + 1 + 3 * 2))
    synced = [r["policy_version"] for r in opd if "sync_seconds" in r]
    assert synced == [v for v in range(n_sft + 1, n_sft + 7) if v % 2 == 0]
    evaluated = [r for r in rows if "eval/toy/tau" in r]
    assert [r["policy_version"] for r in evaluated if r["phase"] == "opd"] == [
        v for v in range(n_sft + 1, n_sft + 7) if v % 4 == 0
    ]
    assert all("eval/toy/accept_pos_2" in r and "eval/toy/accept_pos_3" not in r for r in evaluated)
    assert {r["replay_depth"] for r in opd} == {2}
    assert all("rollout/accept_pos_3" in r for r in rows if r["phase"] == "rollout")  # rollouts at K=4
    assert [r["policy_version"] for r in rows if r["phase"] == "rollout"] == [n_sft, n_sft + 2, n_sft + 4]

    # One checkpoint per round (the two newest kept), written by the learner; the final drafter is the last one's.
    root = Path(result["run_dir"]) / "checkpoints"
    kept = sorted(p.name for p in root.glob("v*-r*"))
    assert kept == [f"v{n_sft + 4:06d}-r0002", f"v{n_sft + 6:06d}-r0003"]
    state = json.loads((root / kept[-1] / "driver_state.json").read_text())
    assert state["policy_version"] == n_sft + 6 and state["round"] == 3 and state["sft_done"]
    _, _, last = read_checkpoint(root / kept[-1] / "drafter")
    _, config, final = read_checkpoint(result["drafter"])
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    _, _, before = read_checkpoint(root / kept[0] / "drafter")
    assert not torch.equal(before["fc.weight"], final["fc.weight"])  # the learner did train between them
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]


def test_repeated_nonfinite_losses_stop_the_job(tmp_path, clean_process_group):
    """A NaN learning rate poisons the drafter after one step: the following losses are NaN, two in a row stop.

    The driver's rule, run without Ray; the learner's skip of a single non-finite step runs on Ray in
    test_opd_loop.py."""
    from draftopd.loading import ASSETS
    from draftopd.opd.session import TrainingError

    over = [f"run.out_dir={tmp_path}", *SMALL, "learner.lr=.nan", "opd.steps_per_round=1", "opd.sync_every=1"]
    over += [f"drafter.init={ASSETS / 'toy-eagle3'}", "sft.epochs=0"]  # straight to OPD: no target responses
    cfg = load_config(RECIPE, [*over, "learner.max_nonfinite_in_a_row=2"])
    with pytest.raises(TrainingError, match="2 non-finite losses in a row; stopping; resumable checkpoint"):
        run_opd(cfg, ["test"], InProcessRuntime())
    rows = [json.loads(x) for x in open(tmp_path / "toy-opd" / "metrics.jsonl")]
    skipped = [r for r in rows if r["phase"] == "opd" and r.get("skipped_nonfinite") == 1]
    assert len(skipped) == 1 and skipped[0]["num_nonfinite_total"] == 1  # the stopping step is not logged


class _Stop(Exception):
    pass


def test_overlapped_rounds_learn_a_round_behind_and_resume_to_the_same_run(tmp_path, clean_process_group, monkeypatch):
    """opd.max_policy_lag=1: round r + 1 is decoded by the drafter the learner had before it learned from round r
    (a lag of steps_per_round versions for every round after the first), an evaluation asked for while a round is
    in flight is logged at the version it measured, and a run stopped at the checkpoint that holds a round decoded
    ahead (in the buffer, not decoded again) resumes to the uninterrupted run's rows and final drafter."""
    from draftopd.opd.session import Session

    over = [*SMALL, "opd.max_policy_lag=1", "opd.checkpoint_every=2", "buffer.max_staleness=6"]
    whole = run_opd(load_config(RECIPE, [f"run.out_dir={tmp_path / 'a'}", *over]), ["test"], InProcessRuntime())
    rows = [json.loads(x) for x in (Path(whole["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    n_sft = max(r["policy_version"] for r in rows if r["phase"] == "sft")
    rollouts = [r for r in rows if r["phase"] == "rollout" and "rollout/tau" in r]
    assert [r["rollout/policy_lag_max"] for r in rollouts] == [0.0, 2.0, 2.0]  # 2 steps per round
    assert [r["policy_version"] for r in rollouts] == [n_sft, n_sft + 2, n_sft + 4]  # when the learner reads them
    assert all(0.0 <= r["pipeline/rollout_idle_share"] <= 1.0 for r in rollouts[1:])
    evaluated = [
        (r["phase"], r["policy_version"]) for r in rows if r["phase"] in ("opd", "eval") and "eval/toy/tau" in r
    ]
    due = [v for v in range(n_sft + 1, n_sft + 7) if v % 4 == 0]
    # asked for with the next round out: logged when read (phase eval); after the last round: at once
    assert evaluated == [("eval" if v < n_sft + 6 else "opd", v) for v in due] and len(due) == 2
    assert [r["policy_version"] for r in rows if r["phase"] == "opd"] == list(range(n_sft + 1, n_sft + 7))

    real = Session.checkpoint

    def stop_after_round_2(s):
        real(s)
        if s.state.round == 2:
            raise _Stop

    monkeypatch.setattr(Session, "checkpoint", stop_after_round_2)
    with pytest.raises(_Stop):
        run_opd(load_config(RECIPE, [f"run.out_dir={tmp_path / 'b'}", *over]), ["test"], InProcessRuntime())
    monkeypatch.setattr(Session, "checkpoint", real)
    run_dir = tmp_path / "b" / "toy-opd"
    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["dir"]
    state = json.loads((run_dir / "checkpoints" / pointer / "driver_state.json").read_text())
    assert (state["round"], state["rounds_decoded"]) == (2, 3)  # round 2 decoded ahead, in the checkpoint's buffer
    resumed = run_opd(load_config(RECIPE, [*over, f"run.out_dir={tmp_path / 'b'}", "run.resume=true"]), ["test"],
                      InProcessRuntime())  # fmt: skip
    again = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    key = lambda r: {k: v for k, v in r.items() if not k.startswith(("pipeline/", "rollout/tokens_per_s"))}  # noqa: E731
    timed = ("sync_seconds", "learner/samples_per_s")
    same = lambda rs: [{k: v for k, v in key(r).items() if k not in timed} for r in rs if r["phase"] != "sft"]  # noqa: E731
    assert same(again) == same(rows)  # no round decoded twice, every row as in the uninterrupted run
    _, _, a = read_checkpoint(whole["drafter"])
    _, _, b = read_checkpoint(resumed["drafter"])
    assert all(torch.equal(a[k], b[k]) for k in a)
