"""`draftopd serve`: vLLM's own OpenAI-compatible server, recording its traffic from vLLM's per-request metrics.

Built in this process from vLLM's parts, as `vllm serve` builds itself
(vllm/entrypoints/launchers/api_server/entry.py): vLLM's argument parser gives the namespace its app reads,
`AsyncLLM.from_vllm_config` starts the engine (its core in a process of its own; per-request detailed
speculative metrics on; with `--record full` also the worker extension that records drafted tokens and their
scores, on vLLM's V1 runner), the response tap (tap.py) reads each finished request's record from the outputs on
their way to vLLM's routes, `build_app` + `init_app_state` give vLLM's routes (`/v1/completions`,
`/v1/chat/completions`, `/v1/models`, `/metrics`, ...) and `serve_http` serves them. Beside them: `GET
/draftopd/status`, `POST /draftopd/rollback`, `POST /draftopd/promote` (a drafter directory on this machine,
for an operator's push), draftopd's gauges on vLLM's `/metrics` registry, and the session's background task
(session.py). vLLM's API key guards `/v1/*` only, so `/draftopd/*` checks the same key itself.

The drafter serving first is the run directory's last promoted version (serving.json, else the version store's
newest); a new run directory starts by storing the given drafter as version 0.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import logging
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

from draftopd.serve.session import ServeSession, StoredDrafter, SwapError, version_path
from draftopd.serve.settings import ServeSettings, serving_dtype, serving_memory_fraction

log = logging.getLogger(__name__)


def open_session(s: ServeSettings) -> tuple[ServeSession, str]:
    """The session of `s.run_dir` (made when new) and the drafter directory vLLM starts with."""
    from draftopd.drafters import family, read_raw
    from draftopd.loading import LoadError, resolve_drafter_path
    from draftopd.serve.traffic import TrafficBuffer
    from draftopd.serve.versions import VersionStore

    run = Path(s.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    store = VersionStore(run, keep=s.keep_versions)
    version, history = resume_point(run, store)
    if version is None:  # a new run: the given drafter is version 0
        src = day0_drafter(s, run / "day0") if s.drafter.startswith("init:") else resolve_drafter_path(s.drafter)
        store.save(StoredDrafter.read(src), 0, {"source": str(Path(src).resolve())})
        version, history = 0, [0]
    else:
        log.warning("draftopd serve: %s resumes at drafter version %d (--drafter is its version 0 only)", run, version)
    path = version_path(store, version)
    kind = read_raw(path)[0]
    try:
        spec = family(kind).speculative_config(path, s.num_draft_tokens)
    except ValueError as exc:
        raise LoadError(f"drafter {path}: {exc}") from None
    if s.learning and not family(kind).live_push:
        raise LoadError(
            f"--learning on: a '{kind}' drafter cannot take live weight pushes in vLLM; serve it with --learning off"
        )
    buffer = TrafficBuffer.load(
        run / "traffic", s.buffer_capacity, keep_text=s.keep_text, retention_s=s.retention_s or 0.0
    )
    return ServeSession(s, kind, spec["method"], store, buffer, version, history), str(path)


DAY0_FAMILIES = ("eagle3", "dflash")


def day0_drafter(s: ServeSettings, out: Path) -> str:
    """`--drafter init:FAMILY`: a drafter of FAMILY built from the target's shapes alone, no data (day 0): the
    family's defaults (DrafterConfig), the target's layers `s.aux_layer_ids` (else its defaults), EAGLE-3 over the
    whole target vocabulary (there is no traffic yet to choose a draft vocabulary from), DFlash with blocks of
    `num_draft_tokens` + 1 and the tokenizer's mask token. Seeded by `s.seed`; written to `out`."""
    import torch

    from draftopd.drafters import family, new_drafter, save_drafter
    from draftopd.loading import LoadError, load_target, load_tokenizer
    from draftopd.schema import DrafterConfig

    kind = s.drafter.split(":", 1)[1]
    if kind not in DAY0_FAMILIES:
        raise LoadError(f"--drafter {s.drafter}: a day-0 drafter is one of init:{', init:'.join(DAY0_FAMILIES)}")
    target = load_target(s.target, s.aux_layer_ids or None, serving_dtype(s))
    cfg = DrafterConfig(kind=kind)
    if family(kind).max_drafts(cfg) is not None:  # a block family: K masks after the anchor
        tok = load_tokenizer(s.target)
        mask = tok.mask_token_id if tok.mask_token_id is not None else tok.convert_tokens_to_ids("<|mask|>")
        if mask is None or mask == tok.unk_token_id:
            raise LoadError(f"--drafter {s.drafter}: the target's tokenizer has no mask token for the drafter's blocks")
        cfg.mask_token_id, cfg.block_size = int(mask), s.num_draft_tokens + 1
    torch.manual_seed(s.seed)
    drafter = new_drafter(cfg, target, torch.arange(target.vocab_size))
    log.warning("draftopd serve: day 0, a fresh %s drafter from the target's shapes alone (%s)", kind, out)
    return str(save_drafter(drafter, out))


