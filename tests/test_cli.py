"""The command line on the shipped toy target: real runs, and one-line errors for bad input."""

import json
from pathlib import Path

import pytest

from draftopd.cli import main
from draftopd.drafters import save_drafter
from draftopd.loading import ASSETS
from draftopd.testing import tiny_drafter, tiny_target

TOY_DRAFTER = str(ASSETS / "toy-eagle3")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [
        {"prompt": "What is 47 + 385?"},
        {"messages": [{"role": "user", "content": "Compute (12 + 7) * 4."}]},
        {
            "messages": [
                {"role": "system", "content": "You are a careful math tutor."},
                {"role": "user", "content": "Multiply 68 by 6."},
                {"role": "assistant", "content": "reference answer, ignored"},
            ]
        },
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_generate_writes_steps_and_text(prompt_file, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    rc = main(
        [
            "generate",
            "--drafter",
            TOY_DRAFTER,
            "--prompts",
            str(prompt_file),
            "--max-new-tokens",
            "40",
            "--num-draft-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert r["text"].startswith("<think>")
        assert [t for s in r["steps"] for t in s["emitted"]] == r["output_ids"][1:]
        assert all(len(s["draft_tokens"]) == 4 for s in r["steps"])
    assert sum(s["num_accepted"] for r in rows for s in r["steps"]) > 0
    # Target alone gives the same text at temperature 0.
    alone = tmp_path / "alone.jsonl"
    assert main(["generate", "--prompts", str(prompt_file), "--max-new-tokens", "40", "--out", str(alone)]) == 0
    assert [json.loads(line)["output_ids"] for line in alone.read_text().splitlines()] == [
        r["output_ids"] for r in rows
    ]


def test_eval_reports_tau_and_speed(prompt_file, tmp_path):
    report = tmp_path / "eval.json"
    rc = main(
        [
            "eval",
            "--drafter",
            TOY_DRAFTER,
            "--prompts",
            str(prompt_file),
            "--max-new-tokens",
            "48",
            "--num-draft-tokens",
            "2",
            "4",
            "--json",
            str(report),
        ]
    )
    assert rc == 0
    reports = json.loads(report.read_text())
    assert [r["num_draft_tokens"] for r in reports] == [2, 4]
    for r in reports:
        assert 1.0 <= r["tau"] <= r["num_draft_tokens"] + 1
        assert len(r["acceptance_per_position"]) == r["num_draft_tokens"]
        assert r["tokens_per_s_target_alone"] > 0 and r["speedup"] > 0
        assert r["identical_to_target_alone"] == "3/3"
    assert reports[1]["tau"] > 1.5  # the shipped drafter is trained


def one_line_error(capsys, argv, *needles):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for n in needles:
        assert n in err
    return err


def test_missing_prompt_file(capsys, tmp_path):
    one_line_error(
        capsys,
        ["generate", "--prompts", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")],
        "nope.jsonl",
        "not found",
    )


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{not json", "not valid JSON"),
        ('{"text": "hi"}', "needs a string 'prompt'"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "message 0 needs a 'role'"),
    ],
)
def test_malformed_prompt_line_names_file_and_line(capsys, tmp_path, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "fine"}\n' + line + "\n")
    one_line_error(
        capsys, ["eval", "--drafter", TOY_DRAFTER, "--prompts", str(p), "--json", str(tmp_path / "r")], f"{p}:2", needle
    )


def test_missing_target_and_drafter(capsys, prompt_file, tmp_path):
    one_line_error(
        capsys,
        ["generate", "--target", str(tmp_path), "--prompts", str(prompt_file), "--out", str(tmp_path / "o")],
        "no config.json",
    )
    one_line_error(
        capsys,
        ["generate", "--drafter", str(tmp_path / "d"), "--prompts", str(prompt_file), "--out", str(tmp_path / "o")],
        "drafter",
        "no config.json",
    )


def test_drafter_for_another_vocabulary(capsys, prompt_file, tmp_path):
    tiny = tiny_target(vocab=16)
    save_drafter(tiny_drafter(tiny), tmp_path / "tiny-drafter")
    one_line_error(
        capsys,
        [
            "eval",
            "--drafter",
            str(tmp_path / "tiny-drafter"),
            "--prompts",
            str(prompt_file),
            "--json",
            str(tmp_path / "r"),
        ],
        "vocabulary of 16 tokens",
        "2048",
    )


def test_train_config_typo(capsys, tmp_path):
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "toy-sft.yaml"
    one_line_error(capsys, ["train", str(recipe), "sft.epoch=1"], "did you mean 'sft.epochs'")


def test_bench_unknown_eval_set(capsys, tmp_path):
    argv = ["bench", "opd-vs-sft", "--eval-sets", "humaneva", "--out", str(tmp_path / "b")]
    one_line_error(capsys, argv, "unknown eval set 'humaneva'", "humaneval")


def test_bench_opd_vs_sft_is_a_matched_paired_experiment(tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "bench"
    arms = ["sft-pool", "sft-rollout-temp", "opd", "opd-control"]
    argv = ["bench", "opd-vs-sft", "--steps", "2", "--batch-size", "4", "--eval-every", "1", "--seeds", "0", "1"]
    argv += ["--num-train-prompts", "8", "--num-eval-prompts", "2", "--max-new-tokens", "32", "--eval-ks", "4"]
    report = tmp_path / "r.json"  # --json names the report's path on every bench (default OUT/report.json)
    assert main([*argv, "--arms", *arms, "--eval-sets", "humaneval", "--out", str(out), "--json", str(report)]) == 0
    r = json.loads(report.read_text())
    assert list(r["arms"]) == arms and r["headline"] == "toy/k4"
    # HumanEval's problems, from the package that ships them, held out beside the toy sets.
    assert list(r["start"]) == ["toy/k4", "toy-arithmetic/k4", "toy-code/k4", "humaneval/k4"]
    assert r["eval_sets"]["humaneval"] == 2 and r["arms"]["opd"]["tau"]["humaneval/k4"][0] > 1
    for seed in ("0", "1"):
        runs = {a: r["arms"][a]["seeds"][seed] for a in arms}
        # Matched learner compute: the same optimizer steps and rows per arm; rows of the same prompts' responses,
        # so about the same tokens (each arm draws its own rows).
        assert {v["optimizer_steps"] for v in runs.values()} == {2}
        assert {v["learner_rows"] for v in runs.values()} == {8}
        assert runs["opd"]["learner_tokens"] == pytest.approx(runs["sft-rollout-temp"]["learner_tokens"], rel=0.2)
        assert runs["opd"]["learner_rejected_tokens"] > 0 and runs["opd"]["share_rejected_mean"] > 0
        assert runs["opd-control"]["share_rejected_mean"] == 0 and runs["sft-pool"]["learner_rejected_tokens"] == 0
        assert [c["step"] for c in runs["opd"]["curve"]] == [0, 1, 2]
    # Where greedy verification rejects: a share of the response tokens, the target less sure there than overall.
    rp = r["rejection_points"]["0"]
    assert 0 < rp["rejection_points"] < rp["response_tokens"]
    assert rp["share_of_response_tokens"] == pytest.approx(rp["rejection_points"] / rp["response_tokens"])
    assert 0 < rp["target_top1_prob_at_rejections"] < 1 and rp["target_entropy_at_rejections"] > 0
    # Paired ratios are per seed, then averaged.
    vs = r["arms"]["opd"]["vs"]["sft-pool"]["toy/k4"]
    taus = {a: [r["arms"][a]["seeds"][k]["tau"]["toy/k4"] for k in ("0", "1")] for a in ("opd", "sft-pool")}
    assert vs["per_seed_ratio"] == pytest.approx([o / p for o, p in zip(taus["opd"], taus["sft-pool"])])
    lo, hi = vs["ratio_ci95"]
    assert lo <= vs["ratio"] <= hi
    # Every arm starts from the shipped plateau drafter: its tau per held-out set, from a greedy decode's steps.
    expected = _greedy_tau(str(ASSETS / "toy-eagle3-plateau"), num_prompts=2, max_new_tokens=32, num_draft_tokens=4)
    assert {n: r["start"][f"{n}/k4"][0] for n in expected} == pytest.approx(expected)
    assert (out / "tau_vs_learner_tokens.png").stat().st_size > 10_000
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("draftopd-bench").experiment_id])
    assert run.data.metrics["tau/opd/toy/k4"] == pytest.approx(r["arms"]["opd"]["tau"]["toy/k4"][0])


def _greedy_tau(drafter_dir: str, num_prompts: int, max_new_tokens: int, num_draft_tokens: int) -> dict:
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.drafters import load_drafter
    from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
    from draftopd.loading import eos_ids, load_target, load_tokenizer

    tokenizer, target = load_tokenizer("toy"), load_target("toy", [1, 2, 3])
    engine = SpeculativeEngine(target, load_drafter(drafter_dir, target), eos_ids(tokenizer, "toy"))
    taus = {}
    for name, domain in (("toy", None), ("toy-arithmetic", "arithmetic"), ("toy-code", "code")):
        prompts = encode_chats(tokenizer, toy_prompts("held_out", num_prompts, 0, domain))
        trajs = engine.generate(prompts, SamplingConfig(max_new_tokens, 0.0, num_draft_tokens, 0))
        steps = [s for t in trajs for s in t.steps]
        taus[name] = sum(len(s.emitted) for s in steps) / len(steps)  # a step cut by the budget emits fewer
    return taus
