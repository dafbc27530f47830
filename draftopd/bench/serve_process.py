"""A `draftopd serve` in a subprocess, as the serving benches drive it: its own free loopback port and run
directory, ready when `/v1/models` answers; its speculative-decoding counters from `/metrics`, its
`/draftopd/status`, and the resident memory of its process tree (the API server, vLLM's engine core, the
learner thread inside the server).

A subprocess, not an in-process server, so that the benches see what a client sees (HTTP, the OpenAI API, a
server started by its command line) and so that the server's memory is its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from draftopd.ports import free_port

# The benches' learner budget: 400 steps per 1,000 served tokens, not the server's 50. The toy target answers
# thinking-off requests in 3-5 tokens, so 50 allows about one step per five requests: at 2 requests/s the
# learner would idle most of a run. 400 lets it use what the cores give it (about one step a second here).
BENCH_LEARNER = ["steps_per_1k_tokens=400"]
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTS = "vllm:spec_decode_num_drafts"


def serve_args(
    target: str, drafter: str, k: int, learning: str, learner: list[str], extra: list[str], replicas: int = 0
) -> list[str]:
    """`draftopd serve` flags of a bench arm: the arms differ in --learning only (and the learner's overrides,
    which a server with learning off does not read). `replicas` > 0: a fleet of that many vLLM replicas (its key
    is ServerProcess's); 0: the one-process server."""
    args = ["--target", target, "--drafter", drafter, "--num-draft-tokens", str(k), "--learning", learning, *extra]
    args += ["--replicas", str(replicas)] if replicas else []
    return args + (["--learner", *learner] if learning == "on" and learner else [])


class ServerError(RuntimeError):
    """The server did not start, or died; the message ends with the tail of its log."""


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's cumulative speculative-decoding counters at one scrape of /metrics (summed over engines)."""

    accepted: float
    drafts: float

    def tau_since(self, earlier: SpecCounters) -> float:
        """Tokens per verification step between two scrapes: 1 + accepted drafts / draft steps (vLLM's
        convention, the one `draftopd serve`'s live tau uses); NaN when no step ran between them."""
        drafts = self.drafts - earlier.drafts
        return 1.0 + (self.accepted - earlier.accepted) / drafts if drafts > 0 else float("nan")


def parse_spec_counters(text: str) -> SpecCounters:
    """The two counters from Prometheus text (`NAME_total{labels} value` lines; a counter without the suffix,
    as older clients wrote it, counts too). Missing counters read as 0: no speculative step yet."""
    sums = {ACCEPTED: 0.0, DRAFTS: 0.0}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        base = name[: -len("_total")] if name.endswith("_total") else name
        if base in sums:
            sums[base] += float(line.rsplit(" ", 1)[1])
    return SpecCounters(sums[ACCEPTED], sums[DRAFTS])


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (a sum: pages shared between them count once per
    process, so this is an upper bound); 0 when the process is gone."""
    try:
        import psutil
    except ImportError:
        return _proc_tree_rss(pid)
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _proc_tree_rss(pid: int) -> int:
    """tree_rss from /proc (Linux) where psutil is not installed."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier += kids
    total = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class RssSampler:
    """Samples tree_rss(pid) on a thread every `every_s` seconds; `peak` and the samples' times and values.
    With `roles` (a function giving resident bytes per role name), also each role's peak in `role_peaks`."""

    def __init__(self, pid: int, every_s: float = 0.5, roles=None):
        self.pid, self.every_s, self.roles = pid, every_s, roles
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self.role_peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = tree_rss(self.pid)
            self.samples.append((time.monotonic() - self._t0, rss))
            self.peak = max(self.peak, rss)
            if self.roles is not None:
                try:
                    for role, b in self.roles().items():
                        self.role_peaks[role] = max(self.role_peaks.get(role, 0), b)
                except Exception:  # a status call that failed under load: the next sample counts
                    pass
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class ServerProcess:
    """`python -m draftopd.cli serve ARGS --port P --run-dir DIR` on 127.0.0.1, its output in DIR/server.log.
    A context manager: entering starts it and waits until it serves (a fleet: every replica in rotation);
    leaving stops it (SIGINT first, so it saves its session; its whole process group after `stop_timeout_s`).
    A fleet (`--replicas` in ARGS) gets a fresh API key, which every call here and `api_key` carry."""

    def __init__(self, run_dir: str | Path, args: list[str], ready_timeout_s: float = 900.0):
        import secrets

        self.run_dir = Path(run_dir)
        self.args, self.ready_timeout_s = list(args), ready_timeout_s
        self.fleet = "--replicas" in self.args
        self.api_key = secrets.token_hex(16) if self.fleet else "none"
        self._pids: dict[str, int] = {}  # a fleet's roles' processes, read from its status every 10 s
        self._pids_at = float("-inf")
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.ready_s = float("nan")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "server.log"

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cmd = [sys.executable, "-m", "draftopd.cli", "serve", *self.args]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--run-dir", str(self.run_dir / "run")]
        cmd += ["--api-key", self.api_key] if self.fleet else []
        log = self.log_path.open("ab")
        t0 = time.monotonic()
        # its own session: stop() can end the engine core and anything else it started, and only that
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"draftopd serve exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.get("/v1/models", timeout=5)
                if not self.fleet or all(r["in_rotation"] for r in self.status()["replicas"]):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise ServerError(
            f"draftopd serve did not answer /v1/models in {self.ready_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def get(self, path: str, timeout: float = 30.0) -> bytes:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.api_key}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()

    def counters(self) -> SpecCounters:
        return parse_spec_counters(self.get("/metrics").decode())

    def status(self) -> dict:
        return json.loads(self.get("/draftopd/status"))

    def rss(self) -> int:
        return tree_rss(self.proc.pid) if self.proc is not None else 0

    def role_rss(self) -> dict[str, int]:
        """Resident bytes per role: the one-process server's tree as `server`; a fleet's router process alone
        (its driver, the router and Ray's driver state), each replica's vLLM server tree and the learner actor's
        process (its pids from /draftopd/status)."""
        if not self.fleet:
            return {"server": self.rss()}
        import psutil

        if time.monotonic() - self._pids_at > 10:  # a restarted replica has a new pid
            self._pids, self._pids_at = self.status().get("pids", {}), time.monotonic()
        out = {}
        for role, pid in self._pids.items():
            try:
                out[role] = tree_rss(pid) if role.startswith("replica") else psutil.Process(pid).memory_info().rss
            except psutil.Error:
                out[role] = 0
        return out

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, stop_timeout_s: float = 90.0) -> int | None:
        """SIGINT, wait, then SIGKILL to the server's process group; returns its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what the server started and left (none when it closed well)
        except ProcessLookupError:
            pass
        return self.proc.wait()
