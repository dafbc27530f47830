"""`draftopd serve` as its tests run it: a server process of its own, its routes and its clean stop."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

openai = pytest.importorskip("openai")

KEY = "serve-test-key"


class Server:
    """`draftopd serve` in a process of its own, with the test key; `extra`: more of its flags."""

    def __init__(self, run: Path, port: int, log: Path, target="toy", drafter="toy", extra=()):
        self.run, self.port, self.log = run, port, log
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "draftopd.cli", "serve", "--target", str(target), "--drafter", str(drafter)]
        cmd += ["--port", str(port), "--run-dir", str(run), "--api-key", KEY, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def wait_ready(self, timeout: float = 400.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"draftopd serve exited with {self.proc.returncode}: {self.tail()}")
            try:
                self.client.models.list()
                return
            except openai.APIConnectionError:
                time.sleep(1)
        pytest.fail(f"draftopd serve did not answer within {timeout} s: {self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])

    def call(self, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST")
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def status(self) -> dict:
        code, body = self.call("/draftopd/status")
        assert code == 200, body
        return body

    def stop(self) -> int:
        """SIGTERM, as a process manager stops it; the processes it had started are kept in `children`."""
        if self.proc.poll() is None:
            self.children = psutil.Process(self.proc.pid).children(recursive=True)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def left_running(self, timeout: float = 20.0) -> list[int]:
        """PIDs of the processes the server had started that still run `timeout` s after it ended."""
        deadline = time.monotonic() + timeout
        while True:
            alive = []
            for c in self.children:
                try:
                    if c.is_running() and c.status() != psutil.STATUS_ZOMBIE:
                        alive.append(c.pid)
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)
