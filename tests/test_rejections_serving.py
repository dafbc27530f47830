"""`draftopd rejections` on a `draftopd serve` run directory: the saved traffic buffer, by version and domain.

The run directory is made by the serve package's own code without starting a server: `open_session` (version 0
from the shipped drafter), the session's MLflow run (`server._tracker`), a promoted version 1 in the version store
and serving.json, and traffic decoded by the native engine (which records what vLLM's hook records) added to the
session's buffer with the server's domains and saved by `session.save_buffer`. The report's figures are checked
against counts made here from those trajectories.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from mlflow import MlflowClient

from draftopd.cli import main
from draftopd.data.prompts import encode_chats
from draftopd.drafters import load_drafter
from draftopd.engine.speculative import SpeculativeEngine
from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_drafter_path
from draftopd.messages import SamplingConfig
from draftopd.serve.records import traffic_domain
from draftopd.serve.server import _tracker, open_session
from draftopd.serve.session import StoredDrafter
from draftopd.serve.settings import ServeSettings
from draftopd.tracking import resolve_tracking_uri

K = 4
CHATS = (  # in the toy corpus's style (building the corpus for its prompts would take seconds)
    "Add 11 and 569.",
    "Multiply 23 by 7.",
    "Write the Python function `_from_parsed_parts` from the `pathlib` module:\n```python\n"
    "def _from_parsed_parts(cls, drv, root, parts):\n```",
    "Name three rivers.",
)


@pytest.fixture(scope="module")
def serving_run(tmp_path_factory):
    """(run directory, the trajectories its buffer holds with their domains, the MLflow run id)."""
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        run = tmp_path_factory.mktemp("serve-run")
        session, _ = open_session(ServeSettings(run_dir=str(run), target="toy", drafter="toy", num_draft_tokens=K))
        tracker = _tracker(session.settings, session)
        target, tok = load_target("toy", [1, 2, 3]), load_tokenizer("toy")
        eos = eos_ids(tok, "toy")
        chats = [[{"role": "user", "content": text}] for text in CHATS]
        prompts = encode_chats(tok, chats) + encode_chats(tok, chats, enable_thinking=False)
        kept, domains = [], []
        for version, name in ((0, "toy"), (1, "toy-plateau")):
            if version:  # promoted as the session stores a version, then serving.json names it
                session.store.save(StoredDrafter.read(resolve_drafter_path(name)), version, {"source": name})
                session.version, session.history = version, [*session.history, version]
                session._write_serving()
            drafter = load_drafter(resolve_drafter_path(name), target).eval()
            trajs = SpeculativeEngine(target, drafter, eos).generate(prompts, SamplingConfig(24, 0.0, K, 0), version)
            trajs = [t for t in trajs if t.steps]  # the server keeps requests with a verification step
            doms = [traffic_domain(tok.decode(t.prompt_ids)) for t in trajs]
            session.buffer.add(trajs, doms)
            kept, domains = kept + trajs, domains + doms
        session.save_buffer()
        tracker.end()
    return run, kept, domains, tracker.run_id


def test_the_report_counts_what_the_served_trajectories_hold(serving_run, tmp_path, capsys, monkeypatch):
    run, trajs, domains, run_id = serving_run
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "r.json"
    assert main(["rejections", str(run), "--top", "3", "--json", str(out), "--log-mlflow"]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    t = report["tables"]
    assert report["target"] == "toy" and report["version_serving"] == 1  # from the MLflow run and serving.json

    steps = [s for tr in trajs for s in tr.steps]
    rejected = [s for s in steps if s.rejected]
    assert (report["num_trajectories"], report["num_steps"]) == (len(trajs), len(steps))
    assert report["num_rejections"] == len(rejected) > 0 and len(rejected) < len(steps)  # accepted ones too
    for name, count in [("rejected_tokens", "rejections"), ("replacements", "count"), ("contexts", "rejections")]:
        assert sum(r[count] for r in t[name]) == len(rejected), name
    assert [r["rejections"] for r in t["by_offset"]] == [sum(s.num_accepted == a for s in rejected) for a in range(K)]
    judged = Counter(tok for s in steps for tok in s.draft_tokens[: s.num_accepted + 1])
    assert all(r["times_judged"] == judged[r["token_id"]] for r in t["rejected_tokens"])

    def expect(keys):  # (trajectories, steps, tau = tokens emitted per step) per group, counted here
        rows = {}
        for tr, key in zip(trajs, keys):
            n, s, e = rows.get(key, (0, 0, 0))
            rows[key] = (n + 1, s + len(tr.steps), e + sum(len(x.emitted) for x in tr.steps))
        return {key: (n, s, pytest.approx(e / s)) for key, (n, s, e) in rows.items()}

    def got(rows, name):
        return {r[name]: (r["trajectories"], r["steps"], r["tau"]) for r in rows}

    assert got(t["by_policy_version"], "policy_version") == expect([tr.policy_version for tr in trajs])
    assert {r["policy_version"] for r in t["by_policy_version"]} == {0, 1}
    assert got(t["by_domain"], "domain") == expect(domains)
    assert {"arithmetic", "arithmetic/think-off", "code", "other/think-off"} <= set(domains)  # as the server classes
    held = [i % 5 == 4 for i in range(len(trajs))]  # every 5th recorded request is held out
    assert got(t["by_slice"], "slice") == expect(["holdout" if h else "train" for h in held])

    assert "held in the traffic buffer" in printed and "drafter version serving: 1" in printed
    assert "by_domain\n" in printed and "by_slice\n" in printed and "note:" not in printed
    # MLflow: the tables in the serving session's run, named after the buffer's count of recorded requests.
    folder = f"rejections/traffic-{len(trajs):06d}"
    client = MlflowClient(resolve_tracking_uri(run))
    assert {a.path for a in client.list_artifacts(run_id, folder)} == {f"{folder}/{n}.json" for n in [*t, "summary"]}


def test_target_given_or_named_and_directories_of_neither_kind_are_one_line_errors(serving_run, tmp_path, capsys):
    run = serving_run[0]
    bare = tmp_path / "bare"  # served traffic without the MLflow store that names the target
    shutil.copytree(run / "traffic", bare / "traffic")
    assert main(["rejections", str(bare)]) == 2
    assert "give --target" in capsys.readouterr().err
    assert main(["rejections", str(bare), "--target", "toy", "--log-mlflow"]) == 2
    assert "no MLflow run of draftopd serve" in capsys.readouterr().err
    assert main(["rejections", str(bare), "--target", "toy"]) == 0
    assert f"{len(serving_run[1])} trajectories held in the traffic buffer" in capsys.readouterr().out

    fresh = tmp_path / "fresh"  # a serving run before its first save of the buffer
    shutil.copytree(run / "versions", fresh / "versions")
    assert main(["rejections", str(fresh)]) == 2
    err = capsys.readouterr().err
    assert "no saved traffic yet" in err and len(err.strip().splitlines()) == 1
    assert main(["rejections", str(tmp_path / "bare" / "traffic")]) == 2  # neither kind
    err = capsys.readouterr().err
    assert "not a run directory" in err and "draftopd serve" in err and len(err.strip().splitlines()) == 1