def resume_point(run: Path, store) -> tuple[int | None, list[int]]:
    """(version serving, versions served before it) from serving.json, else the store's newest; None: new."""
    saved = run / "serving.json"
    known = {v for v, _ in store.list()}
    if saved.is_file():
        row = json.loads(saved.read_text())
        history = [v for v in row.get("history", []) if v in known]
        if row.get("version") in known:
            return row["version"], history or [row["version"]]
    latest = store.latest()
    return (latest[0], [latest[0]]) if latest else (None, [])


SHUTDOWN_TIMEOUT_S = 30


def vllm_args(s: ServeSettings, target_dir: str, spec: dict | None):
    """The namespace vLLM's own server reads (`vllm serve`'s parser), from draftopd's settings."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="draftopd serve")).parse_args(vllm_argv(s, target_dir, spec))


def vllm_argv(s: ServeSettings, target_dir: str, spec: dict | None) -> list[str]:
    """`vllm serve`'s flags for draftopd's settings: what the in-process server parses and a fleet replica's vLLM
    server is started with."""
    argv = ["--model", target_dir, "--host", s.host, "--port", str(s.port), "--dtype", serving_dtype(s)]
    argv += ["--max-model-len", str(s.max_model_len)]
    fraction = serving_memory_fraction(s)
    if fraction is not None:  # None: vLLM's own default (on a GPU)
        argv += ["--gpu-memory-utilization", str(fraction)]
    argv += ["--seed", str(s.seed), "--uvicorn-log-level", "warning"]
    if s.record != "off":  # the scheduler's per-request step counts: what stock records are made of
        argv += ["--per-request-spec-decode-metrics", "detailed"]
    if s.record == "full":  # the hook records (pushes need it not): V1's synchronous steps, which it wraps
        from draftopd.vllm_backend.hook import EXTENSION

        argv += ["--worker-extension-cls", EXTENSION, "--no-async-scheduling"]
    argv += ["--disable-uvicorn-access-log", "--served-model-name", s.served_model_name or Path(target_dir).name]
    # On SIGTERM/SIGINT vLLM stops its engine within this many seconds; its default, 0, kills the engine and
    # worker processes at once, which leaves their shared memory for the resource tracker to report.
    argv += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if s.enforce_eager:
        argv.append("--enforce-eager")
    if spec:  # pushes through vLLM's weight-transfer calls into draftopd's engine (vllm_backend/push.py)
        from draftopd.vllm_backend.push import CONFIG

        argv += ["--speculative-config", json.dumps(spec), "--weight-transfer-config", json.dumps(CONFIG)]
    if s.api_key:
        argv += ["--api-key", s.api_key]
    return argv


def serve(s: ServeSettings) -> NoReturn:
    """Run the server until interrupted (SIGINT/SIGTERM); the session is saved and the engine stopped on the way
    out, then the process ends (status 0)."""
    from draftopd.vllm_backend.engine import check_install

    check_install()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU; the toy target needs little
    session, drafter_dir = open_session(s)
    import uvloop

    uvloop.run(_serve(s, session, drafter_dir))
    _exit_closed(0)


def _exit_closed(code: int) -> NoReturn:
    """End the process once serving has closed what it opened (the engine and its processes, the session and its
    MLflow run, the socket). The atexit handlers run; the interpreter's teardown, which only frees modules, is
    skipped: there Triton's bindings (imported by vLLM, unused on CPU) report their module-level objects as
    leaked references, a report about Triton, not about this server."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve(s: ServeSettings, session: ServeSession, drafter_dir: str) -> None:
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    from draftopd.drafters import family
    from draftopd.loading import resolve_target_path

    target_dir = str(resolve_target_path(s.target).resolve())
    spec = family(session.kind).speculative_config(drafter_dir, s.num_draft_tokens)
    args = vllm_args(s, target_dir, spec)
    listen, sock = setup_server(args, reuse_port=False)  # bound before the engine starts, as vLLM does
    session.target_dir = target_dir
    # vLLM's start mostly waits on its engine and worker processes: what this process needs besides the engine
    # (the MLflow store, seconds to create; the tokenizer; the learner's target) is made meanwhile on a thread
    pool = ThreadPoolExecutor(1, thread_name_prefix="draftopd-start")
    beside = pool.submit(_prepare, s, session)
    pool.shutdown(wait=False)  # its one task still runs; the thread ends with it
    try:
        engine = _start_engine(args, s.record == "full")
    except BaseException:
        _discard(beside)
        raise
    try:
        if s.record == "full":
            await engine.collective_rpc("draftopd_install")
        elif s.record == "stock":  # before vLLM's routes are made: they call the engine's generate
            from draftopd.serve.tap import ResponseTap

            session.tap = ResponseTap(s.buffer_capacity)
            session.tap.install(engine)
        supported = await engine.get_supported_tasks()
        app = build_app(args, supported, engine.model_config)
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state

        await init_app_state(engine, app.state, args, supported)
        add_routes(app, session, s.api_key)
        collector = register_metrics(session)
        tokenizer, tracker = await asyncio.wrap_future(beside)
        session.start(engine, tokenizer, tracker)
        if s.learning:  # a learner that fails to start is logged; serving goes on without it
            await asyncio.get_running_loop().run_in_executor(None, session.start_learner)
        log.warning(
            "draftopd serve: %s, drafter version %d (%s), run directory %s",
            listen,
            session.version,
            session.kind,
            s.run_dir,
        )
        print(f"draftopd serve: listening on {listen}", flush=True)
        shutdown = await serve_http(
            app, sock=sock, host=args.host, port=args.port, log_level=args.uvicorn_log_level, access_log=False
        )
        await shutdown
    finally:
        await session.close()
        _unregister(locals().get("collector"))
        engine.shutdown()
        sock.close()


