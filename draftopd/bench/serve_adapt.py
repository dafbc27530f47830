"""`draftopd bench serve-adapt`: live tau of `draftopd serve` on traffic its drafter was not trained for, with the
learner on against the same server with it off (the control arm), over seeds.

Per seed and arm, one `draftopd serve` subprocess (same command but `--learning on|off`, its own run directory
and port) gets the same shifted traffic (serve_traffic.py: toy prompts with thinking off, the seed picks the
draw) through the `openai` client, `concurrency` requests at a time and at most `rate` per second (the learner
learns in wall time: traffic faster than that leaves it fewer steps per request), in windows of `window`
requests. After each window the bench reads vLLM's own speculative-decoding counters from `/metrics`: the
window's live tau is 1 + accepted drafts / draft steps between the two scrapes, whatever drafter version served
it, as a user's dashboard would show it; `/draftopd/status` gives the drafter version, learner steps,
promotions and rejections. The headline is the final window's tau, learning on over off, per seed, with a
95% t-interval over seeds. Every response is checked against the target alone at T = 0 (`lossless_failures`),
across swaps.

Day 0 (`--drafter init:FAMILY --control-drafter FAMILY`): the learning arm starts from a fresh drafter and the
control serves the family's SFT drafter without learning, so on/off is the day-0 drafter's live tau as a
fraction of the shipped one's on the same traffic. `--control-drafter DIR` serves any other drafter as the control,
such as one trained offline for the traffic served.

The isolated baseline (`--baseline-drafter DIR`): a third arm, learning off, serving a drafter trained offline on
the target's own text for the traffic served (SFT with the traffic's chat template, at the serving temperature),
on the same traffic: `on_over_base` says whether learning from traffic reaches what offline training on the
right text gives, `base_over_off` what that text alone is worth.

The arms' order alternates with the seed (on first for even seeds), so a slow drift of the machine's load does
not favour one arm.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftopd.bench.opd_vs_sft import t_interval
from draftopd.bench.serve_process import BENCH_LEARNER, ServerProcess, serve_args
from draftopd.bench.serve_traffic import ChatClient, lossless_check, send_all, thinking, traffic_mix

ARMS = ("on", "off")
BASE = "base"  # the isolated baseline's arm, when there is one


def arms_of(row: dict) -> tuple[str, ...]:
    """The arms a seed's row holds: on and off, and the isolated baseline's when it was run."""
    return ARMS + ((BASE,) if BASE in row else ())


def arms_to_run(s: AdaptSettings) -> tuple[str, ...]:
    """The arms the settings ask for: on and off, and the isolated baseline's when a baseline drafter is named."""
    return ARMS + ((BASE,) if s.baseline else ())


@dataclass
class AdaptSettings:
    """Sizes of the demonstration; the defaults are the full-size run (see docs/serving.md for its wall time)."""

    target: str = "toy"
    drafter: str = "toy"
    seeds: tuple[int, ...] = (0, 1, 2)
    num_requests: int = 480  # per seed and arm
    window: int = 40  # requests between two readings of live tau
    concurrency: int = 4  # clients sending at once
    rate: float = 2.0  # requests per second at most (0: as fast as the server answers): the learner's time
    max_tokens: int = 96
    num_draft_tokens: int = 4
    shift: str = "thinking-off"  # what the traffic changes (serve_traffic.SHIFTS)
    domain: str | None = None  # one toy domain only (arithmetic, code), or all
    learner: list[str] = field(
        default_factory=lambda: list(BENCH_LEARNER)
    )  # `draftopd serve --learner` overrides (FIELD=VALUE)
    server_args: list[str] = field(default_factory=list)  # more `draftopd serve` flags, both arms
    settle_s: float = 0.2  # pause before reading counters after a window (the last step's stats to land)
    replicas: int = 2  # a fleet of this many vLLM replicas and a learner of its own; 0: the one-process server
    control: str = ""  # the learning-off arm's drafter ("": the same as the learning arm's); day 0: the shipped SFT
    baseline: str = ""  # a third arm, learning off, with this drafter (the isolated baseline); "": none


