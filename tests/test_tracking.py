"""Tracker against a real MLflow sqlite store, the acceptance plot, and a real MLflow UI server on 127.0.0.1."""

import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from draftopd.eval.plots import acceptance_curve_plot
from draftopd.ports import free_port
from draftopd.tracking import Tracker, flatten, ui_command

pytest.importorskip("mlflow")

DRAFTOPD = Path(sys.executable).parent / "draftopd"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One run directory whose sqlite store is shared by the tests here (creating one costs ~5-10 s)."""
    run_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        tracker = Tracker(run_dir, experiment="exp", run_name="first")
        tracker.start()
        tracker.end()
    return run_dir


def _client(db):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{db}")


def test_flatten_nests_with_dots_and_stringifies():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None, "f": {}}) == {
        "a.b": "1",
        "a.c.d": "[1, 2]",
        "e": "None",
        "f": "{}",
    }
    assert len(flatten({"long": "x" * 10_000})["long"]) == 6000


def test_params_and_metrics_read_back_exactly(store, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker(store, experiment="exp", run_name="metrics")
    run_id = tracker.start()
    assert tracker.run_id == run_id
    tracker.log_params(
        {"train": {"lr": 1e-3, "kinds": ["fkl", "rkl"]}, "seed": 0, **{f"many.p{i}": i for i in range(150)}}
    )  # > 100: two batches
    values = {0: 1.5, 1: 2.25, 3: 3.125}
    for version, tau in values.items():
        tracker.log_metrics({"tau": tau, "loss/fkl": -tau, "bad": math.nan, "worse": math.inf}, step=version)
    tracker.set_tags({"phase": "sft", "num_gpus": 0})
    artifact = tmp_path / "note.txt"
    artifact.write_text("hello")
    tracker.log_artifact(artifact, "notes")
    tracker.log_dict({"k": 1}, "config.json")
    tracker.end()

    client = _client(store / "mlflow.db")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.001"
    assert run.data.params["train.kinds"] == "['fkl', 'rkl']"
    assert run.data.params["seed"] == "0" and run.data.params["many.p149"] == "149"
    assert run.data.tags["phase"] == "sft" and run.data.tags["num_gpus"] == "0"
    history = client.get_metric_history(run_id, "tau")
    assert sorted((m.step, m.value) for m in history) == sorted(values.items())
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss/fkl")) == [
        (0, -1.5),
        (1, -2.25),
        (3, -3.125),
    ]
    assert client.get_metric_history(run_id, "bad") == [] and client.get_metric_history(run_id, "worse") == []
    assert tracker.num_nonfinite_metrics == 6
    paths = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "notes")}
    assert {"config.json", "notes/note.txt"} <= paths
    assert (store / "mlartifacts").is_dir()  # artifacts stay in the run directory, not in ./mlruns


def test_resume_continues_the_same_run(store, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = Tracker(store, experiment="exp", run_name="resumable")
    run_id = first.start()
    first.log_params({"lr": 0.1})
    first.log_metrics({"tau": 2.0}, step=1)
    first.end("KILLED")

    again = Tracker(store, experiment="exp", run_name="resumable")
    assert again.start(resume_run_id=run_id) == run_id
    client = _client(store / "mlflow.db")
    assert client.get_run(run_id).info.status == "RUNNING"
    again.log_params({"lr": 0.1, "resumed": True})  # an already logged param is skipped, not an error
    again.log_metrics({"tau": 2.5}, step=2)
    again.end()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1", "resumed": "True"}
    assert [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, "tau"), key=lambda m: m.step)] == [
        (1, 2.0),
        (2, 2.5),
    ]
    runs = client.search_runs([run.info.experiment_id], "attributes.run_name = 'resumable'")
    assert [r.info.run_id for r in runs] == [run_id]  # no second run was created


def test_environment_tracking_uri_wins(tmp_path, monkeypatch):
    other = tmp_path / "elsewhere.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{other}")
    tracker = Tracker(tmp_path / "run", tracking_uri="sqlite:///ignored.db")
    run_id = tracker.start()
    tracker.log_metrics({"tau": 1.0}, step=0)
    tracker.end()
    assert tracker.tracking_uri == f"sqlite:///{other}"
    assert other.is_file() and not (tmp_path / "run" / "mlflow.db").exists()
    assert [m.value for m in _client(other).get_metric_history(run_id, "tau")] == [1.0]


def test_acceptance_plot_is_a_readable_png(tmp_path):
    from PIL import Image

    history = [
        {
            "policy_version": v,
            "tau": 2 + 0.1 * v,
            "tau_ceiling": 5,
            "acceptance_per_position": [0.8, 0.6, 0.4, 0.3][: 2 + v % 3],
        }
        for v in range(8)
    ]
    history[5]["eval/gsm8k/tau"] = 2.4
    history[7]["eval/gsm8k/tau"] = 2.7
    out = acceptance_curve_plot(list(reversed(history)), tmp_path / "plots" / "acceptance.png", sft_end_version=3)
    assert out == tmp_path / "plots" / "acceptance.png"
    assert out.stat().st_size > 10_000
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (1200, 450)
    assert acceptance_curve_plot([{"policy_version": 0}], tmp_path / "empty.png").stat().st_size > 0


def test_ui_command_binds_localhost_with_one_worker(store):
    cmd = ui_command(str(store), port=5055)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "5055"
    assert cmd[cmd.index("--workers") + 1] == "1"
    assert "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false" in cmd
    assert cmd[cmd.index("--backend-store-uri") + 1] == f"sqlite:///{(store / 'mlflow.db').resolve()}"
    assert cmd[cmd.index("--default-artifact-root") + 1] == (store / "mlartifacts").resolve().as_uri()
    uri = ui_command("postgresql://db/mlflow")
    assert (
        uri[uri.index("--backend-store-uri") + 1] == "postgresql://db/mlflow" and "--default-artifact-root" not in uri
    )
    with pytest.raises(FileNotFoundError):
        ui_command(str(store / "missing"))


def test_ui_serves_the_run_and_a_sigterm_ends_the_server(store):
    """`draftopd ui RUN_DIR` answers on localhost; SIGTERM to it frees the port and leaves no process behind."""
    port = free_port()
    ui = subprocess.Popen(
        [str(DRAFTOPD), "ui", str(store), "--port", str(port)],
        start_new_session=True,  # a group of its own, so the cleanup below reaches only what this test started
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children = {}
    try:
        _wait_for_health(port, ui)
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name?experiment_name=exp", timeout=10
        ) as r:
            assert b'"exp"' in r.read()  # it serves the run directory's store
        children = _descendants(ui.pid)
        assert len(children) >= 2, children  # the mlflow CLI and its uvicorn server, at least
        ui.send_signal(signal.SIGTERM)
        rc = ui.wait(timeout=30)
        survivors = {pid: start for pid, start in children.items() if _runs(pid, start)}
        assert not survivors, f"processes of the UI outlived it: {survivors}"
        assert _port_is_free(port)
        assert rc == 128 + signal.SIGTERM
    finally:
        for pid, start in children.items():
            if _runs(pid, start):
                os.kill(pid, signal.SIGKILL)
        _stop_group(ui)


def _wait_for_health(port: int, proc: subprocess.Popen, seconds: float = 60) -> None:
    status, deadline = None, time.monotonic() + seconds
    while status is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                status = r.status
        except OSError:
            time.sleep(0.5)
    assert status == 200, f"no answer from the MLflow server (exit code {proc.poll()})"


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> dict[int, str]:
    """PID -> start time (to tell a reused PID apart) of every process below `root`."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            parent[int(entry.name)] = (int(fields[1]), fields[19])
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, (ppid, start) in parent.items():
            if ppid == pid and child not in found:
                found[child] = start
                frontier.append(child)
    return found


def _runs(pid: int, start: str) -> bool:
    """Whether the process `pid` that started at `start` still runs (a zombie holds nothing and does not count)."""
    fields = _stat(pid)
    return fields is not None and fields[19] == start and fields[0] != "Z"


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no listener
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's own session (the mlflow CLI and its uvicorn child), SIGKILL after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
