"""`draftopd plan`: its memory model against measurement, every GPU recipe fitting its GPU, and the train check.

Measured on CPU at the toy size and a mid size: the bytes autograd saves (unique storages seen by
`saved_tensors_hooks`, parameters excluded) over one SFT TTT loss forward and one Draft-OPD learner loss forward,
and the parameters, gradients and AdamW state of a live drafter after one step. Each within 20% of the plan.
"""

import json
import random
from pathlib import Path

import pytest
import torch

from draftopd.cli import main
from draftopd.config import Config, DrafterConfig, load_config
from draftopd.drafters import new_drafter
from draftopd.loading import load_target
from draftopd.messages import ErrorState, Trajectory, VerificationStep
from draftopd.models.target import TargetModel
from draftopd.opd.replay import OPDLossConfig, build_replay_batch, opd_loss, target_to_draft_index
from draftopd.plan import (
    ASSUMED_TAU,
    _optimizer_parts,
    check_before_train,
    loss_saved_bytes,
    make_plan,
    refusal,
    rejected_per_token,
    ttt_activation_bytes,
    ttt_saved_bytes,
)
from draftopd.plan_specs import GiB, PlanError, drafter_shape, shape_from_config
from draftopd.sft.trainer import SFTExample, collate, ttt_loss

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
GPU_RECIPES = [p for p in RECIPES if load_config(p).cluster.gpu]
TOY_RECIPES = [p for p in RECIPES if not load_config(p).cluster.gpu]

# (target: hidden, intermediate, heads, kv heads; drafter: heads, kv heads, intermediate, draft vocab; rows, tokens)
SIZES = {
    "toy": None,  # the shipped toy target (256 wide) and a drafter of the toy recipes' shape, 2 x 256 tokens
    "mid": dict(hidden=512, heads=8, kv=4, inter=1536, vocab=8192, d_heads=8, d_kv=4, d_inter=1536, vd=4096),
}


def _target(size: str, dtype: str) -> TargetModel:
    if size == "toy":
        return load_target("toy", [1, 2, 3], dtype)
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SIZES[size]
    torch.manual_seed(0)
    hf = LlamaConfig(
        hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=4, num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"], vocab_size=s["vocab"], max_position_embeddings=2048,
    )  # fmt: skip
    return TargetModel(LlamaForCausalLM(hf).to(getattr(torch, dtype)).eval(), [1, 2, 3])


# (size, dtype): both sizes in float32, and the toy size in bfloat16, the GPU recipes' dtype (fp32 norm copies)
CASES = [("toy", "float32"), ("mid", "float32"), ("toy", "bfloat16")]


def _setup(size: str, dtype: str = "float32"):
    """(target, drafter, the planner's DrafterShape for the same recipe section, rows, tokens)."""
    target = _target(size, dtype)
    cfg = Config()
    cfg.target.aux_layer_ids = [1, 2, 3]
    if size == "toy":
        cfg.drafter = DrafterConfig(num_attention_heads=8, num_key_value_heads=4, draft_vocab_size=1024)
        rows, seq = 2, 256
    else:
        s = SIZES[size]
        cfg.drafter = DrafterConfig(
            num_attention_heads=s["d_heads"], num_key_value_heads=s["d_kv"], intermediate_size=s["d_inter"],
            draft_vocab_size=s["vd"],
        )  # fmt: skip
        rows, seq = 2, 512
    torch.manual_seed(0)
    vd = cfg.drafter.draft_vocab_size
    draft_vocab = torch.sort(torch.randperm(target.vocab_size)[:vd]).values
    drafter = new_drafter(cfg.drafter, target, draft_vocab)
    shape = drafter_shape(cfg, shape_from_config(target.model.config.to_dict()))
    return target, drafter, shape, rows, seq