def run_arm(arm: str, seed: int, chats: list, expected: dict, s: AdaptSettings, out: Path, reference) -> dict:
    """One server, the seed's traffic in windows; the curve, the final status and the lossless check."""
    drafter = {"off": s.control or s.drafter, BASE: s.baseline}.get(arm, s.drafter)
    learning = "on" if arm == "on" else "off"
    args = serve_args(s.target, drafter, s.num_draft_tokens, learning, s.learner, s.server_args, s.replicas)
    with ServerProcess(out / f"seed{seed}-{arm}", args) as server:
        client = ChatClient(server.url, s.max_tokens, thinking(s.shift), server.api_key)
        replies, curve = [], []
        t0 = time.monotonic()
        pace = (lambda i: t0 + i / s.rate) if s.rate > 0 else None
        for w0 in range(0, len(chats), s.window):
            before = server.counters()
            batch = send_all(client, chats[w0 : w0 + s.window], s.concurrency, w0, pace)
            time.sleep(s.settle_s)
            after, st = server.counters(), server.status()
            replies += batch
            curve.append(_point(w0 + len(batch), after.tau_since(before), time.monotonic() - t0, batch, st))
            print(
                f"  seed {seed} learning {arm}: {curve[-1]['requests']} requests, tau {curve[-1]['tau']:.3f}, "
                f"version {st['version']}, learner steps {curve[-1]['learner_steps']}",
                flush=True,
            )
        final = server.status()
        minutes = (time.monotonic() - t0) / 60
        ready_s, rss = server.ready_s, server.rss()
    learner = final["learner"]
    steps = learner.get("steps", 0)
    return {
        "curve": curve,
        "final_tau": curve[-1]["tau"],
        "minutes": minutes,
        "learner_minutes": minutes if arm == "on" else 0.0,
        "learner_steps": steps,
        "learner_steps_per_minute": steps / minutes if arm == "on" and minutes > 0 else 0.0,
        "learner_step_seconds": learner.get("step_seconds"),  # the fleet's learner: time inside its steps
        "learner_replayed_tokens": learner.get("replayed_tokens"),  # the fleet's learner: rows' tokens
        "learner_supervised": learner.get("supervised"),  # and the loss's supervised (position, depth) cells
        "learner_context_tokens": learner.get("context_tokens"),  # the fleet's learner: prompt tokens it keeps
        "promotions": learner.get("promotions", 0),
        "rejections": learner.get("rejections", 0),
        "learner_errors": learner.get("errors", 0),
        "versions_served": final.get("history", [final["version"]]),
        "failed_requests": sum(bool(r.error) for r in replies),
        "first_errors": [r.error for r in replies if r.error][:3],
        "lossless": lossless_check(replies, reference, expected),
        "server_ready_s": ready_s,
        "server_rss_end_mb": rss / 2**20,
        "buffer": final.get("buffer", final.get("records", {})),
        "replicas": final.get("replicas", []),
    }


def _point(requests: int, tau: float, seconds: float, batch: list, st: dict) -> dict:
    learner = st["learner"]
    return {
        "requests": requests,
        "tau": tau,
        "minutes": seconds / 60,
        "version": st["version"],
        "learner_steps": learner.get("steps", 0),
        "promotions": learner.get("promotions", 0),
        "rejections": learner.get("rejections", 0),
        "failed": sum(bool(r.error) for r in batch),
    }


def run_adapt(traffic, reference, s: AdaptSettings, out: Path) -> dict:
    """Both arms for every seed. `traffic(seed)` -> (chats, {index: prompt ids as the tokenizer renders them
    here}); the server's own rendering is checked against the latter, its outputs against `reference`."""
    seeds = {}
    for seed in s.seeds:
        chats, expected = traffic(seed)
        reference.prepare(list(expected.values()))  # before serving: the reference does not compete for cores
        names = arms_to_run(s)
        order = names if seed % 2 == 0 else names[::-1]
        arms = {arm: run_arm(arm, seed, chats, expected, s, out, reference) for arm in order}
        ratio = arms["on"]["final_tau"] / arms["off"]["final_tau"]
        seeds[seed] = {**{a: arms[a] for a in names}, "on_over_off": ratio, "traffic_mix": traffic_mix(chats)}
        if s.baseline:
            seeds[seed]["on_over_base"] = arms["on"]["final_tau"] / arms[BASE]["final_tau"]
            seeds[seed]["base_over_off"] = arms[BASE]["final_tau"] / arms["off"]["final_tau"]
    return summarise(seeds, s)


def summarise(seeds: dict, s: AdaptSettings) -> dict:
    """The report: per seed and arm the curves and figures; the headline ratio with its interval over seeds."""
    ratio, lo, hi = t_interval([r["on_over_off"] for r in seeds.values()])
    arms = [r[a] for r in seeds.values() for a in arms_of(r)]
    diffs = [d for a in arms for d in a["lossless"]["first"]]
    names = arms_of(next(iter(seeds.values())))
    baseline = {}
    for key in ("on_over_base", "base_over_off") if BASE in names else ():
        mean, b_lo, b_hi = t_interval([r[key] for r in seeds.values()])
        baseline |= {key: mean, f"{key}_ci95": [b_lo, b_hi]}
    return {
        "settings": asdict(s),
        "seeds": {str(k): v for k, v in seeds.items()},
        "final_tau": {a: t_interval([r[a]["final_tau"] for r in seeds.values()]) for a in names},
        "on_over_off": ratio,
        "on_over_off_ci95": [lo, hi],
        **baseline,
        "requests_per_arm": s.num_requests,
        "learner_minutes": sum(r["on"]["learner_minutes"] for r in seeds.values()) / len(seeds),
        "learner_steps": [r["on"]["learner_steps"] for r in seeds.values()],
        "learner_steps_per_minute": [r["on"]["learner_steps_per_minute"] for r in seeds.values()],
        "promotions": [r["on"]["promotions"] for r in seeds.values()],
        "rejections": [r["on"]["rejections"] for r in seeds.values()],
        "failed_requests": sum(a["failed_requests"] for a in arms),
        "lossless_checked": sum(a["lossless"]["checked"] for a in arms),
        "lossless_failures": sum(a["lossless"]["failures"] for a in arms),
        "lossless_diffs": diffs[:5],
        "prompts_rendered_otherwise": sum(a["lossless"]["prompts_rendered_otherwise"] for a in arms),
        "milestones": milestones(seeds),
    }


