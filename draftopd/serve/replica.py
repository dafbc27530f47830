"""Replica: one stock vLLM OpenAI server of a serving fleet, in a process of its own, and the calls a fleet makes
to it: health, drafter pushes through vLLM's weight-update routes, the weight-version label, stop and kill.

The process is vLLM's own API server (`vllm.entrypoints.launchers.api_server.entry`, what `vllm serve` runs; the
`vllm` command itself looks up a distribution named `vllm`, which vLLM's CPU build is not) with the drafter as its
speculator, vLLM's per-request detailed spec-decode metrics on and its weight-update routes on
(`VLLM_SERVER_DEV_MODE=1`). Nothing of draftopd runs inside it but the weight-transfer engine vLLM's own
general-plugin entry point registers (CPU: shared memory on the replica's host; a GPU replica would name vLLM's
NCCL engine instead). vLLM guards only /v1 with its key: the weight-update routes answer anyone who reaches the
port, so a replica binds loopback and its owner (the fleet's actor on the same host) is the only one to call
them; clients reach it through the fleet's router.

A push is the offline engine's (vllm_backend/push.py) over HTTP: pause (requests in flight frozen), vLLM's three
weight-update calls naming one safetensors file in shared memory, the version label, resume, then a fresh prefix
cache (retried: vLLM refuses while requests hold blocks). A plain class: the fleet runs it as a Ray actor
(`ray.remote(Replica)`).

`AttachedReplica` is a replica someone else runs (`draftopd serve --attach URL ...`: a Kubernetes deployment, a
server started by hand): the same calls at a given URL, with no process to start, stop or restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from draftopd.ports import free_port
from draftopd.serve.settings import ServeSettings

ENTRY = "vllm.entrypoints.launchers.api_server.entry"


class ReplicaError(RuntimeError):
    """A replica that did not start, answer or take a push (the message says which call and why)."""


@dataclass
class ReplicaSpec:
    """What every replica of a fleet starts with; plain data, so it crosses into the replica's actor."""

    settings: ServeSettings
    target_dir: str
    kind: str  # the drafter family: its speculative_config comes from the family
    env: dict = field(default_factory=dict)  # more environment for vLLM's process (threads, KV cache size)


