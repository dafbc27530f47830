"""Correctness fixes of the Draft-OPD path: each test pins one bug found in review."""

import math

import pytest
import torch

from draftopd.eval.acceptance import acceptance_stats
from draftopd.messages import ErrorState, Trajectory, VerificationStep
from draftopd.opd.replay import build_replay_batch


def _traj(prompt_len: int, steps: list[tuple[int, int]], k: int, version: int = 0) -> Trajectory:
    """A trajectory whose steps are (num_accepted, num_emitted); drafts are token 7, text is token 5."""
    prompt = list(range(2, 2 + prompt_len))
    out, recs = [5], []
    for a, emitted in steps:
        pos = len(prompt) + len(out)
        recs.append(VerificationStep(pos, [7] * k, [-1.0] * k, [-2.0] * k, a, [5] * emitted))
        out += [5] * emitted
    return Trajectory(prompt, out, recs, policy_version=version, num_draft_tokens=k)


def test_tau_counts_the_tokens_steps_emitted():
    # The last step accepted 3 drafts but the sequence ended after 2 tokens (EOS or the budget).
    traj = _traj(3, [(1, 2), (3, 2)], k=4)
    stats = acceptance_stats([traj], 4)
    assert stats["tau"] == pytest.approx((2 + 2) / 2)
    assert stats["tau"] == pytest.approx(len(traj.output_ids[1:]) / len(traj.steps))


@pytest.mark.parametrize("accepted_rows", ["all", "anchors"])
@pytest.mark.parametrize("depth", [2, 4, 6])
def test_replay_depths_past_the_accepted_drafts_carry_no_accepted_weight(accepted_rows, depth):
    """At a step's anchor row, depth d > a went through a rejected draft (or past the block): no teacher label."""
    k = 3
    traj = _traj(4, [(0, 1), (2, 3), (3, 4), (1, 2), (0, 1)], k=k)
    traj.output_ids += [5] * 12  # room for labels past every block
    states = [ErrorState(traj, i, 0) for i in range(len(traj.steps))]
    t2d = torch.arange(16)
    batch = build_replay_batch(states, t2d, depth, 0.8, 512, accepted_rows=accepted_rows)
    for s in states:
        t, a = s.step.position - 2, s.step.num_accepted
        assert all(batch.acc_weight[0, d, t] == 0 for d in range(a + 1, depth)), (a, depth)
        assert all(batch.acc_weight[0, d, t] == pytest.approx(0.8**d) for d in range(min(a + 1, k, depth)))
        assert all(batch.rej_weight[0, d, t] == 0 for d in range(k, depth))  # no draft there to score


def test_a_learner_step_with_only_stale_states_is_skipped_and_counted():
    """Every buffered state too old: the driver skips the learner step with a reason instead of an empty batch."""
    from types import SimpleNamespace

    from draftopd.config import Config
    from draftopd.opd.buffer import ReplayBuffer
    from draftopd.opd.runtime import InProcessHandle, InProcessRuntime
    from draftopd.opd.session import DriverState, Session

    class Learner:
        def opd_step(self, states, *args):
            assert states, "a learner was handed an empty batch"
            return {"loss": 1.0, "skipped_nonfinite": 0}

    cfg = Config()
    buffer = ReplayBuffer(cfg.buffer)
    buffer.add([_traj(4, [(0, 1), (1, 2)], k=3, version=0)])
    s = SimpleNamespace(
        cfg=cfg,
        rt=InProcessRuntime(),
        buffer=InProcessHandle(buffer),
        learners=[InProcessHandle(Learner())],
        state=DriverState(policy_version=cfg.buffer.max_staleness + 1),
        nonfinite_in_a_row=0,
        num_skipped_stale=0,
    )
    s._learner_call = lambda *a: Session._learner_call(s, *a)
    s._learners_get = lambda *a: Session._learners_get(s, *a)
    m = Session.opd_step(s)
    assert m["learner/skipped_no_fresh_states"] == 1 and m["learner/num_skipped_no_fresh_states"] == 1
    assert s.state.policy_version == cfg.buffer.max_staleness + 1 and len(buffer) == 0
    assert Session.opd_step(s)["learner/num_skipped_no_fresh_states"] == 2


