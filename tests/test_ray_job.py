"""The same recipe runs on a Ray cluster through `ray job submit`, with Ray's token authentication on: the head
refuses a job sent without the token and runs the one `draftopd cluster submit` prints for it."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from draftopd import cluster
from draftopd.ports import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
OVERRIDES = [
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


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _wait_until_up(url: str, head: subprocess.Popen, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and head.poll() is None:
        try:
            if _get(url)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} (ray start exited with {head.poll()})")


def test_toy_recipe_through_ray_job_submit(tmp_path):
    port, dash, agent = free_port(), free_port(), free_port()
    # Ray's unix socket paths must stay short (about 100 characters): pytest's tmp_path is too deep.
    ray_tmp = tempfile.mkdtemp(prefix="rayjob-", dir="/tmp")
    token = secrets.token_hex(32)
    token_file = Path(ray_tmp) / "auth_token"
    token_file.touch(mode=0o600)
    token_file.write_text(token)
    # No RAY_* of the test session's own (its address, its auth mode); `ray` and the job's `draftopd` from here.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
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
        env=env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        address = f"http://127.0.0.1:{dash}"
        # The job agent on the head runs the job, and it starts after the dashboard: wait for both (health
        # checks answer without a token).
        _wait_until_up(f"{address}/api/gcs_healthz", head, 120)
        _wait_until_up(f"http://127.0.0.1:{agent}/api/local_raylet_healthz", head, 120)

        assert _get(f"{address}/api/jobs/")[0] == 401
        assert _get(f"{address}/api/jobs/", "not-the-token")[0] == 403
        without = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", address, "--", "echo", "ran"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert without.returncode != 0 and "ran" not in without.stdout
        assert "Authentication required" in without.stdout + without.stderr, without.stderr[-2000:]
        status, jobs = _get(f"{address}/api/jobs/", token)
        assert status == 200 and json.loads(jobs) == []  # nothing was started

        out = tmp_path / "runs"
        layout = cluster.plan(REPO / "recipes/toy-opd.yaml", overrides=OVERRIDES)
        line = cluster.submit_command(
            layout, address, str(out), OVERRIDES, env={"RAY_AUTH_TOKEN_PATH": str(token_file)}
        )
        assert token not in line
        done = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "succeeded" in (done.stdout + done.stderr).lower()
        assert "held-out tau" in done.stdout
        assert (out / "toy-opd" / "checkpoints" / "final" / "model.safetensors").is_file()
    finally:
        # Every process of this Ray is in the head's process group. A graceful stop takes half a minute (the
        # raylet's drain), which a throwaway cluster does not need.
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