class Replica:
    """One vLLM server: `start` it from a drafter directory labelled with its version, `wait_ready`, `push`."""

    def __init__(self, spec: ReplicaSpec, index: int, log_path: str):
        self.spec, self.index, self.log_path = spec, index, log_path
        self.port, self.url = 0, ""
        self.proc: subprocess.Popen | None = None
        self.version: int | None = None
        self._engine: list = []

    def start(self, drafter_dir: str, version: int) -> str:
        """vLLM's server on `drafter_dir` (the drafter version `version`) on a free loopback port; returns its URL
        at once. A replica that ran before is ended first."""
        from draftopd.drafters import family
        from draftopd.serve.server import vllm_argv

        self.kill()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        s = self.spec.settings
        local = ServeSettings(**{**s.__dict__, "host": "127.0.0.1", "port": self.port})
        spec = family(self.spec.kind).speculative_config(drafter_dir, s.num_draft_tokens)
        argv = [sys.executable, "-m", ENTRY, *vllm_argv(local, self.spec.target_dir, spec)]
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **self.spec.env}
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_owner
            )
        self.version = version
        return self.url

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Seconds until vLLM answers /health and carries its version label; ReplicaError if it exits first."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                raise ReplicaError(f"replica {self.index}: vLLM exited ({self._code()}): {self.tail()}")
            try:
                self._call("GET", "/health", timeout=2)
                break
            except ReplicaError:
                time.sleep(0.5)
        else:
            raise ReplicaError(f"replica {self.index}: vLLM did not answer within {timeout_s:.0f} s: {self.tail()}")
        self._call("POST", "/update_weight_version", {"new_version": str(self.version)})
        self._engine = _descendants(self.proc.pid)  # a server killed outright leaves these (ended by PID)
        return time.monotonic() - t0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def push(self, tensors: dict, version: int, timeout_s: float = 60.0) -> dict:
        """Push the drafter `tensors` as `version`; returns {"seconds", "cache_reset"}. ReplicaError on any
        failed call (the fleet then holds the replica out of rotation until a push succeeds)."""
        from draftopd.vllm_backend.push import write_push

        t0 = time.monotonic()
        path, info = write_push(tensors, version)
        try:
            self._call("POST", "/pause?mode=keep&clear_cache=false", {}, timeout_s)
            try:
                self._call("POST", "/start_draft_weight_update", {}, timeout_s)
                try:
                    self._call("POST", "/update_weights", {"update_info": info}, timeout_s)
                finally:  # ends the update session either way
                    self._call("POST", "/finish_weight_update", {"weight_version": str(version)}, timeout_s)
            finally:
                self._call("POST", "/resume", {}, timeout_s)
        finally:
            path.unlink(missing_ok=True)
        self.version = version
        reset = False
        for _ in range(20):  # vLLM refuses while requests hold blocks; the router drained this replica first
            if self._call("POST", "/reset_prefix_cache", {}, timeout_s).get("success"):
                reset = True
                break
            time.sleep(0.1)
        return {"seconds": time.monotonic() - t0, "cache_reset": reset}

    def weight_version(self) -> str:
        """vLLM's own label of the weights serving (what the fleet set at start and at every push)."""
        return str(self._call("GET", "/weight_info", timeout=10).get("weight_version"))

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (vLLM finishes requests and stops its engine within its shutdown timeout), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        """End vLLM's process group at once: the server and whatever of its engine is left."""
        if self.proc is None:
            return
        import psutil

        # vLLM's engine core leaves the server's process group: its processes are ended one by one, those seen
        # when it came up too (a server killed outright no longer lists them as its children)
        family = _descendants(self.proc.pid) + self._engine
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for child in family:
            try:
                child.kill()
            except psutil.Error:
                pass
        self.proc.wait(30)

    def tail(self, lines: int = 12) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join([line for line in text.splitlines() if "Triton" not in line][-lines:])

    def _code(self) -> str:
        return "not started" if self.proc is None else f"status {self.proc.poll()}"

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float = 60.0) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.spec.settings.api_key:
            req.add_header("Authorization", f"Bearer {self.spec.settings.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise ReplicaError(f"replica {self.index}: {path} answered {exc.code}: {exc.read()[:200]!r}") from None
        except (OSError, TimeoutError) as exc:
            raise ReplicaError(f"replica {self.index}: {path} failed: {exc}") from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return {}


class AttachedReplica(Replica):
    """A vLLM server the fleet does not own, at `url`: it is pushed to and labelled like the fleet's own (so it
    must run with vLLM's weight-update routes and the weight-transfer engine the fleet pushes through: the CPU
    one reaches servers on the fleet's host only), and it is never started, stopped or restarted from here. One
    that stops answering is held out of rotation until it answers again and is re-synced."""

    def __init__(self, spec: ReplicaSpec, index: int, url: str):
        super().__init__(spec, index, "")
        self.url = url.rstrip("/")

    def start(self, drafter_dir: str, version: int) -> str:
        return self.url  # running already; the fleet pushes the serving version to it before admitting it

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        t0 = time.monotonic()
        while not self.alive():
            if time.monotonic() - t0 > timeout_s:
                raise ReplicaError(f"replica {self.index}: {self.url} did not answer /health in {timeout_s:.0f} s")
            time.sleep(1.0)
        return time.monotonic() - t0

    def alive(self) -> bool:
        try:
            self._call("GET", "/health", timeout=5)
            return True
        except ReplicaError:
            return False

    def pid(self) -> int | None:
        return None

    def stop(self, timeout_s: float = 15.0) -> None:
        pass  # not ours

    def kill(self) -> None:
        pass

    def tail(self, lines: int = 12) -> str:
        return ""


def _die_with_owner() -> None:
    """(In the child, before vLLM starts.) Linux ends the server when the process that started it (the replica's
    actor) dies, so a killed actor leaves no server behind."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