def test_config_refuses_a_round_longer_than_the_staleness_window():
    from draftopd.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["opd.steps_per_round=4", "opd.sync_every=2", "buffer.max_staleness=5"])
    msg = str(err.value)
    assert "\n" not in msg and all(k in msg for k in ("opd.steps_per_round", "opd.sync_every", "buffer.max_staleness"))
    load_config(None, ["opd.steps_per_round=4", "opd.sync_every=2", "buffer.max_staleness=6"])


def test_distributed_sft_shuffles_each_epoch():
    from types import SimpleNamespace

    from draftopd.config import Config
    from draftopd.opd.driver import sft_phase
    from draftopd.opd.session import DriverState
    from draftopd.sft.trainer import SFTExample

    cfg = Config()
    cfg.sft.epochs, cfg.sft.batch_size = 4, 3
    examples = [SFTExample([1, 2, i], 2) for i in range(12)]
    seen = []
    s = SimpleNamespace(
        cfg=cfg,
        state=DriverState(),
        target_responses=lambda: examples,
        place_learners_for_start=lambda ex: None,
        log=lambda metrics, phase: None,
        sync=lambda: 0.0,
        evaluate=lambda: {},
        sft_step=lambda batch, step, total: seen.append([e.ids[-1] for e in batch]) or {},
    )
    sft_phase(s)
    epochs = [sum(seen[i : i + 4], []) for i in range(0, 16, 4)]
    assert len(seen) == 16 and all(sorted(e) == list(range(12)) for e in epochs)  # every example once per epoch
    assert len({tuple(e) for e in epochs}) == 4  # in a new order each epoch


def test_toy_held_out_prompts_are_disjoint_from_training_by_text():
    import json

    from draftopd.toy.corpus import build_corpus, prompt_only

    train, held = build_corpus(num_arithmetic=4000, seed=1000)  # as toy_prompts builds it for seed 0
    text = lambda s: json.dumps(prompt_only(s))  # noqa: E731
    train_texts = {text(s) for s in train}
    assert not [s.key for s in held if text(s) in train_texts]
    assert sum(s.domain == "code" for s in held) > 300  # the held-out code prompts are still there


def test_one_prompt_file_as_both_splits_is_refused_unless_lines_name_them(tmp_path):
    import json

    from draftopd.config import ConfigError, load_config
    from draftopd.data.prompts import load_prompts

    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(4)))
    both = [f"data.prompts={f}", f"data.eval_prompts={f}"]
    with pytest.raises(ConfigError, match="data.prompts and data.eval_prompts") as err:
        load_config(None, both)
    assert "\n" not in str(err.value)
    lines = [{"prompt": f"q{i}", "split": "train" if i % 2 else "held_out"} for i in range(4)]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = load_config(None, both)
    train, held = load_prompts(cfg.data.prompts, "train", 10), load_prompts(cfg.data.eval_prompts, "held_out", 10)
    assert [c[0]["content"] for c in train] == ["q1", "q3"] and [c[0]["content"] for c in held] == ["q0", "q2"]


def test_opd_reuses_a_prepared_pools_responses(tmp_path):
    import json
    from types import SimpleNamespace

    from draftopd.config import Config
    from draftopd.loading import resolve_target_path
    from draftopd.opd.session import Session

    rows = [{"messages": [{"role": "user", "content": "q"}], "input_ids": [3, 4, 5, 6], "prompt_len": 2}]
    rows.append({**rows[0], "input_ids": [3, 4, 9, 9, 9]})
    (tmp_path / "train-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"messages": rows[0]["messages"]}) + "\n")
    manifest = {
        "complete": True,
        "target": str(resolve_target_path("toy").resolve()),
        "template": {"enable_thinking": True},
        "generation": {"backend": "native", "temperature": 0.0},
        "shards": [{"file": "train-00000.jsonl"}],
        "heldout": {"file": "heldout.jsonl"},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    cfg = Config()
    cfg.data.prompts = str(tmp_path)

    def no_generation(*args, **kwargs):
        raise AssertionError("the pool's responses should have been used")

    s = SimpleNamespace(cfg=cfg, _generate=no_generation, train_prompts=[[3, 4], [3, 4]])
    examples = Session.target_responses(s)
    assert [(e.ids, e.prompt_len) for e in examples] == [([3, 4, 5, 6], 2), ([3, 4, 9, 9, 9], 2)]


def test_opd_lr_schedule_defaults_to_todays_constant_lr():
    from types import SimpleNamespace

    from draftopd.config import load_config
    from draftopd.opd.session import Session

    s = SimpleNamespace(cfg=load_config(None, ["learner.lr=1e-3"]))
    assert [Session.opd_lr(s, i, 10) for i in range(10)] == [1e-3] * 10
    s.cfg = load_config(None, ["learner.lr=1e-3", "learner.warmup_ratio=0.2"])
    assert [Session.opd_lr(s, i, 10) for i in range(4)] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])
    s.cfg = load_config(None, ["learner.lr=1e-3", "learner.warmup_ratio=0.2", "learner.lr_schedule=cosine"])
    lrs = [Session.opd_lr(s, i, 10) for i in range(10)]
    assert lrs[:2] == pytest.approx([5e-4, 1e-3]) and all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    assert 1e-4 <= lrs[-1] < 2e-4  # cosine towards 10% of the peak, as SFT


