"""The rejection explorer on real buffers (exact counts on known steps, the toy target's own rollouts through the
CLI into a real MLflow store), and the MLflow dashboard settings: the experiment's kind, the charts' order."""

import json
from collections import Counter
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from draftopd.cli import main
from draftopd.config import BufferConfig, load_config
from draftopd.eval.acceptance import acceptance_stats
from draftopd.eval.rejections import SEQUENCE_ENDED, prompt_domains, rejection_report, toy_samples
from draftopd.loading import load_tokenizer
from draftopd.messages import Trajectory, VerificationStep
from draftopd.opd.buffer import ReplayBuffer
from draftopd.opd.session import DriverState, buffer_metrics
from draftopd.rundir import RunDir
from draftopd.tracking import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND, Tracker, resolve_tracking_uri

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "toy-opd.yaml"
PROMPTS = [  # toy-corpus style prompts, each line naming its domain
    ("arithmetic", "Multiply 46 by 8."),
    ("code", "Write the Python function `read1` from the `_pyio` module:\n```python\ndef read1(self, size=-1):\n```"),
    ("arithmetic", "Cleo has 44 apples. Cleo buys 6 more and then gives away 3. How many apples does Cleo have now?"),
    ("code", "Write the Python function `get_name` from the `email.utils` module:\n```python\ndef get_name(v):\n```"),
    ("arithmetic", "Add 317 and 85."),
    (
        "code",
        "Write the Python function `_proc_gnulong` from the `tarfile` module:\n```python\ndef _proc_gnulong(s):\n```",
    ),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("toy")


def _traj(prompt: list[int], first: int, steps: list[tuple], version: int, prompt_index: int) -> Trajectory:
    """A consistent trajectory from (drafts, num_accepted, emitted) per step."""
    output, records = [first], []
    for drafts, accepted, emitted in steps:
        records.append(VerificationStep(len(prompt) + len(output), drafts, [-0.1] * 3, [-0.2] * 3, accepted, emitted))
        output += emitted
    return Trajectory(prompt, output, records, policy_version=version, num_draft_tokens=3, prompt_index=prompt_index)


def test_tables_count_known_steps_exactly(tokenizer):
    # toy token ids: 21..30 are the digits "0".."9", 38.. the letters "A"..
    a = _traj(
        [38, 39],
        40,
        [
            ([21, 22, 23], 1, [21, 30]),  # "1" rejected at offset 1 for "9", after "C0"
            ([24, 25, 26], 3, [24, 25, 26, 27]),  # all accepted, bonus "6"
            ([22, 23, 24], 0, [30]),  # "1" rejected at offset 0 for "9", after "56"
        ],
        version=1,
        prompt_index=0,
    )
    b = _traj([38], 41, [([22, 21, 21], 2, [22, 21])], version=2, prompt_index=1)  # the budget ended it at "0"
    buf = ReplayBuffer(BufferConfig())
    buf.add([a, b])
    state = json.loads(json.dumps(buf.state_dict()))
    report = rejection_report(state, tokenizer, ["arithmetic", "code"], context=2)
    t = report["tables"]

    assert (report["num_trajectories"], report["num_steps"], report["num_rejections"]) == (2, 4, 3)
    assert t["rejected_tokens"] == [
        {
            "token": '"1"',
            "token_id": 22,
            "rejections": 2,
            "times_judged": 3,  # offset 1 of step a0, offset 0 of a2, offset 0 of b0 (accepted)
            "rejection_rate": 2 / 3,
            "top_replacement": '"9"',
            "replacement_share": 1.0,
        },
        {
            "token": '"0"',
            "token_id": 21,
            "rejections": 1,
            "times_judged": 3,  # offset 0 of a0, offsets 1 and 2 of b0
            "rejection_rate": 1 / 3,
            "top_replacement": SEQUENCE_ENDED,
            "replacement_share": 1.0,
        },
    ]
    assert t["replacements"] == [
        {"rejected": '"1"', "replacement": '"9"', "count": 2, "share": 2 / 3},
        {"rejected": '"0"', "replacement": SEQUENCE_ENDED, "count": 1, "share": 1 / 3},
    ]
    assert t["by_offset"] == [
        {"offset": 0, "steps_reaching": 4, "rejections": 1, "rejection_rate": 1 / 4, "share_of_rejections": 1 / 3},
        {"offset": 1, "steps_reaching": 3, "rejections": 1, "rejection_rate": 1 / 3, "share_of_rejections": 1 / 3},
        {"offset": 2, "steps_reaching": 2, "rejections": 1, "rejection_rate": 1 / 2, "share_of_rejections": 1 / 3},
    ]
    assert [(r["context"], r["rejections"], r["top_rejected"], r["top_replacement"]) for r in t["contexts"]] == [
        ('"10"', 1, '"0"', SEQUENCE_ENDED),
        ('"56"', 1, '"1"', '"9"'),
        ('"C0"', 1, '"1"', '"9"'),
    ]
    version_1 = {"trajectories": 1, "steps": 3, "tau": 7 / 3, "first_draft_acceptance": 2 / 3}
    version_2 = {"trajectories": 1, "steps": 1, "tau": 2.0, "first_draft_acceptance": 1.0}
    assert t["by_policy_version"] == [
        {"policy_version": 1, **version_1, "step_rejection_rate": 2 / 3},
        {"policy_version": 2, **version_2, "step_rejection_rate": 1.0},
    ]
    assert t["by_domain"] == [
        {"domain": "arithmetic", **version_1, "step_rejection_rate": 2 / 3},
        {"domain": "code", **version_2, "step_rejection_rate": 1.0},
    ]
    assert "by_domain" not in rejection_report(state, tokenizer, None)["tables"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokenizer):
    """A Draft-OPD run directory as the session leaves it: config, an MLflow run, and a checkpoint whose buffer
    holds the toy target's greedy rollouts of two policy versions (the shipped toy drafter drafted them)."""
    from draftopd.data.prompts import encode_chats, load_prompts
    from draftopd.drafters import load_drafter
    from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
    from draftopd.loading import ASSETS, eos_ids, load_target

    out = tmp_path_factory.mktemp("runs")
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for d, p in PROMPTS))
    overrides = [f"run.out_dir={out}", "run.name=rej", f"data.prompts={prompts}", "data.num_train_prompts=6"]
    cfg = load_config(RECIPE, overrides)
    run = RunDir(cfg, ["test"])
    chats = load_prompts(cfg.data.prompts, "train", cfg.data.num_train_prompts, cfg.run.seed)
    target = load_target("toy", cfg.target.aux_layer_ids)
    engine = SpeculativeEngine(target, load_drafter(str(ASSETS / "toy-eagle3"), target), eos_ids(tokenizer, "toy"))
    trajs = engine.generate(encode_chats(tokenizer, chats), SamplingConfig(48, 0.0, cfg.rollout.num_draft_tokens))
    for i, t in enumerate(trajs):
        t.prompt_index, t.policy_version = i, 1 + i % 2
    buf = ReplayBuffer(cfg.buffer)
    buf.add(trajs)
    buf.sample(8, current_version=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        tracker = Tracker(run.path, cfg.tracking.experiment, cfg.run.name)
        run_id = tracker.start()
        tracker.end("FINISHED")
    ckpt = run.path / "checkpoints" / "v000002-r0001"
    ckpt.mkdir(parents=True)
    (ckpt / "buffer.json").write_text(json.dumps(buf.state_dict()))
    state = DriverState(policy_version=2, round=1, sft_done=True, mlflow_run_id=run_id)
    (ckpt / "driver_state.json").write_text(json.dumps(state.__dict__))
    (run.path / "checkpoints" / "latest.json").write_text(json.dumps({"dir": ckpt.name}))
    return run.path, trajs, run_id


def test_cli_prints_writes_and_logs_the_tables(run_dir, tmp_path, capsys, monkeypatch):
    path, trajs, run_id = run_dir
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "rejections.json"
    assert main(["rejections", str(path), "--top", "3", "--json", str(out), "--log-mlflow"]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    t = report["tables"]

    # The buffer holds the trajectories with a rejection; the tables count each of their rejections once.
    held = [tr for tr in trajs if any(s.rejected for s in tr.steps)]
    steps = [s for tr in held for s in tr.steps]
    rejected = [s for s in steps if s.rejected]
    assert report["num_trajectories"] == len(held) > 1
    assert (report["num_steps"], report["num_rejections"]) == (len(steps), len(rejected))
    for name, count in [("rejected_tokens", "rejections"), ("replacements", "count"), ("contexts", "rejections")]:
        assert sum(r[count] for r in t[name]) == len(rejected), name
    assert [r["rejections"] for r in t["by_offset"]] == acceptance_stats(held, 4)["accepted_histogram"][:4]
    judged = Counter(tok for s in steps for tok in s.draft_tokens[: s.num_accepted + 1])
    assert all(r["times_judged"] == judged[r["token_id"]] >= r["rejections"] > 0 for r in t["rejected_tokens"])
    assert [r["policy_version"] for r in t["by_policy_version"]] == [1, 2]
    assert {r["domain"] for r in t["by_domain"]} == {"arithmetic", "code"}
    assert sum(r["steps"] for r in t["by_domain"]) == sum(r["steps"] for r in t["by_policy_version"]) == len(steps)

    # Terminal: the ranked tables cut to --top rows (a title, a header, 3 rows), the others whole.
    assert len(t["rejected_tokens"]) > 3 and "policy version 2" in printed
    block = printed.split(f"rejected_tokens (top 3 of {len(t['rejected_tokens'])})\n")[1].split("\n\n")[0]
    assert len(block.splitlines()) == 1 + 3 and t["rejected_tokens"][0]["token"] in block
    block = printed.split("by_offset\n")[1].split("\n\n")[0]
    assert len(block.splitlines()) == 1 + 4
    assert "by_domain\n" in printed and "note:" not in printed

    # MLflow: one table per table in the run, read back as logged; the run's status untouched.
    client = MlflowClient(resolve_tracking_uri(path))
    folder = "rejections/v000002-r0001"
    assert {a.path for a in client.list_artifacts(run_id, folder)} == {
        f"{folder}/{name}.json" for name in [*t, "summary"]
    }
    logged = json.loads(Path(client.download_artifacts(run_id, f"{folder}/by_offset.json", str(tmp_path))).read_text())
    assert [dict(zip(logged["columns"], row)) for row in logged["data"]] == [pytest.approx(r) for r in t["by_offset"]]
    assert client.get_run(run_id).info.status == "FINISHED"
    # MLflow appends to an existing table: logging the same checkpoint again is refused, not doubled.
    assert main(["rejections", str(path), "--log-mlflow"]) == 2
    assert "already holds the table" in capsys.readouterr().err


def test_a_directory_without_a_buffer_is_an_error(run_dir, tmp_path, capsys):
    assert main(["rejections", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text((run_dir[0] / "config.yaml").read_text())
    assert main(["rejections", str(tmp_path)]) == 2
    assert "no saved replay buffer" in capsys.readouterr().err


def test_toy_domains_follow_the_toy_prompts(tmp_path):
    from draftopd.data.prompts import toy_prompts
    from draftopd.toy.corpus import prompt_only

    samples = toy_samples("train", 40, seed=3)
    assert [prompt_only(s) for s in samples] == toy_prompts("train", 40, seed=3)
    assert {s.domain for s in samples} == {"arithmetic", "code"}
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "a", "domain": "x"}\n\n{"prompt": "b", "split": "held_out"}\n{"prompt": "c"}\n')
    assert prompt_domains(str(lines), "train", 10) == ["x", ""]
    assert prompt_domains(str(lines), "held_out", 10) == ["x", "", ""]
    lines.write_text('{"prompt": "a"}\n')
    assert prompt_domains(str(lines), "train", 10) is None


def test_experiments_are_filed_as_model_training(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    Tracker(tmp_path, experiment="fresh").start()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_experiment_by_name("fresh").tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    older = client.create_experiment("older")  # made before the tag existed: tagged when a run starts in it
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})  # set in the UI
    Tracker(tmp_path, experiment="older").start()
    Tracker(tmp_path, experiment="chosen").start()
    assert client.get_experiment(older).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def _chart_section(metric: str) -> str:
    """MLflow's UI: a chart's section is what precedes the metric's last '/' ('' = "Model metrics", shown last)."""
    return metric.rsplit("/", 1)[0] if "/" in metric else ""


def test_buffer_bookkeeping_charts_after_acceptance():
    buf = ReplayBuffer(BufferConfig())
    metrics = buffer_metrics(buf.stats(current_version=0))
    assert {"rollout/buffer/replayed_share", "rollout/buffer/num_discarded_unreplayed"} <= set(metrics)
    acceptance = {_chart_section(m) for m in ("eval/toy/tau", "eval/toy/accept_pos_0", "rollout/tau")}
    assert all(_chart_section(m) > max(acceptance) for m in metrics)  # the UI sorts sections by name
