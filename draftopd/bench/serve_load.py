"""`draftopd bench serve-load`: `draftopd serve` under load, learning on and then off, from one run.

Each arm is one server subprocess on 127.0.0.1 (same command but `--learning`), and `concurrency` `openai`
clients that send chat requests back to back for `duration_s` (the same prompts, cycled, with the shift of
serve-adapt). Reported per arm: requests served and failed (any exception or error status; the client never
retries), latency per request (p50, p99), output tokens/s over the arm's wall time, the peak resident memory of
the server's process tree (sampled every half second, with the samples' first and last values to show whether
it grows) and whether every response equals the target alone's at T = 0; then the ratios on/off.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftopd.bench.serve_process import BENCH_LEARNER, RssSampler, ServerProcess, serve_args
from draftopd.bench.serve_traffic import ChatClient, Reference, lossless_check, send_for, thinking

ARMS = ("on", "off")


@dataclass
class LoadSettings:
    """The load run; the defaults are the full-size one (8 clients, 5 minutes per arm)."""

    target: str = "toy"
    drafter: str = "toy"
    seed: int = 0
    duration_s: float = 300.0
    concurrency: int = 8
    num_prompts: int = 64  # distinct prompts, cycled
    shift: str = "thinking-off"
    max_tokens: int = 96
    num_draft_tokens: int = 4
    learner: list[str] = field(default_factory=lambda: list(BENCH_LEARNER))
    server_args: list[str] = field(default_factory=list)
    replicas: int = 2  # a fleet of this many vLLM replicas and a learner of its own; 0: the one-process server
    arms: tuple[str, ...] = ARMS  # learning on, off, in this order


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def rss_trace(samples: list[tuple[float, int]], every_s: float) -> list[list[float]]:
    """[seconds, MiB] every `every_s` seconds of the RSS samples (the first sample at or after each mark):
    whether memory levels off once the traffic buffer is full."""
    out, mark = [], 0.0
    for t, rss in samples:
        if t >= mark:
            out.append([round(t, 1), round(rss / 2**20, 1)])
            mark = t - t % every_s + every_s
    return out


def run_load_arm(arm: str, chats: list, expected: dict, s: LoadSettings, out: Path, reference: Reference) -> dict:
    args = serve_args(s.target, s.drafter, s.num_draft_tokens, arm, s.learner, s.server_args, s.replicas)
    with ServerProcess(out / f"load-{arm}", args) as server:
        sampler = RssSampler(server.proc.pid, roles=server.role_rss).start()
        try:
            client = ChatClient(server.url, s.max_tokens, thinking(s.shift), server.api_key)
            t_start = time.time()
            replies, wall = send_for(client, chats, s.concurrency, s.duration_s)
            status = server.status()
        finally:
            sampler.stop()
    ok = [r for r in replies if not r.error]
    latencies = [r.latency_s for r in ok]
    tokens = sum(r.completion_tokens for r in ok)
    samples = sampler.samples
    return {
        "requests": len(replies),
        "failed": len(replies) - len(ok),
        "first_errors": [r.error for r in replies if r.error][:3],
        "wall_s": wall,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "latency_mean_s": sum(latencies) / len(latencies) if latencies else float("nan"),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "requests_per_s": len(ok) / wall if wall > 0 else float("nan"),
        "peak_rss_mb": sampler.peak / 2**20,
        "rss_first_mb": samples[0][1] / 2**20 if samples else float("nan"),
        "rss_last_mb": samples[-1][1] / 2**20 if samples else float("nan"),
        "rss_trace_mb": rss_trace(samples, 10.0),
        "peak_rss_mb_per_role": {k: v / 2**20 for k, v in sampler.role_peaks.items()},
        "server_ready_s": server.ready_s,
        "learner_steps": status["learner"].get("steps", 0),
        "promotions": status["learner"].get("promotions", 0),
        "rejections": status["learner"].get("rejections", 0),
        "buffer": status.get("buffer", status.get("records", {})),
        "replicas": status.get("replicas", []),
        "versions_over_time": _relative(status.get("timeline", []), t_start),
        "lossless": lossless_check(replies, reference, expected),
    }


def _relative(timeline: list[dict], t0: float) -> list[dict]:
    """The fleet's version events with times in seconds from the load's start (negative: before it)."""
    return [{**e, "time": round(e["time"] - t0, 2)} for e in timeline]


def versions_plot(report: dict, out_png) -> bool:
    """Every replica's drafter version against seconds since the load began, one panel per fleet arm, with the load's
    window shaded; False (nothing written) when no arm ran a fleet."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    arms = {a: r["versions_over_time"] for a, r in report["arms"].items() if r.get("versions_over_time")}
    if not arms:
        return False
    fig = Figure(figsize=(9, 2.6 * len(arms) + 0.6), dpi=100, layout="constrained")
    axes = fig.subplots(len(arms), 1, squeeze=False)[:, 0]
    end = report["settings"]["duration_s"]
    for ax, (arm, events) in zip(axes, arms.items()):
        ax.axvspan(0, end, color="0.9", label="load")
        for i in sorted({e["replica"] for e in events}):
            mine = [e for e in events if e["replica"] == i]
            xs = [e["time"] for e in mine] + [max(end, mine[-1]["time"])]
            ys = [e["version"] for e in mine] + [mine[-1]["version"]]
            ax.step(xs, [y + 0.04 * i for y in ys], where="post", marker="o", ms=3, label=f"replica {i}")
        ax.set_ylabel("drafter version")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"learning {arm}: each replica's version (pushes drain it first)", fontsize="medium")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    axes[-1].set_xlabel("seconds since the load began")
    fig.savefig(out_png, format="png")
    return True


