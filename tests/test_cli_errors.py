"""Bad input ends in one line on stderr and exit status 2, through the command line, before any model work.

One test per bad input a new user tried (issue: "Tried as a new user would"), and `--help` showing defaults and,
for each bench, only that bench's flags.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from draftopd.cli import build_parser, main
from draftopd.loading import ASSETS
from draftopd.reports import write_json

REPO = Path(__file__).resolve().parents[1]
TOY_DRAFTER = str(ASSETS / "toy-eagle3")


def _refused(capsys, argv: list[str]) -> str:
    """Run argv; it must stop with status 2 and exactly one line on stderr, which is returned."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # the parser's refusals
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory):
    from draftopd.config import DrafterConfig
    from draftopd.drafters import new_drafter, save_drafter
    from draftopd.loading import load_target

    target = load_target("toy", [1, 2, 3])
    torch.manual_seed(0)
    cfg = DrafterConfig(kind="dflash", num_hidden_layers=1, block_size=8, mask_token_id=5)
    return save_drafter(new_drafter(cfg, target, torch.arange(target.vocab_size)), tmp_path_factory.mktemp("dflash"))


@pytest.mark.parametrize("k", ["-3", "0"])
def test_generate_refuses_fewer_than_one_draft_token(k, capsys, tmp_path):
    argv = ["generate", "--drafter", TOY_DRAFTER, "--prompts", "toy", "--num-draft-tokens", k]
    err = _refused(capsys, [*argv, "--out", str(tmp_path / "g.jsonl")])
    assert f"--num-draft-tokens: must be at least 1, not {k}" in err
    assert not (tmp_path / "g.jsonl").exists()


def test_eval_refuses_zero_draft_tokens(capsys, tmp_path):
    argv = ["eval", "--drafter", TOY_DRAFTER, "--prompts", "toy", "--num-draft-tokens", "4", "0"]
    err = _refused(capsys, [*argv, "--json", str(tmp_path / "e.json")])
    assert "--num-draft-tokens: must be at least 1, not 0" in err and not (tmp_path / "e.json").exists()


def test_reports_never_hold_nan(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, [{"tau": float("nan"), "speedup": 1.5, "per": [float("inf"), 2.0]}])
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == [{"tau": None, "speedup": 1.5, "per": [None, 2.0]}]


@pytest.mark.parametrize("command", ["train", "plan"])
def test_config_refuses_fewer_than_one_draft_token(command, capsys, tmp_path):
    recipe = str(REPO / "recipes" / "toy-opd.yaml")
    err = _refused(capsys, [command, recipe, "rollout.num_draft_tokens=-2", f"run.out_dir={tmp_path}"])
    assert "rollout.num_draft_tokens=-2" in err and "at least 1" in err
    assert not any(tmp_path.iterdir())  # nothing started
    err = _refused(capsys, ["plan", recipe, "eval.num_draft_tokens=[4,0]"])
    assert "eval.num_draft_tokens=[4, 0]" in err


def test_diagnose_names_the_family_it_does_not_support(dflash_dir, capsys, tmp_path):
    argv = ["diagnose", "--drafter", str(dflash_dir), "--aux-layer-ids", "1", "2", "3", "--num-prompts", "1"]
    err = _refused(capsys, [*argv, "--json", str(tmp_path / "d.json")])
    assert "'dflash' drafter" in err and "EAGLE-3 chains only" in err


def test_rejections_on_an_sft_run_says_it_has_no_replay_buffer(capsys, tmp_path):
    run = tmp_path / "toy-sft"
    shutil.copytree(ASSETS / "toy-eagle3", run / "checkpoints" / "final")  # what an SFT run leaves
    shutil.copy(REPO / "recipes" / "toy-sft.yaml", run / "config.yaml")
    err = _refused(capsys, ["rejections", str(run)])
    assert "no Draft-OPD replay buffer" in err and "SFT run" in err and "no checkpoint yet" not in err


def test_export_names_the_family_and_its_formats(dflash_dir, capsys, tmp_path):
    argv = ["export", "--drafter", str(dflash_dir), "--format", "sglang", "--out", str(tmp_path / "x")]
    err = _refused(capsys, argv)
    assert "a 'dflash' drafter exports to vllm only, not 'sglang'" in err and not (tmp_path / "x").exists()


def test_a_missing_target_directory_says_so(capsys, tmp_path):
    missing = str(tmp_path / "Qwen3-8B")
    err = _refused(capsys, ["generate", "--target", missing, "--prompts", "toy", "--out", str(tmp_path / "g")])
    assert f"target {missing}: no such directory" in err and "never downloaded" in err
    err = _refused(capsys, ["inspect", TOY_DRAFTER, "--target", "Qwen/Qwen3-8B"])
    assert "target Qwen/Qwen3-8B: no such directory" in err and "hf download" in err


def test_cluster_submit_checks_the_recipe_before_printing(capsys, tmp_path):
    recipe = str(REPO / "recipes" / "qwen3-8b.yaml")
    err = _refused(capsys, ["cluster", "submit", recipe])
    assert "target.path=Qwen/Qwen3-8B: no such directory" in err and "hf download Qwen/Qwen3-8B" in err
    assert capsys.readouterr().out == ""  # no submit line
    model = tmp_path / "Qwen3-8B"
    model.mkdir()
    (model / "config.json").write_text("{}")
    err = _refused(capsys, ["cluster", "submit", recipe, "--set", f"target.path={model}"])
    assert "data.prompts=pools/qwen3-8b: no such file or pool" in err and "prepare-data" in err
    # absolute paths live on the cluster's storage: the line is printed
    sets = ["--set", "target.path=/data/models/Qwen3-8B", "--set", "data.prompts=/data/pool"]
    assert main(["cluster", "submit", recipe, *sets, "--set", "data.eval_prompts=/data/pool"]) in (0, None)
    assert "ray job submit" in capsys.readouterr().out