def merge(reports: list[dict]) -> dict:
    """One report from runs of the same settings over different seeds (run one after another, or on several
    machines): the seeds pooled, the headline and its interval computed again over all of them. Runs whose
    settings differ in anything but their seeds, or that share a seed, are refused, naming what differs."""
    if not reports:
        raise ValueError("nothing to merge")
    defaults = asdict(AdaptSettings())  # a report written before a setting existed had its default
    first = {k: v for k, v in {**defaults, **reports[0]["settings"]}.items() if k != "seeds"}
    seeds: dict[int, dict] = {}
    for i, r in enumerate(reports):
        other = {k: v for k, v in {**defaults, **r["settings"]}.items() if k != "seeds"}
        differ = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
        if differ:
            raise ValueError(f"report {i + 1}'s settings differ from report 1's in {', '.join(differ)}")
        for seed, row in r["seeds"].items():
            if int(seed) in seeds:
                raise ValueError(f"seed {seed} is in more than one report")
            seeds[int(seed)] = row
    settings = AdaptSettings(**{**first, "seeds": tuple(sorted(seeds))})
    return summarise(dict(sorted(seeds.items())), settings)


MILESTONES = (500, 1000, 2000)


def milestones(seeds: dict) -> dict:
    """On over off at the window that ends at (or first passes) each of MILESTONES requests served, per seed and
    with its 95% t-interval over seeds: day 0's reading of "how close to the shipped drafter, how soon"."""
    out = {}
    for n in MILESTONES:
        ratios = []
        for r in seeds.values():
            on, off = ([p for p in r[a]["curve"] if p["requests"] >= n][:1] for a in ARMS)
            if on and off and off[0]["tau"] > 0:
                ratios.append(on[0]["tau"] / off[0]["tau"])
        if len(ratios) == len(seeds):
            mean, lo, hi = t_interval(ratios)
            out[str(n)] = {"on_over_off": mean, "ci95": [lo, hi], "per_seed": ratios}
    return out


def table(report: dict) -> str:
    s = report["settings"]
    where = f"a fleet of {s['replicas']} replicas" if s.get("replicas") else "one process"
    lines = [
        f"serve-adapt ({where}, drafter {s['drafter']}"
        + (f", control arm's {s['control']}" if s.get("control") else "")
        + (f", isolated baseline {drafter_label(s['baseline'])}" if s.get("baseline") else "")
        + f"): {s['num_requests']} requests per arm ({s['shift']}, "
        f"{s['domain'] or 'all domains'}), windows of {s['window']}, {s['concurrency']} clients, "
        f"K={s['num_draft_tokens']}, seeds {s['seeds']}"
    ]
    mixes = (f"{seed}: {r.get('traffic_mix')}" for seed, r in report["seeds"].items())  # the rows' order
    lines.append(f"requests per domain, per seed: {'; '.join(mixes)}")
    lines.append(
        f"{'seed':>5} {'tau off':>8} {'tau on':>8} {'on/off':>7} {'steps':>6} {'steps/min':>9} {'promoted':>9} "
        f"{'refused':>8} {'learner min':>12}"
    )
    for seed, r in report["seeds"].items():
        on, off = r["on"], r["off"]
        lines.append(
            f"{seed:>5} {off['final_tau']:8.3f} {on['final_tau']:8.3f} {r['on_over_off']:7.3f} "
            f"{on['learner_steps']:6d} {on.get('learner_steps_per_minute', 0.0):9.1f} {on['promotions']:9d} "
            f"{on['rejections']:8d} {on['learner_minutes']:12.1f}"
        )
    lo, hi = report["on_over_off_ci95"]
    lines.append(f"on/off (final window's live tau): {report['on_over_off']:.3f}, 95% CI [{lo:.3f}, {hi:.3f}]")
    taus = " / ".join(f"{r[BASE]['final_tau']:.3f}" for r in report["seeds"].values() if BASE in r)
    for key, name in (("on_over_base", "on/baseline"), ("base_over_off", "baseline/off")):
        if key in report:
            a, b = report[f"{key}_ci95"]
            lines.append(f"{name}: {report[key]:.3f}, 95% CI [{a:.3f}, {b:.3f}] (baseline's tau per seed {taus})")
    for n, m in report.get("milestones", {}).items():
        a, b = m["ci95"]
        lines.append(f"on/off at {n} requests: {m['on_over_off']:.3f}, 95% CI [{a:.3f}, {b:.3f}]")
    lines.append(
        f"lossless: {report['lossless_failures']} of {report['lossless_checked']} responses differ from the "
        f"target alone; failed requests: {report['failed_requests']}"
    )
    return "\n".join(lines)