def saved_bytes(fn, module: torch.nn.Module) -> int:
    """Bytes of the unique storages autograd saves while `fn` runs, the module's parameters and buffers excluded."""
    skip = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def _close(estimate: float, measured: float, what: str) -> None:
    print(f"{what}: estimate {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert abs(estimate - measured) <= 0.2 * measured, (what, estimate, measured)


@pytest.mark.parametrize("size, dtype", CASES)
def test_sft_ttt_saved_bytes_match_the_plan(size, dtype):
    target, drafter, shape, rows, seq = _setup(size, dtype)
    gen = random.Random(0)
    examples = [SFTExample([gen.randrange(3, target.vocab_size) for _ in range(seq)], 16) for _ in range(rows)]
    batch = collate(examples, seq)
    measured = saved_bytes(lambda: ttt_loss(drafter, target, batch, 7, 0.8)[0], drafter)
    e = drafter.fc.weight.element_size()
    estimate = ttt_saved_bytes(shape, rows, seq, 7, e) + loss_saved_bytes(shape, rows, seq, 7)
    _close(estimate, measured, f"{size} {dtype} SFT TTT (T={seq})")
    if size == "mid":  # the seam scripts/gpu-check reads gives the same figure at a drafter shape
        s = shape
        seam = ttt_activation_bytes(hidden=s.hidden, intermediate=s.intermediate, heads=s.heads,
                                    kv_heads=s.kv_heads, draft_vocab=s.draft_vocab, vocab=s.vocab, depth=7,
                                    seq_len=seq, batch=rows, dtype_bytes=e)  # fmt: skip
        assert seam == estimate


def _trajectory(vocab: int, prompt: int, length: int, k: int, accepted: int, rng: random.Random) -> Trajectory:
    """A rollout whose every step accepted `accepted` of its k drafts (tau = accepted + 1), with the records the
    rejected stream reads (target log-probs and the draft-vocabulary log-mass)."""
    ids = [rng.randrange(3, vocab) for _ in range(length)]
    steps, pos = [], prompt + 1
    while pos + accepted + 1 <= length - 1:
        drafts = ids[pos : pos + accepted] + [rng.randrange(3, vocab) for _ in range(k - accepted)]
        emitted = ids[pos : pos + accepted + 1]
        lp = [-rng.random() for _ in range(k)]
        steps.append(VerificationStep(pos, drafts, lp, lp, accepted, emitted, target_draft_logz=[-0.1] * k))
        pos += accepted + 1
    return Trajectory(ids[:prompt], ids[prompt:], steps, policy_version=0, num_draft_tokens=k)


@pytest.mark.parametrize("size, dtype", CASES)
def test_opd_loss_saved_bytes_match_the_plan(size, dtype):
    target, drafter, shape, rows, seq = _setup(size, dtype)
    k, rng = 7, random.Random(1)
    accepted = int(ASSUMED_TAU) - 1
    trajs = [_trajectory(target.vocab_size, 8, seq, k, accepted, rng) for _ in range(rows)]
    states = [ErrorState(t, 0, 0) for t in trajs]
    t2d = target_to_draft_index(drafter.draft_to_target_ids(), target.vocab_size)
    batch = build_replay_batch(states, t2d, k, 0.8, seq, unit="trajectory")
    measured = saved_bytes(lambda: opd_loss(drafter, target, batch, OPDLossConfig())[0], drafter)
    e = drafter.fc.weight.element_size()
    estimate = ttt_saved_bytes(shape, rows, seq, k, e) + loss_saved_bytes(shape, rows, seq, k, rejected_per_token(k))
    _close(estimate, measured, f"{size} {dtype} Draft-OPD loss (T={seq})")


@pytest.mark.parametrize("size", list(SIZES))
def test_parameters_gradients_and_adamw_state_match_the_plan(size):
    target, drafter, shape, rows, seq = _setup(size)
    params = sum(p.numel() * p.element_size() for p in drafter.parameters())
    params += sum(b.numel() * b.element_size() for b in drafter.buffers())
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == shape.trainable_params
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    examples = [SFTExample(list(range(3, 67)), 8)]
    ttt_loss(drafter, target, collate(examples, 64), 2, 0.8)[0].backward()
    opt.step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    planned = _optimizer_parts(shape.trainable_params, 4, 0, 1, deepspeed=False)
    _close((shape.trainable_params + shape.frozen_params) * 4 + shape.buffer_bytes, params, f"{size} drafter weights")
    _close(planned["gradients"] * GiB, grads, f"{size} gradients")
    _close(planned["optimizer"] * GiB, state, f"{size} AdamW state")


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_every_gpu_recipe_fits_its_gpu(recipe):
    cfg = load_config(recipe)
    plan = make_plan(cfg, str(recipe))
    assert plan.device.name != "CPU" and refusal(plan) is None
    assert all(role.on_gpu and role.fits for role in plan.roles.values()), {k: r.gib for k, r in plan.roles.items()}
    assert set(plan.roles) == {"rollout_worker", "learner_sft", "learner_opd"}
    # evaluation at the rollout's K: the vLLM engines are not rebuilt for it
    assert cfg.eval.num_draft_tokens == [cfg.rollout.num_draft_tokens]
    text = recipe.read_text()
    assert "never run on" in text.lower() and "draftopd plan" in text, "the top comment says what is and is not known"


def test_the_old_qwen3_8b_layout_is_refused_with_the_knob_to_turn(capsys):
    rc = main(["train", str(ROOT / "recipes" / "qwen3-8b.yaml"), "learner.batch_size=4"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "learner rank (Draft-OPD) needs" in err and "H100-80GB" in err and "learner.batch_size (4)" in err


@pytest.mark.parametrize("recipe", TOY_RECIPES, ids=lambda p: p.stem)
def test_toy_recipes_are_never_refused(recipe):
    cfg = load_config(recipe)
    check_before_train(cfg, str(recipe))  # what `draftopd train` runs first: no ConfigError
    try:
        plan = make_plan(cfg, str(recipe))
    except PlanError:  # a family the planner does not model: train goes ahead
        assert cfg.drafter.kind != "eagle3"
        return
    assert refusal(plan) is None and not any(role.on_gpu for role in plan.roles.values())


def test_plan_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", str(ROOT / "recipes" / "qwen3-8b.yaml"), "learner.max_seq_len=4096", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "learner rank (Draft-OPD): fits" in text and "whole run" in text
    report = json.loads(out.read_text())
    assert set(report["roles"]) == {"rollout_worker", "learner_sft", "learner_opd"}
    for role in report["roles"].values():
        assert {"gib", "capacity_gib", "fits", "parts"} <= set(role)
        assert role["gib"] == pytest.approx(sum(role["parts"].values()), abs=0.01)
    assert report["hours"] > 0 and report["gpu"] == "H100-80GB"


def test_overlapped_hours_and_the_split_that_minimises_them():
    """The overlapped phase: the first round alone, then each beside the learning before it, the last learning
    alone; the plan's split keeps every role within its GPU and the global learner batch, and no other fitting
    split of the recipe's GPUs is faster."""
    from draftopd.plan import overlapped_seconds

    assert overlapped_seconds(10, 3.0, 3.0) == 33.0  # against 60 synchronous: (R + L) / max(R, L) as rounds grow
    assert overlapped_seconds(10, 5.0, 1.0) == 5.0 + 9 * 5.0 + 1.0
    cfg = load_config(ROOT / "recipes" / "qwen3-8b.yaml")
    plan = make_plan(cfg, "qwen3-8b")
    t, sp = plan.time, plan.split
    assert t["total_overlapped_hours"] < t["total_hours"]
    gpus = int(cfg.rollout.num_workers * cfg.rollout.num_gpus_per_worker) + cfg.learner.num_learners
    assert sp["gpus"] == gpus and sp["rollout_workers"] + sp["learner_ranks"] == gpus
    assert sp["learner_batch_size"] * sp["learner_ranks"] >= cfg.learner.batch_size * cfg.learner.num_learners
    for workers in range(1, gpus):
        over = [f"rollout.num_workers={workers}", f"learner.num_learners={gpus - workers}"]
        rows = -(-cfg.learner.batch_size * cfg.learner.num_learners // (gpus - workers))
        other = make_plan(load_config(ROOT / "recipes" / "qwen3-8b.yaml", [*over, f"learner.batch_size={rows}"]))
        if all(role.fits for role in other.roles.values()):
            assert other.time["total_overlapped_hours"] >= sp["hours_overlapped"] - 1e-9
    chosen = [f"rollout.num_workers={sp['rollout_workers']}", f"learner.num_learners={sp['learner_ranks']}"]
    chosen.append(f"learner.batch_size={sp['learner_batch_size']}")
    assert all(r.fits for r in make_plan(load_config(ROOT / "recipes" / "qwen3-8b.yaml", chosen)).roles.values())
