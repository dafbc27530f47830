"""The same recipe runs on a Ray cluster through `ray job submit`."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(url)


@pytest.mark.slow  # over two minutes of a second Ray cluster on 2 cores; run with: pytest -m slow
def test_toy_recipe_through_ray_job_submit(tmp_path):
    import shutil
    import tempfile

    port, dash, agent = _free_port(), _free_port(), _free_port()
    # Ray's unix socket paths must stay short (about 100 characters): pytest's tmp_path is too deep.
    ray_tmp = tempfile.mkdtemp(prefix="rayjob-", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # the same mode for the head and the CLI client
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            # the job agent's HTTP port defaults to 52365, which the test session's own Ray already holds
            f"--dashboard-agent-listen-port={agent}",
            "--num-cpus=4",
            f"--object-store-memory={256 * 2**20}",
            f"--temp-dir={ray_tmp}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_http(f"http://127.0.0.1:{dash}/api/version", 120)
        out = tmp_path / "runs"
        cmd = [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            f"http://127.0.0.1:{dash}",
            "--working-dir",
            str(REPO),
            "--",
            str(BIN / "draftopd"),
            "train",
            "recipes/toy-opd.yaml",
            f"run.out_dir={out}",
            "drafter.init=draftopd/assets/toy-eagle3",  # straight to OPD: no target responses, no SFT
            "sft.epochs=0",
            "rollout.prompts_per_round=4",
            "rollout.max_new_tokens=32",
            "learner.batch_size=2",
            "opd.num_rounds=1",
            "rollout.num_workers=1",  # one actor per role is enough to show placement through the job
            "learner.num_learners=1",
            "opd.steps_per_round=1",
            "opd.num_eval_prompts=2",
            "eval.max_new_tokens=16",
        ]
        for _ in range(12):  # the dashboard answers before the node's job agent has registered
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if "No available agent" not in done.stdout + done.stderr:
                break
            time.sleep(5)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "succeeded" in (done.stdout + done.stderr).lower()
        assert "held-out tau" in done.stdout
        assert (out / "toy-opd" / "checkpoints" / "final" / "model.safetensors").is_file()
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