def test_update_accumulation_over_rollout_rounds():
    """opd.accumulate_rounds=N: learner steps after every N-th round, each on N rounds' worth of states."""
    from types import SimpleNamespace

    from draftopd.config import load_config
    from draftopd.opd.driver import opd_phase
    from draftopd.opd.session import DriverState, Session
    from draftopd.testing import in_process_session

    over = ["opd.num_rounds=6", "opd.steps_per_round=2", "opd.accumulate_rounds=3", "learner.batch_size=2"]
    over.append("learner.replay_unit=state")
    cfg = load_config(None, [*over, "learner.lr_schedule=cosine", "opd.eval_every=1000", "opd.checkpoint_every=1000"])
    events, got = [], []
    s = SimpleNamespace(
        cfg=cfg,
        state=DriverState(),
        eval_k=4,
        rollouts=SimpleNamespace(
            collect=lambda q: events.append("rollout") or {},
            sync=lambda: 0.0,
            evaluate=lambda: {},
            finished_evals=lambda block=False: [],
            drain=lambda: [],
            begin=lambda: None,
            summary=lambda: {},
        ),
        buffer_stats=lambda: {},
        log=lambda metrics, phase, version=None: None,
        opd_step=lambda step, total: events.append((step, total)) or {},
    )
    opd_phase(s)
    r = "rollout"
    assert events == [r, r, r, (0, 4), (1, 4), r, r, r, (2, 4), (3, 4)]

    class Learner:
        def opd_step(self, states, depth, decay, max_len, loss_cfg, lr, unit):
            got.append((len(states), lr))
            return {"loss": 1.0, "skipped_nonfinite": 0}

    s = in_process_session(cfg, Learner(), [_traj(4, [(0, 1)] * 8, k=3)])
    m = Session.opd_step(s, 3, 4)
    assert got == [(6, Session.opd_lr(s, 3, 4))] and m["learner/lr"] == got[0][1] < cfg.learner.lr


def _nan_gradient_run(zero_stage: int, tmp: str) -> dict:
    """In a fresh process (DeepSpeed's groups outlive a destroyed process group): a finite loss with a NaN
    gradient, then a clean one, through one learner rank."""
    from pathlib import Path

    from draftopd.config import DrafterConfig
    from draftopd.opd.learner import DraftLearner, LearnerSpec
    from draftopd.ports import free_port
    from draftopd.testing import tiny_target

    target = tiny_target(vocab=16)
    target.model.save_pretrained(Path(tmp) / "tiny")
    spec = LearnerSpec(str(Path(tmp) / "tiny"), target.aux_layer_ids, "float32", DrafterConfig(), "", list(range(16)))
    spec.zero_stage, spec.lr = zero_stage, 1e-2
    learner = DraftLearner(spec, 0, 1, "127.0.0.1", free_port())
    learner.setup(2)
    before = learner.weights()
    p = next(p for p in learner.engine.module.parameters() if p.requires_grad)
    skipped = learner._apply((p.sum() * 0).sqrt(), {}, None)  # sqrt at 0: loss 0, gradient NaN
    after = learner.weights()
    clean = learner._apply(p.pow(2).sum(), {}, None)  # the next step is clean of the dropped gradient
    return {
        "skipped": skipped["skipped_nonfinite"],
        "total": skipped["num_nonfinite_total"],
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "clean_skipped": clean["skipped_nonfinite"],
        "clean_norm": clean["grad_norm"],
        "finite": all(bool(torch.isfinite(v).all()) for v in learner.weights().values()),
    }