def drafter_label(name: str) -> str:
    """A drafter as a plot names it: a directory by its run's name (`.../dflash-sft/checkpoints/final` and the
    run's export for vLLM `.../pard-sft/vllm` -> `dflash-sft`, `pard-sft`), not by where it lies on this machine;
    a name (`toy`, `init:eagle3`) as it is."""
    parts = [p for p in Path(name).parts if p not in ("/", "checkpoints", "final", "vllm")]
    return parts[-1] if len(Path(name).parts) > 1 and parts else name


def curve_plot(report: dict, out_png) -> None:
    """Live tau against requests served, learning on and off: the mean over seeds with its 95% t-interval as a
    band, each seed's curve thin, and ticks where the learner's versions were promoted."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    promoted = []
    s = report["settings"]
    names = {"off": "learning off (control)", "on": "learning on"}  # off first: the plot's colours stay
    arms = "learning on vs off"
    if s.get("control"):  # the arms serve different drafters (day 0, or a control trained for the traffic)
        control = drafter_label(s["control"])
        names = {"off": f"{control}, learning off", "on": f"{s['drafter']}, learning on"}
        arms = f"{s['drafter']} learning vs {control} fixed"
    if s.get("baseline"):
        names[BASE] = f"isolated baseline {drafter_label(s['baseline'])}, learning off"
    for arm, label in names.items():
        curves = [r[arm]["curve"] for r in report["seeds"].values()]
        n = min(len(c) for c in curves)
        xs = [curves[0][i]["requests"] for i in range(n)]
        stats = [t_interval([c[i]["tau"] for c in curves]) for i in range(n)]
        line = ax.plot(xs, [m for m, _, _ in stats], marker="o", markersize=3, label=label)[0]
        ax.fill_between(xs, [lo for _, lo, _ in stats], [hi for _, _, hi in stats], color=line.get_color(), alpha=0.15)
        for c in curves:
            ax.plot([p["requests"] for p in c], [p["tau"] for p in c], color=line.get_color(), lw=0.6, alpha=0.35)
            ups = [b["requests"] for a, b in zip([{"promotions": 0}, *c], c) if b["promotions"] > a["promotions"]]
            promoted += [(x, line.get_color()) for x in ups]
    bottom = ax.get_ylim()[0]
    for x, color in promoted:  # the window in which a new version began serving
        ax.plot([x], [bottom], "^", color=color, ms=6, alpha=0.7, clip_on=False)
    ax.set_xlabel("requests served")
    ax.set_ylabel("live tau per window (vLLM's counters)")
    n = len(s["seeds"])
    ax.set_title(
        f"draftopd serve on shifted traffic ({s['shift']}): {arms}\n"
        + f"{n} seed{'s' if n > 1 else ''}; bands: 95% t-interval over seeds; ^: a promoted version began serving",
        fontsize="medium",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(out_png, format="png")


def mlflow_rows(report: dict) -> list[tuple[str, float, int]]:
    """(name, value, step) rows: the curves (step = requests served), the finals and the headline."""
    rows = []
    for seed, r in report["seeds"].items():
        for arm in arms_of(r):
            rows += [(f"curve/{arm}/seed{seed}", p["tau"], p["requests"]) for p in r[arm]["curve"]]
            rows.append((f"final_tau/{arm}", r[arm]["final_tau"], int(seed)))
        rows += [("seed_on_over_off", r["on_over_off"], int(seed)), ("promotions", r["on"]["promotions"], int(seed))]
    lo, hi = report["on_over_off_ci95"]
    rows += [
        ("on_over_off", report["on_over_off"], 0),
        ("on_over_off_ci95_low", lo, 0),
        ("on_over_off_ci95_high", hi, 0),
        *[(key, report[key], 0) for key in ("on_over_base", "base_over_off") if key in report],
        ("lossless_failures", report["lossless_failures"], 0),
        ("failed_requests", report["failed_requests"], 0),
        ("learner_minutes", report["learner_minutes"], 0),
    ]
    return rows