def _start_engine(args, hook: bool):
    """vLLM's AsyncLLM over the args' config; with the recording hook (`--record full`), on the V1 model runner
    the hook wraps (checked before it starts); else on the runner vLLM picks."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    if hook:
        from draftopd.vllm_backend.hook import pin_v1_runner

        if pin_v1_runner():
            log.warning("vLLM runs its V1 model runner here (VLLM_USE_V2_MODEL_RUNNER=0): the recording hook wraps it")
    from draftopd.vllm_backend.stock import one_process_on_cpu

    engine_args = AsyncEngineArgs.from_cli_args(args)
    with one_process_on_cpu():  # on CPU the engine core's process runs the worker too, as on one GPU
        config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    if hook:  # without the hook nothing wraps vLLM's runner: it runs the one vLLM picks
        from draftopd.vllm_backend.hook import check_internals

        check_internals(config)
    engine = AsyncLLM.from_vllm_config(
        vllm_config=config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
    )
    _stop_outputs_before_the_core(engine)
    return engine


def _stop_outputs_before_the_core(engine) -> None:
    """Make `engine.shutdown` (called by vLLM's server on SIGTERM, from a thread) stop the task that reads the engine
    core's outputs before the core itself. vLLM's own order is the reverse, so a core that stops gracefully is seen
    by that task as dead and logged as an error with a traceback. Requests still running first finish (up to vLLM's
    shutdown timeout), so their outputs still reach their clients."""
    from vllm.utils.async_utils import cancel_task_threadsafe

    stop = engine.shutdown

    def shutdown(timeout: float | None = None) -> None:
        if _on_a_loop():  # (this process's own stop, after vLLM's) nothing to wait for, and no waiting on the loop
            return stop(timeout=timeout)
        deadline = time.monotonic() + (timeout or 0)
        while engine.get_num_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.1)
        handler = getattr(engine, "output_handler", None)
        if handler is not None and not handler.done():
            cancel_task_threadsafe(handler)
            while not handler.done() and time.monotonic() < deadline + 5:
                time.sleep(0.01)
        stop(timeout=timeout)

    engine.shutdown = shutdown


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _tokenizer(target_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


def _prepare(s: ServeSettings, session: ServeSession):
    """(Its own thread, while vLLM starts.) The tokenizer and end-of-sequence ids, the MLflow run, and with
    learning on the torch target and drafter the learner starts from."""
    from draftopd.loading import eos_ids

    tokenizer = _tokenizer(session.target_dir)
    session.eos = eos_ids(tokenizer, session.target_dir)
    tracker = _tracker(s, session)
    if s.learning:
        try:
            session.preload_native()
        except Exception:  # start_learner meets the same error again, logs it and serves without a learner
            log.exception("draftopd serve: loading the learner's target failed")
    return tokenizer, tracker


def _discard(beside) -> None:
    """vLLM did not start: the MLflow run made meanwhile (if any) ends as failed."""
    try:
        tracker = beside.result()[1]
        if tracker is not None:
            tracker.end("FAILED")
    except Exception:
        log.exception("draftopd serve: ending the MLflow run of a server that did not start")


def _tracker(s: ServeSettings, session: ServeSession):
    """One MLflow run per serving session in the run directory's store; None when MLflow cannot start."""
    from draftopd.tracking import Tracker

    try:
        tracker = Tracker(Path(s.run_dir), experiment="draftopd-serve", run_name=f"serve-v{session.version}")
        tracker.start()
        tracker.log_params({k: v for k, v in vars(s).items() if k != "api_key"} | {"drafter_kind": session.kind})
        return tracker
    except Exception:
        log.exception("draftopd serve: MLflow tracking is off (the run could not start)")
        return None


# -- draftopd's routes and gauges ---------------------------------------------------------------------------


def add_routes(app, session: ServeSession, api_key: str) -> None:
    from starlette.responses import JSONResponse

    tokens = [hashlib.sha256(api_key.encode()).digest()] if api_key else []

    def allowed(request) -> bool:
        if not tokens:
            return True
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        digest = hashlib.sha256(value.encode()).digest()
        return scheme.lower() == "bearer" and any(secrets.compare_digest(digest, t) for t in tokens)

    def denied() -> JSONResponse:
        return JSONResponse({"error": "Unauthorized"}, status_code=401)

    async def status(request):
        if not allowed(request):
            return denied()
        from draftopd.reports import finite

        return JSONResponse(finite(session.status()))

    async def rollback(request):
        if not allowed(request):
            return denied()
        try:
            version = await session.rollback("requested by POST /draftopd/rollback")
        except SwapError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        return JSONResponse({"version": version})

    async def promote(request):
        """An operator's push: {"path": a drafter directory on this machine, same family and shape}, judged by
        the guard as the learner's candidates are (409 with its verdict when refused) unless "force" is true."""
        if not allowed(request):
            return denied()
        body = await request.json()
        try:
            path = str(body["path"])
            drafter = await asyncio.get_running_loop().run_in_executor(None, _read_candidate, session, path)
            evidence = {"source": path, "manual": True, "forced": bool(body.get("force"))}
            if not body.get("force"):
                verdict = (await session.vet(path)).evidence()
                session.learner_log({"event": "verdict", "source": path, **verdict}, 0)
                if not verdict["promote"]:
                    return JSONResponse(
                        {"error": f"refused by the guard: {verdict['reason']}", "verdict": verdict}, 409
                    )
                evidence.update(verdict)
            version = await session.promote(drafter, evidence=evidence)
        except (SwapError, ValueError, KeyError, OSError) as exc:
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=409)
        return JSONResponse({"version": version})

    async def learner(request):
        """{"action": "start" | "stop" | "kill"}: learning switched on or off while serving goes on."""
        if not allowed(request):
            return denied()
        action = (await request.json()).get("action")
        if action not in ("start", "stop", "kill"):
            return JSONResponse({"error": "action: start, stop or kill"}, status_code=400)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, session.control_learner, action)
        except SwapError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        return JSONResponse(session.status()["learner"])

    # Starlette routes: the handlers take the request as is (no FastAPI parameter inference)
    app.add_route("/draftopd/status", status, methods=["GET"])
    app.add_route("/draftopd/rollback", rollback, methods=["POST"])
    app.add_route("/draftopd/promote", promote, methods=["POST"])
    app.add_route("/draftopd/learner", learner, methods=["POST"])