def test_train_checks_the_recipe_before_starting_anything(capsys, tmp_path):
    recipe = str(REPO / "recipes" / "qwen3-8b.yaml")
    err = _refused(capsys, ["train", recipe, f"run.out_dir={tmp_path}"])
    assert "target.path=Qwen/Qwen3-8B: no such directory" in err
    assert not any(tmp_path.iterdir())


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "K, drafts per step (with --drafter) (default: 4)" in out and "(default: 128)" in out


def _flags(argv: list[str], capsys) -> set[str]:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return {w.strip(",[]") for w in capsys.readouterr().out.split() if w.startswith(("--", "[--"))}


def test_each_bench_lists_only_its_own_flags(capsys):
    # the two serving benches share their server's and traffic's flags; their --learner is the server's learner
    # overrides, as opd-vs-sft's is its learner's
    serving = {"--concurrency", "--shift", "--server-arg", "--learner", "--replicas"}
    own = {
        "opd-vs-sft": {"--arms", "--learner", "--eval-ks", "--rollout-temperature"},
        "sft-plateau": {"--num-anchors"},
        "engines": {"--prompt-lookup-tokens", "--vllm-python"},
        "rollout": set(),
        "families": {"--drafters", "--pairs", "--no-naive-resample"},
        "serve-adapt": serving | {"--num-requests", "--window", "--domain", "--rate", "--control-drafter"},
        "serve-load": serving | {"--duration-s", "--num-prompts", "--learning-arms"},
    }
    every = set().union(*own.values())
    for bench, mine in own.items():
        flags = _flags(["bench", bench], capsys)
        assert mine <= flags, bench
        assert not (every - mine) & flags, (bench, (every - mine) & flags)


BENCHES = ("opd-vs-sft", "sft-plateau", "engines", "rollout", "families", "serve-adapt", "serve-load")


def test_every_bench_takes_the_same_report_flag(capsys):
    """`--json PATH` means the same on every bench: the report's path, by default OUT/report.json."""
    for bench in BENCHES:
        with pytest.raises(SystemExit):
            main(["bench", bench, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "--json PATH the report's path (default: OUT/report.json)" in out, bench
        assert "--out DIR a directory for the report" in out, bench
        args = build_parser().parse_args(["bench", bench])
        assert (args.json, args.out) == (None, f"runs/bench-{bench}"), bench


def test_every_flag_of_every_command_shows_its_help_and_default():
    """A flag without help hides its default from `--help` (argparse formats no line for it)."""
    import argparse

    def bare(parser, path):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from bare(sub, f"{path} {name}")
            elif a.option_strings and not a.help:
                yield f"{path} {a.option_strings[0]}"

    assert list(bare(build_parser(), "draftopd")) == []


def test_top_level_help_groups_every_command_by_job(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    headings = ["train:", "evaluate:", "inspect and convert:", "cluster:", "benchmarks:"]
    assert [line for line in out.splitlines() if line in headings] == headings
    commands = parser._subparsers._group_actions[0].choices
    listed = {line.split()[0] for line in out.split("train:", 1)[1].splitlines() if line.startswith("  ")}
    assert listed == set(commands)


def test_train_refuses_more_gpus_than_its_own_ray_would_have(capsys, tmp_path, monkeypatch):
    if torch.cuda.device_count() >= 8:
        pytest.skip("this machine has the 8 GPUs the recipe asks for")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model, train, held = tmp_path / "Qwen3-8B", tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for path in (train, held):
        path.write_text('{"prompt": "hi"}\n')
    sets = [f"target.path={model}", f"data.prompts={train}", f"data.eval_prompts={held}", f"run.out_dir={tmp_path}/r"]
    err = _refused(capsys, ["train", str(REPO / "recipes" / "qwen3-8b.yaml"), *sets])
    assert "ask Ray for 8 GPUs and this machine has" in err and "cluster submit" in err
    assert not (tmp_path / "r").exists()


def test_a_shipped_drafters_name_is_accepted_where_a_drafter_directory_is(tmp_path, capsys):
    """`--drafter toy` (or toy-plateau, toy-driftfix) names the shipped drafter, as the benches already took it."""
    from draftopd.cli import build_parser
    from draftopd.loading import ASSETS

    commands = (["generate", "--out", "o", "--prompts", "toy"], ["eval", "--json", "r"], ["export", "--out", "o"])
    for argv in (*commands, ["diagnose", "--json", "r"]):
        for name, folder in (("toy", "toy-eagle3"), ("toy-driftfix", "toy-eagle3-driftfix")):
            args = build_parser().parse_args([*argv, "--drafter", name])
            got = args.drafter[0] if isinstance(args.drafter, list) else args.drafter
            assert got == str(ASSETS / folder), argv
    out = tmp_path / "g.jsonl"
    argv = ["generate", "--drafter", "toy-plateau", "--prompts", "toy", "--max-new-tokens", "8", "--out", str(out)]
    assert main(argv) == 0
    assert out.read_text().count("\n") >= 1 and '"steps"' in out.read_text()
