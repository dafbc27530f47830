"""Stock records against the hook's, for the vLLM tests of every family (test_vllm_backend, test_dflash,
test_pard_vllm).

One engine with full recording decodes once; vLLM's per-request metrics of that decode give the stock records
(what an engine with `record="stock"` builds, steps.stock_steps) and the hook's records of the same requests
give the full ones. They must agree request by request on every step boundary, and give the same replay batch
for what stock records feed (the accepted stream): the same tokens and weights, and the same loss at
rej_coef 0, for both replay units and both accepted-row modes.
"""

from pathlib import Path

import pytest
import torch

from draftopd.messages import ErrorState, SamplingConfig, Trajectory
from draftopd.opd.replay import OPDLossConfig, build_replay_batch, opd_loss, target_to_draft_index
from draftopd.vllm_backend.steps import UNKNOWN, hook_steps, metrics_of, stock_steps
from draftopd.vllm_backend.stock import completion_ids, generate


def stock_and_hook(engine, prompts: list[list[int]], sampling: SamplingConfig) -> tuple[list, list]:
    """(stock trajectories, hook trajectories) of one greedy decode by a full-recording engine."""
    assert engine.record == "full"
    ids, outs = generate(engine.llm, prompts, engine.eos, 0.0, sampling.max_new_tokens)
    records = engine.llm.collective_rpc("draftopd_records")[0]
    stock, hook = [], []
    for p, rid, out in zip(prompts, ids, outs, strict=True):
        output_ids, reason = completion_ids(out.outputs[0], engine.eos)
        s, h = (Trajectory(list(p), output_ids, [], reason, 0, 0.0, engine.num_draft_tokens) for _ in range(2))
        s.steps = stock_steps(s, metrics_of(out.outputs[0]))
        h.steps = hook_steps(h, records.get(rid, []), metrics_of(out.outputs[0]))
        stock.append(s)
        hook.append(h)
    return stock, hook


def assert_same_boundaries(stock: list, hook: list) -> int:
    """Every request: the same steps (position, drafted and accepted counts, emitted tokens), the accepted drafts
    the output shows equal to the hook's; returns the number of steps."""
    n = 0
    for s, h in zip(stock, hook, strict=True):
        assert s.output_ids == h.output_ids
        key = lambda st: (st.position, st.num_drafted, st.num_accepted, st.emitted)  # noqa: E731
        assert [key(x) for x in s.steps] == [key(x) for x in h.steps]
        for x, y in zip(s.steps, h.steps):
            assert not x.scored and y.scored
            shown = min(x.num_accepted, len(x.emitted))  # accepted drafts the output shows
            assert x.draft_tokens[:shown] == y.draft_tokens[:shown]
            assert all(a == UNKNOWN for a in x.draft_tokens[shown:])
        n += len(s.steps)
    return n


def assert_same_replay(stock: list, hook: list, drafter, target, depth: int) -> None:
    """The replay batches stock and hook records give: equal inputs and accepted-stream weights, no rejected
    stream from stock records, and the same Draft-OPD loss at rej_coef 0 (the configuration stock records
    serve), per replay unit and accepted-row mode."""
    t2d = target_to_draft_index(drafter.draft_to_target_ids().cpu(), target.vocab_size)
    states = lambda trajs: [ErrorState(t, i, 0) for t in trajs for i in range(len(t.steps))]  # noqa: E731
    for unit in ("trajectory", "state"):
        for rows in ("all", "anchors"):
            args = (t2d, depth, 0.8, 384)
            bs = build_replay_batch(states(stock), *args, accepted_rows=rows, unit=unit)
            bh = build_replay_batch(states(hook), *args, accepted_rows=rows, unit=unit)
            assert torch.equal(bs.input_ids, bh.input_ids) and torch.equal(bs.valid, bh.valid)
            assert torch.equal(bs.acc_weight, bh.acc_weight) and bs.num_steps == bh.num_steps
            assert bs.rej_weight.sum() == 0 and bh.rej_weight.sum() > 0  # the hook's records do feed it
            cfg = OPDLossConfig(rej_coef=0.0, accepted_rows=rows)
            with torch.no_grad():
                ls, ms = opd_loss(drafter, target, bs, cfg)
                lh, mh = opd_loss(drafter, target, bh, cfg)
            assert float(ls) == pytest.approx(float(lh), rel=1e-6, abs=1e-9)
            assert ms["num_accepted_tokens"] == mh["num_accepted_tokens"] > 0


def tiny_dflash_for_vllm(root: Path):
    """(target, drafter, vLLM drafter directory): a small float32 target saved under `root / "target"` (the toy
    tokenizer beside it: prompts and outputs are token ids) and a briefly trained DFlash drafter exported for
    vLLM, what the DFlash engine and serving tests start vLLM on."""
    import torch

    from draftopd.drafters import export_drafter, save_drafter
    from draftopd.testing import save_target_for_vllm, tiny_target, train_tiny_drafter

    target = tiny_target(vocab=16, hidden=128, dtype=torch.float32)  # vLLM's CPU attention wants head_dim 32
    drafter = train_tiny_drafter(target, kind="dflash")
    save_target_for_vllm(target, root / "target")
    return target, drafter, export_drafter(save_drafter(drafter, root / "ckpt"), "vllm", root / "drafter")