def _read_candidate(session: ServeSession, path: str) -> StoredDrafter:
    """A drafter directory of the serving drafter's family and shape (vLLM reloads in place: no new shapes)."""
    from draftopd.drafters import read_raw

    kind, _ = read_raw(path)
    if kind != session.kind:
        raise ValueError(f"{path} holds a '{kind}' drafter; a '{session.kind}' one is serving")
    new = StoredDrafter.read(path)
    old = StoredDrafter.read(version_path(session.store, session.version)).state()
    shapes = {k: tuple(v.shape) for k, v in new.state().items()}
    if shapes != {k: tuple(v.shape) for k, v in old.items()}:
        raise ValueError(f"{path}: its tensors' names or shapes differ from the serving drafter's")
    return new


class DraftopdCollector:
    """draftopd's gauges, read from the session at each scrape of vLLM's /metrics."""

    def __init__(self, session: ServeSession):
        self.session = session

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.session.status()
        buf = st["buffer"]
        yield GaugeMetricFamily("draftopd_drafter_version", "drafter version serving", value=st["version"])
        yield GaugeMetricFamily(
            "draftopd_buffer_trajectories",
            "trajectories in the traffic buffer",
            value=buf.get("trajectories", 0),
        )
        yield GaugeMetricFamily("draftopd_learner_steps", "learner optimizer steps", value=st["learner"]["steps"])
        yield CounterMetricFamily("draftopd_promotions", "drafter versions promoted", value=st["learner"]["promotions"])
        yield CounterMetricFamily(
            "draftopd_rejections", "candidates the guard refused", value=st["learner"]["rejections"]
        )
        yield CounterMetricFamily("draftopd_rollbacks", "rollbacks", value=st["requests"]["rollbacks"])
        yield CounterMetricFamily(
            "draftopd_recorded_requests", "finished requests recorded", value=st["requests"]["requests"]
        )
        tau = GaugeMetricFamily("draftopd_live_tau", "live tau per drafter version", labels=["version"])
        for v, row in st["live"].items():
            if row["steps"]:
                tau.add_metric([v], row["tau"])
        yield tau


def register_metrics(session: ServeSession):
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    collector = DraftopdCollector(session)
    get_prometheus_registry().register(collector)
    return collector


def _unregister(collector) -> None:
    if collector is None:
        return
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    try:
        get_prometheus_registry().unregister(collector)
    except KeyError:
        pass