def run_load(chats: list, expected: dict, reference: Reference, s: LoadSettings, out: Path) -> dict:
    reference.prepare(list(expected.values()))
    arms = {arm: run_load_arm(arm, chats, expected, s, out, reference) for arm in s.arms}
    keys = ("latency_p50_s", "latency_p99_s", "output_tokens_per_s", "peak_rss_mb")
    both = "on" in arms and "off" in arms
    return {
        "settings": asdict(s),
        "arms": arms,
        "on_over_off": {k: arms["on"][k] / arms["off"][k] if arms["off"][k] else float("nan") for k in keys}
        if both
        else {},
        "failed_requests": sum(a["failed"] for a in arms.values()),
        "lossless_failures": sum(a["lossless"]["failures"] for a in arms.values()),
        "lossless_checked": sum(a["lossless"]["checked"] for a in arms.values()),
    }


def table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"serve-load: {s['concurrency']} clients for {s['duration_s']:.0f} s per arm, max_tokens "
        f"{s['max_tokens']}, K={s['num_draft_tokens']}"
    ]
    lines.append(
        f"{'learning':>8} {'requests':>9} {'failed':>7} {'p50 s':>7} {'p99 s':>7} {'tok/s':>8} "
        f"{'peak RSS MB':>12} {'steps':>6} {'promoted':>9}"
    )
    for arm, a in report["arms"].items():
        lines.append(
            f"{arm:>8} {a['requests']:9d} {a['failed']:7d} {a['latency_p50_s']:7.3f} {a['latency_p99_s']:7.3f} "
            f"{a['output_tokens_per_s']:8.1f} {a['peak_rss_mb']:12.0f} {a['learner_steps']:6d} "
            f"{a['promotions']:9d}"
        )
    for arm, a in report["arms"].items():
        roles = a.get("peak_rss_mb_per_role", {})
        if len(roles) > 1:
            lines.append(
                f"peak RSS MB per role, learning {arm}: " + ", ".join(f"{k} {v:.0f}" for k, v in roles.items())
            )
        for e in a.get("versions_over_time", []):
            lines.append(f"  t={e['time']:8.1f} s  replica {e['replica']}  version {e['version']:>3}  {e['note']}")
    r = report["on_over_off"]
    if r:
        lines.append("on/off: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
    lines.append(
        f"lossless: {report['lossless_failures']} of {report['lossless_checked']} responses differ from the "
        f"target alone; failed requests: {report['failed_requests']}"
    )
    return "\n".join(lines)
