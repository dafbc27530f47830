"""Commands `serve` (vLLM's OpenAI-compatible server recording its traffic and, optionally, a learner beside it)
and `rollback` (asks a running server to serve its previous drafter version again)."""

from __future__ import annotations

import json
import os
import sys

from draftopd.cli.common import SHIPPED, add_command, at_least_one
from draftopd.serve.settings import CPU_MEMORY_FRACTION, RECORD_MODES


def register(sub) -> None:
    p = add_command(
        sub,
        "serve",
        cmd_serve,
        "serve a target and drafter through vLLM's OpenAI API, recording traffic (and learning from it)",
        description="vLLM's OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /metrics) "
        "over the target with the drafter as its speculator, recording each finished request; /draftopd/status and "
        "/draftopd/rollback beside them. Bound to 127.0.0.1 unless --host says otherwise (then an API key is "
        "required).",
    )
    p.add_argument("--target", default="toy", help="the target model's directory (`toy`: the shipped toy target)")
    p.add_argument(
        "--drafter",
        default="toy",
        help=f"a drafter directory, {SHIPPED}, or init:eagle3 / init:dflash (day 0: a fresh drafter built from the "
        "target's shapes alone, to learn from the traffic)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind; not loopback: --api-key is required")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default="", help="bearer token for /v1/* and /draftopd/* (or DRAFTOPD_API_KEY)")
    p.add_argument("--num-draft-tokens", type=at_least_one, default=4, help="K, drafts per verification step")
    p.add_argument("--learning", choices=["on", "off"], default="off", help="train the drafter on the traffic")
    p.add_argument(
        "--record",
        choices=list(RECORD_MODES),
        default="stock",
        help="how served requests are recorded: stock (vLLM's per-request metrics, read from the responses; any "
        "model runner), full (the recording hook too: drafted tokens and their scores, for the learner's rejected "
        "stream; vLLM's V1 runner), off (no buffer, no learning)",
    )
    p.add_argument("--run-dir", default="serve-run", help="drafter versions, saved traffic, MLflow store")
    p.add_argument("--buffer-capacity", type=at_least_one, default=4096, help="trajectories kept in memory")
    p.add_argument("--keep-text", action="store_true", help="keep the traffic's text, not only its token ids")
    p.add_argument(
        "--retention-s",
        type=float,
        default=None,
        help="drop recorded traffic older than this (default: kept until pushed out)",
    )
    p.add_argument("--rollback-window", type=at_least_one, default=32, help="requests before auto-rollback judges")
    p.add_argument(
        "--dtype",
        default="auto",
        help="vLLM's dtype for the target and drafter, and the learner's copy (auto: the target's own, vLLM's "
        "bfloat16 for a float32 target on a GPU; a float32 target stays float32 on CPU)",
    )
    p.add_argument("--max-model-len", type=at_least_one, default=2048, help="vLLM's longest prompt + response")
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help=f"vLLM's gpu_memory_utilization (default: vLLM's own on a GPU; {CPU_MEMORY_FRACTION} on CPU, where it "
        "is the share of the machine's memory vLLM reserves)",
    )
    p.add_argument("--served-model-name", default="", help="the model name clients send (default: target's dir)")
    p.add_argument("--learner", nargs="*", default=[], metavar="FIELD=VALUE", help="LearnerSettings overrides")
    p.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="a fleet on Ray: this many stock vLLM replicas behind draftopd's router, the learner in an actor of "
        "its own (0, the default: one process, vLLM's server with the learner beside it); needs --api-key",
    )
    p.add_argument(
        "--attach",
        nargs="+",
        default=[],
        metavar="URL",
        help="a fleet over vLLM servers someone else runs (their URLs; they take --api-key, run vLLM's weight-update"
        " routes with VLLM_SERVER_DEV_MODE=1 and draftopd's weight transfer: docs/serving.md): learns from their "
        "traffic and pushes to them; never starts, stops or restarts them",
    )
    p.add_argument(
        "--learner-device",
        choices=["cpu", "gpu"],
        default="cpu",
        help="the fleet's learner: a core of its own (cpu) or a GPU of its own (gpu)",
    )

    r = add_command(sub, "rollback", cmd_rollback, "make a running `draftopd serve` serve its previous drafter")
    r.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    r.add_argument("--api-key", default="", help="the server's API key (or DRAFTOPD_API_KEY)")


def settings_from(args):
    from draftopd.serve.settings import ServeSettings

    return ServeSettings(
        target=args.target,
        drafter=args.drafter,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("DRAFTOPD_API_KEY", ""),
        num_draft_tokens=args.num_draft_tokens,
        learning=args.learning == "on",
        record=args.record,
        run_dir=args.run_dir,
        buffer_capacity=args.buffer_capacity,
        keep_text=args.keep_text,
        retention_s=args.retention_s,
        rollback_window=args.rollback_window,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        memory_fraction=args.memory_fraction,
        served_model_name=args.served_model_name or ("toy" if args.target == "toy" else ""),
        learner=_overrides(args.learner),
    )


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            from draftopd.config import ConfigError

            raise ConfigError(f"--learner takes FIELD=VALUE, not {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_serve(args) -> int:
    from draftopd.serve.settings import refusal

    settings = settings_from(args)
    why = refusal(settings)
    if why:
        print(f"draftopd serve: error: {why}", file=sys.stderr)
        return 2
    if args.replicas > 0 or args.attach:
        return _fleet(args, settings)
    from draftopd.serve.server import serve

    return serve(settings)


def _fleet(args, settings) -> int:
    if not settings.api_key:
        print(
            "draftopd serve: error: a fleet (--replicas, --attach) needs an API key (--api-key or DRAFTOPD_API_KEY)",
            file=sys.stderr,
        )
        return 2
    if settings.record != "stock":
        print("draftopd serve: error: a fleet records from the responses: --record stock", file=sys.stderr)
        return 2
    from draftopd.serve.fleet import FleetSettings, serve_fleet

    if args.attach and args.replicas:
        print("draftopd serve: error: --attach or --replicas, not both", file=sys.stderr)
        return 2
    fs = FleetSettings(args.replicas, args.learner_device, learning=settings.learning, attach=list(args.attach))
    serve_fleet(settings, fs)
    return 0


def cmd_rollback(args) -> int:
    import urllib.error
    import urllib.request

    key = args.api_key or os.environ.get("DRAFTOPD_API_KEY", "")
    req = urllib.request.Request(args.url.rstrip("/") + "/draftopd/rollback", data=b"{}", method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        print(f"draftopd rollback: error: {exc.code} {exc.read().decode(errors='replace').strip()}", file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"draftopd rollback: error: no server at {args.url} ({exc.reason})", file=sys.stderr)
        return 1
    print(f"serving drafter version {body['version']}")
    return 0
