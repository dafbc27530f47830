"""MLflow tracking for training runs: one MLflow run per job, every metric on the `policy_version` axis.

Why a small class over `mlflow.MlflowClient` rather than the fluent `mlflow.start_run()` API: the fluent API
keeps the active run in process-global state, which breaks as soon as a driver, a Ray actor and a test each
want their own run. Here every call names its run id explicitly.

- Store: `MLFLOW_TRACKING_URI` from the environment wins (an operator points every job at one shared
  server), then the URI the caller passes, else a sqlite store inside the run directory
  (`<run_dir>/mlflow.db`, artifacts under `<run_dir>/mlartifacts`), so a run is self-contained and
  `draftopd ui <run_dir>` shows it. MLflow's file store refuses to start without
  `MLFLOW_ALLOW_FILE_STORE=true`; sqlite needs nothing.
- Step axis: every metric is logged with `step=policy_version`, the number of drafter weight updates the
  rollout policy has seen (SFT steps count too), so rollout, learner and eval curves line up in the UI.
- Metrics of one step go in one `log_batch` call: against a server, one HTTP call per metric costs ~70 ms.
- Resuming: `start(resume_run_id=...)` reopens the same MLflow run, so a restarted job continues its curves;
  `attach(run_id)` logs into a run without reopening it (a later analysis of a finished run).
- Dashboard: experiments carry `mlflow.experimentKind=custom_model_development`, the tag by which MLflow 3 files
  them as model training (runs and metric charts) rather than GenAI development (traces and evaluation runs).
  MLflow 3.17's own UI follows its sidebar's workflow switch instead (GenAI unless chosen otherwise, remembered
  per browser), so `draftopd ui` prints a link that opens in the machine-learning view. The UI groups a run's
  charts in sections named by what precedes a metric's last '/', sorted by name, unprefixed metrics last; the
  driver names its metrics so that acceptance (`eval/...`, `rollout/tau`) sorts before bookkeeping.
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# MLflow's per-request limits (mlflow.utils.validation): 100 params or tags and 1000 metrics per log_batch,
# params up to 6000 characters, tags up to 8000.
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"  # the UI's "Machine learning"; "genai_development" is GenAI


def resolve_tracking_uri(run_dir: Path, tracking_uri: str | None = None) -> str:
    """`MLFLOW_TRACKING_URI` if set, else `tracking_uri`, else `sqlite:///<run_dir>/mlflow.db`."""
    return os.environ.get("MLFLOW_TRACKING_URI") or tracking_uri or _sqlite_uri(Path(run_dir) / "mlflow.db")


def _sqlite_uri(db: Path) -> str:
    return f"sqlite:///{db.resolve().as_posix()}"  # absolute path: sqlite:////abs/path/mlflow.db


def flatten(params: dict, prefix: str = "") -> dict[str, str]:
    """`{"a": {"b": 1}}` -> `{"a.b": "1"}`; values stringified and cut to MLflow's param length limit."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = _clip(str(value), MAX_PARAM_VAL_LENGTH)
    return flat


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class Tracker:
    """Owns one MLflow run for one training job. Nothing touches MLflow before `start()`.

    Invariant: after `start()`, every call logs to `run_id` through an `MlflowClient` bound to
    `tracking_uri`; no process-global MLflow state is read or written.
    """

    def __init__(
        self, run_dir: Path, experiment: str = "draftopd", run_name: str = "run", tracking_uri: str | None = None
    ):
        self.run_dir = Path(run_dir)
        self.experiment = experiment
        self.run_name = run_name
        self.tracking_uri = tracking_uri  # resolved in start(): the environment may override it
        self.num_nonfinite_metrics = 0  # metric values skipped because they were NaN or infinite
        self._client = None
        self._run_id: str | None = None
        self._params: dict[str, str] = {}  # params already on the run: MLflow params cannot change

    @property
    def run_id(self) -> str:
        if self._run_id is None:
            raise RuntimeError("Tracker.start() has not been called")
        return self._run_id

    def start(self, resume_run_id: str | None = None) -> str:
        """Open the store, get or create the experiment, start (or resume) the run; return its id."""
        if self._run_id is not None:
            raise RuntimeError(f"Tracker already started run {self._run_id}")
        self._open_store()
        if resume_run_id:
            run = self._client.get_run(resume_run_id)  # raises if the run is not in this store
            self._client.update_run(resume_run_id, status="RUNNING")
            self._params = dict(run.data.params)
            self._run_id = resume_run_id
        else:
            run = self._client.create_run(self._experiment_id(), run_name=self.run_name)
            self._run_id = run.info.run_id
        return self._run_id

    def attach(self, run_id: str) -> str:
        """Log into an existing run of the store without reopening it: its status stays as it is (a finished run
        stays finished, the run of a job still going keeps running)."""
        if self._run_id is not None:
            raise RuntimeError(f"Tracker already started run {self._run_id}")
        from mlflow.exceptions import MlflowException

        self._open_store()
        try:
            self._client.get_run(run_id)
        except MlflowException:
            raise FileNotFoundError(f"no MLflow run {run_id!r} in the store {self.tracking_uri}") from None
        self._run_id = run_id
        return run_id

    def _open_store(self) -> None:
        from mlflow.tracking import MlflowClient

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = resolve_tracking_uri(self.run_dir, self.tracking_uri)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            if EXPERIMENT_KIND_TAG not in found.tags:  # made before the tag was set; a kind chosen in the UI stays
                self._client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
            return found.experiment_id
        artifacts = None
        if self.tracking_uri == _sqlite_uri(self.run_dir / "mlflow.db"):
            # the run directory's own store keeps its artifacts beside it, not in ./mlruns of the cwd
            artifacts = (self.run_dir / "mlartifacts").resolve().as_uri()
        try:
            return self._client.create_experiment(
                self.experiment, artifact_location=artifacts, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND}
            )
        except MlflowException:  # another job created it between the lookup and here
            return self._client.get_experiment_by_name(self.experiment).experiment_id

    def log_params(self, params: dict) -> None:
        """Log a (nested) config as flat `section.field` params. Already logged keys are skipped (resume)."""
        from mlflow.entities import Param

        new = []
        for key, value in flatten(params).items():
            if key not in self._params:
                new.append(Param(key, value))
                self._params[key] = value
            elif self._params[key] != value:
                log.warning(
                    "param %s is %r on the run, not %r: MLflow params are immutable", key, self._params[key], value
                )
        for chunk in _chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=chunk, synchronous=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log all metrics of one `policy_version` in one request. NaN/inf are skipped and counted."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            value = float(value)
            if not math.isfinite(value):
                self.num_nonfinite_metrics += 1
                continue
            batch.append(Metric(key, value, now, int(step)))
        # one request unless a step has more than 1000 metrics, MLflow's per-request limit
        for chunk in _chunks(batch, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """A file, or every file of a directory (under `artifact_path`)."""
        if Path(path).is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def log_dict(self, obj, name: str) -> None:
        """Write `obj` as the artifact `name` (JSON or YAML by the extension)."""
        self._client.log_dict(self.run_id, obj, name)

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        """Rows (dicts with the same keys) as the MLflow table `artifact_file` (`.json`), which the UI shows as a
        table. MLflow appends rows to a table that exists already; here that is refused (FileExistsError), so no
        row is ever counted twice."""
        folder = posixpath.dirname(artifact_file) or None
        if any(a.path == artifact_file for a in self._client.list_artifacts(self.run_id, folder)):
            raise FileExistsError(f"MLflow run {self.run_id} already holds the table {artifact_file}")
        columns = {key: [row[key] for row in rows] for key in rows[0]} if rows else {}
        self._client.log_table(self.run_id, columns, artifact_file)

    def set_tags(self, tags: dict) -> None:
        from mlflow.entities import RunTag

        batch = [RunTag(str(k), _clip(str(v), MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        for chunk in _chunks(batch, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=chunk, synchronous=True)

    def end(self, status: str = "FINISHED") -> None:
        """Mark the run ended: FINISHED, FAILED or KILLED. A later `start(resume_run_id=...)` reopens it."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        self._client.set_terminated(self.run_id, status=status)


def _store_locations(store: str) -> tuple[str, str | None]:
    """(backend store URI, artifact root or None) for a URI, a run directory or a path to an mlflow.db."""
    if "://" in store:
        return store, None
    path = Path(store)
    db = path / "mlflow.db" if path.is_dir() else path
    if not db.is_file():
        # the server would silently create an empty store: a typo would show an empty UI
        raise FileNotFoundError(f"no MLflow store at {db} (expected a run directory with mlflow.db, or a URI)")
    return _sqlite_uri(db), (db.parent / "mlartifacts").resolve().as_uri()


def ui_command(store: str, port: int = 5000) -> list[str]:
    """argv of an `mlflow server` on 127.0.0.1:`port` over `store` (a URI, a run directory or an mlflow.db).

    Defaults start ~2.4 GB of processes (4 uvicorn workers plus a job-execution runner); one worker with
    job execution off (only an environment variable switches it off, hence `env`) is ~0.5 GB.
    """
    uri, artifacts = _store_locations(str(store))
    cmd = [
        "env",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false",
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    if artifacts:
        cmd += ["--default-artifact-root", artifacts]
    return cmd


def serve_ui(store: str, port: int = 5000) -> int:
    """Run the MLflow UI in the foreground until it exits or SIGTERM/SIGINT arrives; return an exit code.

    `mlflow server` runs uvicorn as a child process, so a signal that reached only the mlflow CLI would leave
    uvicorn holding the port. The server therefore runs in its own process group and both signals go to the
    whole group; a signal ends the UI with 128 + its number, as a shell reports it.
    """
    cmd = ui_command(store, port)
    # the link opens the UI's machine-learning view (runs, metric charts) rather than its GenAI default
    print(
        f"MLflow UI on http://127.0.0.1:{port}/#/experiments?workflowType=machine_learning "
        f"(store {cmd[cmd.index('--backend-store-uri') + 1]}); Ctrl-C stops it",
        flush=True,
    )
    proc = subprocess.Popen(cmd, start_new_session=True)  # its own session: a new process group led by it
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        _signal_group(proc.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _end_group(proc.pid)
    return 128 + received[0] if received else rc


def _signal_group(pgid: int, signum: int) -> bool:
    """Send `signum` to process group `pgid`; False when the group has no process left."""
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False


def _end_group(pgid: int, grace_s: float = 15.0) -> None:
    """SIGTERM what is left of the group, wait for it (uvicorn outlives the mlflow CLI by its shutdown), SIGKILL
    after `grace_s`."""
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _group_runs(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_runs(pgid):
        _signal_group(pgid, signal.SIGKILL)


def _group_runs(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Zombies do not count: the orphaned uvicorn is reaped by
    init, which may take its time (or never come, in a container whose init does not reap), and holds nothing."""
    if not Path("/proc").is_dir():
        return _signal_group(pgid, 0)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # the process ended while we looked
        if int(group) == pgid and state != "Z":
            return True
    return False