def test_nonfinite_gradient_norm_skips_the_step(tmp_path):
    """A finite loss whose gradient is NaN: the step is skipped and counted like a non-finite loss, at ZeRO 0 and 2.

    Each stage runs in a process of its own (see _nan_gradient_run); the two run side by side, one thread each.
    """
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    procs = {}
    for stage in (0, 2):
        (tmp_path / str(stage)).mkdir()
        code = (
            f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_opd_fixes as t; "
            f"print('RESULT', json.dumps(t._nan_gradient_run({stage}, {str(tmp_path / str(stage))!r})))"
        )
        procs[stage] = subprocess.Popen([sys.executable, "-c", code], **pipes)
    for stage, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line, (stage, stderr[-3000:].splitlines()[-15:])
        r = json.loads(line[len("RESULT ") :])
        assert r["skipped"] == 1 and r["total"] == 1 and r["unchanged"], (stage, r)
        assert r["clean_skipped"] == 0 and math.isfinite(r["clean_norm"]) and r["clean_norm"] > 0 and r["finite"]


def test_k3_compares_the_drafter_with_the_target_restricted_to_the_draft_vocabulary():
    """The drafter's distribution lives on the draft vocabulary: k3's optimum must be the target restricted to it
    (as the forward KL's is), not the full-vocabulary log-probs the rollout recorded."""
    from draftopd.opd.objective import k3
    from draftopd.opd.replay import rejected_block_targets, target_to_draft_index
    from draftopd.testing import tiny_target

    target = tiny_target(vocab=16)
    d2t = torch.tensor([2, 3, 5, 7, 11, 13])  # a draft vocabulary that lacks most target tokens
    g = torch.Generator().manual_seed(0)
    traj = _traj(4, [(1, 2), (0, 1), (2, 3)], k=3)
    traj.output_ids = torch.randint(2, 16, (len(traj.output_ids) + 4,), generator=g).tolist()
    want, states = {}, []
    for i, step in enumerate(traj.steps):  # the rollout's records: full-vocabulary log-probs in the drafted context
        step.draft_tokens = d2t[torch.randint(0, len(d2t), (3,), generator=g)].tolist()
        for d in range(3):
            ctx = torch.tensor([traj.full_ids[: step.position] + step.draft_tokens[:d]])
            logits = target.forward(ctx, torch.arange(ctx.shape[1])[None], want_aux=False).logits[0, -1]
            step.target_logprobs[d] = float(torch.log_softmax(logits, -1)[step.draft_tokens[d]])
            step.target_draft_logz.append(float(torch.log_softmax(logits, -1)[d2t].logsumexp(-1)))
            restricted = torch.log_softmax(logits[d2t], -1)  # the best the drafter can be
            want[(step.position - 2, d)] = (restricted, int(target_to_draft_index(d2t, 16)[step.draft_tokens[d]]))
        states.append(ErrorState(traj, i, 0))
    batch = build_replay_batch(states, target_to_draft_index(d2t, 16), 3, 0.8, 512)
    rows, ts, restricted, _ = rejected_block_targets(target, batch, d2t)  # the re-run path's restricted target
    restricted_t = torch.zeros_like(batch.rej_target_logp)
    drafted = batch.rej_draft_idx[rows, :, ts][..., None]
    restricted_t[rows, :, ts] = restricted.gather(2, drafted).squeeze(2)
    checked = 0
    for (t, d), (best, idx) in want.items():
        if batch.rej_weight[0, d, t] == 0:
            continue
        s = best[idx].float()  # a drafter equal to the restricted target
        assert restricted_t[0, d, t].item() == pytest.approx(s.item(), abs=1e-5)
        assert batch.rej_target_logp_draft[0, d, t].item() == pytest.approx(s.item(), abs=1e-5)  # as recorded
        assert k3(restricted_t[0, d, t], s).item() == pytest.approx(0.0, abs=1e-9)  # its minimum, 0
        assert k3(batch.rej_target_logp[0, d, t], s).item() > 1e-3  # the full-vocabulary target puts it elsewhere
        checked += 1
    assert checked == sum(3 - s.step.num_accepted for s in states)
