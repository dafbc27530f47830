"""Rejection explorer: where a drafter gets rejected, read from a Draft-OPD run's replay buffer or from the traffic
buffer `draftopd serve` saves in its run directory.

The buffer holds the trajectories of its error states with every verification step of them (draft tokens,
accepted count, position, log-probs, policy version), so it answers, without running any model:

* which draft tokens the target rejects most: the first rejected draft of a step, with its rate = rejections
  / times the token was judged (drafted at an offset the target checked: up to and including the first
  rejection; drafts after it were never judged), and the target's token that replaced it;
* at which block offset the first rejection happens (the rate is conditional: rejections at offset a / steps
  whose drafts before a were all accepted);
* per prompt domain, where the prompts carry one (the toy corpus, a prepared pool's sources, a "domain" field
  on JSONL lines);
* the contexts (the last few tokens before the rejection point) rejected most;
* acceptance per policy version, tau as `acceptance_stats` defines it.

Only trajectories that still hold an error state are in the buffer: fully accepted trajectories, and states
evicted or past `buffer.max_staleness`, are not, so rates describe where the drafter struggles lately rather
than its overall acceptance (the held-out eval measures that).

A serving run's traffic buffer (`run_dir/traffic/`, read with `TrafficBuffer.load`) holds every served request
that had a verification step, accepted or not, in both its slices (training and held-out, counted apart in
`by_slice`); the domain is the one the server gave each request (`serve.records.traffic_domain`) and the
policy version the drafter version that served it. Its rates describe the traffic the buffer still holds
(bounded, oldest dropped first, and the retention setting).
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter, defaultdict
from pathlib import Path

from draftopd.eval.acceptance import acceptance_stats
from draftopd.messages import Trajectory
from draftopd.rundir import latest_checkpoint

TRAFFIC = "traffic"  # the folder of a serving run directory the traffic buffer is saved in (serve/session.py)
SERVE_EXPERIMENT = "draftopd-serve"  # the MLflow experiment of serving sessions (serve/server.py)
SERVE_MARKS = ("serving.json", "versions", TRAFFIC)  # what `draftopd serve` writes in its run directory
SEQUENCE_ENDED = "(sequence ended)"  # a rejection in a step the end-of-sequence or the budget cut short
RANKED = ("rejected_tokens", "replacements", "contexts")  # tables cut to --top rows when printed


def read_run_buffer(run_dir: str | Path) -> tuple[Path, dict, dict]:
    """(checkpoint directory, buffer state_dict, driver state) of a run's newest checkpoint; FileNotFoundError
    naming what is missing otherwise."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(
            f"{run} is not a run directory (no config.yaml of a Draft-OPD run, no traffic/ of draftopd serve)"
        )
    ckpt = latest_checkpoint(run)
    if ckpt is None and (run / "checkpoints" / "final").is_dir():
        raise FileNotFoundError(
            f"{run} holds no Draft-OPD replay buffer: it is an SFT run (its drafter is in checkpoints/final), and "
            "rejections reads the buffer a Draft-OPD run (opd.enabled=true) saves with each checkpoint"
        )
    if ckpt is None:
        raise FileNotFoundError(
            f"{run} has no saved replay buffer: no checkpoint yet (an SFT-only run, or a Draft-OPD run stopped "
            "before its first checkpoint)"
        )
    if not (ckpt / "buffer.json").is_file():
        raise FileNotFoundError(f"checkpoint {ckpt} holds no buffer.json")
    return ckpt, json.loads((ckpt / "buffer.json").read_text()), json.loads((ckpt / "driver_state.json").read_text())


def is_serving_run(run_dir: str | Path) -> bool:
    """A directory `draftopd serve` wrote (serving.json, versions/ or traffic/) and no training run's config."""
    run = Path(run_dir)
    return not (run / "config.yaml").is_file() and any((run / name).exists() for name in SERVE_MARKS)


def read_traffic(run_dir: str | Path) -> tuple[list, dict]:
    """((slice, Record) of every trajectory a serving run saved, oldest first; the buffer's stats), loaded with
    the buffer's own loader, keeping all it saved; FileNotFoundError when nothing was saved yet."""
    # Up into serve/: a serving run's saved traffic has one reader, the buffer's own loader, so the explorer and
    # the server can never disagree on the file's format.
    from draftopd.serve.traffic import FILE, TrafficBuffer

    path = Path(run_dir) / TRAFFIC / FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} is a draftopd serve run directory with no saved traffic yet (the server saves its traffic "
            "buffer every save_every_s and when it stops)"
        )
    lines = sum(1 for line in path.read_text().splitlines() if line.strip())
    buf = TrafficBuffer.load(path.parent, capacity=max(lines, 2))
    return buf.records(), buf.stats()


def serving_mlflow_run(run_dir: str | Path) -> tuple[str, dict] | None:
    """(run id, params) of the newest serving session's MLflow run in the run directory's store, or None (no
    store, no such run): its params name the target whose tokenizer decodes the traffic."""
    from draftopd.tracking import resolve_tracking_uri

    run = Path(run_dir)
    if not os.environ.get("MLFLOW_TRACKING_URI") and not (run / "mlflow.db").is_file():
        return None  # opening a store that is not there would create one
    from mlflow import MlflowClient

    client = MlflowClient(resolve_tracking_uri(run))
    exp = client.get_experiment_by_name(SERVE_EXPERIMENT)
    found = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    return (found[0].info.run_id, dict(found[0].data.params)) if exp and found else None


def prompt_domains(spec: str, split: str, limit: int, seed: int = 0) -> list[str] | None:
    """The domain of each prompt `load_prompts(spec, split, limit, seed)` returns, in its order (a trajectory's
    `prompt_index` indexes it), or None when the prompts carry none."""
    if spec == "toy":
        return [s.domain for s in toy_samples(split, limit, seed)]
    if Path(spec).is_dir():
        from draftopd.data.pool import pool_rows

        return [row.get("source") or "" for row in pool_rows(spec, split)][:limit]
    domains = []
    for line in Path(spec).read_text(encoding="utf-8").splitlines():
        obj = json.loads(line) if line.strip() else None
        if not isinstance(obj, dict) or ("split" in obj and (obj["split"] == "train") != (split == "train")):
            continue  # the lines read_prompt_file skips
        domains.append(str(obj.get("domain", "")))
    return domains[:limit] if any(domains) else None


def toy_samples(split: str, limit: int, seed: int = 0) -> list:
    """The toy corpus's samples in the order `toy_prompts(split, limit, seed)` gives their prompts (tested)."""
    from draftopd.toy.corpus import build_corpus

    train, held = build_corpus(num_arithmetic=4000, seed=1000 + seed)
    samples = list(train if split == "train" else held)
    random.Random(seed).shuffle(samples)
    return samples[:limit]


# -- the tables ---------------------------------------------------------------------------------------------------


def rejection_report(state: dict, tokenizer, domains: list[str] | None = None, context: int = 3) -> dict:
    """Every table over the trajectories of a buffer `state_dict`, tokens decoded with `tokenizer`."""
    trajs = [Trajectory.from_dict(t) for t in state["trajectories"]]  # the buffer stores each trajectory once
    notes = [] if trajs else ["the buffer holds no error state"]
    per = None
    if domains is None:
        notes.append("the prompts carry no domain: no by_domain table")
    else:  # a prompt index the domains do not reach: left out of by_domain
        per = [domains[t.prompt_index] or "(none)" if 0 <= t.prompt_index < len(domains) else None for t in trajs]
    return _report(trajs, tokenizer, per, context, notes)


def traffic_report(records: list, tokenizer, context: int = 3) -> dict:
    """Every table over a serving run's traffic, `read_traffic`'s (slice, Record) pairs; by domain as the server
    classed each request, by slice (what the learner trains on, what the guard judges on)."""
    trajs = [r.trajectory for _, r in records]
    notes = [] if trajs else ["the traffic buffer holds no served request"]
    report = _report(trajs, tokenizer, [r.domain or "(none)" for _, r in records], context, notes)
    if trajs:
        report["tables"]["by_slice"] = _group_table(trajs, [s for s, _ in records], "slice")
    return report


def _report(trajs: list[Trajectory], tokenizer, domains: list[str | None] | None, context: int, notes: list) -> dict:
    """The tables; `domains`: each trajectory's domain (None: unknown, left out), or None for no by_domain."""
    show = _Decoder(tokenizer)
    rejected, judged, pairs, contexts = Counter(), Counter(), Counter(), defaultdict(Counter)
    unscored = 0
    for traj in trajs:
        full = traj.full_ids
        for step in traj.steps:
            a = step.num_accepted
            if not step.scored:  # stock records: which draft was rejected is not known (messages.py)
                unscored += step.rejected
                continue
            judged.update(step.draft_tokens[: a + 1])
            if not step.rejected:
                continue
            draft = step.draft_tokens[a]
            replacement = step.emitted[a] if len(step.emitted) > a else None
            rejected[draft] += 1
            pairs[draft, replacement] += 1
            at = step.position + a  # index of the rejected draft in the sequence
            contexts[tuple(full[max(0, at - context) : at])][draft, replacement] += 1
    if unscored:
        notes = [
            *notes,
            f"{unscored} rejections come from stock records (rollout.record: stock), which do not name "
            "the rejected draft: counted by offset, not in the token tables",
        ]
    tables = {
        "rejected_tokens": _token_table(rejected, judged, pairs, show),
        "replacements": _pair_table(pairs, show),
        "by_offset": _offset_table(trajs),
        "contexts": _context_table(contexts, show),
        "by_policy_version": _group_table(trajs, [t.policy_version for t in trajs], "policy_version"),
    }
    if domains is not None and trajs:
        known = [(t, d) for t, d in zip(trajs, domains) if d is not None]
        tables["by_domain"] = _group_table([t for t, _ in known], [d for _, d in known], "domain")
    return {
        "num_trajectories": len(trajs),
        "num_steps": sum(len(t.steps) for t in trajs),
        "num_rejections": sum(rejected.values()),
        "context_tokens": context,
        "notes": notes,
        "tables": tables,
    }


class _Decoder:
    """Token ids as one line of quoted text (whitespace visible, newlines escaped); ids that decode to nothing
    (a partial UTF-8 sequence) as <id>."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, ids: list[int] | tuple[int, ...]) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return json.dumps(text, ensure_ascii=False) if text else "".join(f"<{i}>" for i in ids)

    def token(self, token_id: int | None) -> str:
        return SEQUENCE_ENDED if token_id is None else self([token_id])


def _token_table(rejected: Counter, judged: Counter, pairs: Counter, show: _Decoder) -> list[dict]:
    rows = []
    for tok, n in rejected.items():
        top, top_n = max(((r, c) for (d, r), c in pairs.items() if d == tok), key=lambda rc: rc[1])
        rows.append(
            {
                "token": show.token(tok),
                "token_id": tok,
                "rejections": n,
                "times_judged": judged[tok],
                "rejection_rate": n / judged[tok],
                "top_replacement": show.token(top),
                "replacement_share": top_n / n,
            }
        )
    return sorted(rows, key=lambda r: (-r["rejections"], -r["rejection_rate"], r["token_id"]))


def _pair_table(pairs: Counter, show: _Decoder) -> list[dict]:
    total = sum(pairs.values())
    rows = [
        {"rejected": show.token(d), "replacement": show.token(r), "count": n, "share": n / total}
        for (d, r), n in pairs.items()
    ]
    return sorted(rows, key=lambda r: (-r["count"], r["rejected"], r["replacement"]))


def _offset_table(trajs: list[Trajectory]) -> list[dict]:
    steps = [s for t in trajs for s in t.steps]
    k = max((s.num_drafted for s in steps), default=0)
    total = sum(s.rejected for s in steps)
    rows = []
    for a in range(k):
        reaching = sum(s.num_accepted >= a and s.num_drafted > a for s in steps)
        n = sum(s.rejected and s.num_accepted == a for s in steps)
        rows.append(
            {
                "offset": a,
                "steps_reaching": reaching,
                "rejections": n,
                "rejection_rate": n / reaching if reaching else None,
                "share_of_rejections": n / total if total else None,
            }
        )
    return rows


def _context_table(contexts: dict, show: _Decoder) -> list[dict]:
    total = sum(sum(c.values()) for c in contexts.values())
    rows = []
    for ctx, outcomes in contexts.items():
        (draft, replacement), _ = outcomes.most_common(1)[0]
        n = sum(outcomes.values())
        rows.append(
            {
                "context": show(ctx),
                "rejections": n,
                "share": n / total,
                "top_rejected": show.token(draft),
                "top_replacement": show.token(replacement),
            }
        )
    return sorted(rows, key=lambda r: (-r["rejections"], r["context"]))


def _group_table(trajs: list[Trajectory], keys: list, name: str) -> list[dict]:
    """Acceptance of the steps of each group of trajectories (`keys[i]`: trajectory i's group): tau, acceptance of
    the first draft, rejection rate."""
    groups = defaultdict(list)
    for t, key in zip(trajs, keys):
        groups[key].append(t)
    rows = []
    for value in sorted(groups):
        members = groups[value]
        steps = [s for t in members for s in t.steps]
        k = max((s.num_drafted for s in steps), default=0)
        stats = acceptance_stats(members, k)
        rows.append(
            {
                name: value,
                "trajectories": len(members),
                "steps": len(steps),
                "tau": stats["tau"],
                "first_draft_acceptance": stats["acceptance_per_position"][0] if k else None,
                "step_rejection_rate": sum(s.rejected for s in steps) / len(steps) if steps else None,
            }
        )
    return rows


# -- output -------------------------------------------------------------------------------------------------------


def format_report(report: dict, top: int = 20) -> str:
    """Terminal tables: the ranked ones cut to `top` rows."""
    lines = [
        f"{report['num_rejections']} rejections in {report['num_steps']} verification steps of "
        f"{report['num_trajectories']} trajectories held in the {report.get('buffer', 'replay buffer')}"
    ]
    for name, rows in report["tables"].items():
        shown = rows[:top] if name in RANKED else rows
        more = f" (top {len(shown)} of {len(rows)})" if len(shown) < len(rows) else ""
        lines += ["", f"{name}{more}", *_format_rows(shown)]
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def _format_rows(rows: list[dict]) -> list[str]:
    if not rows:
        return ["  (none)"]
    cells = [[_cell(v) for v in row.values()] for row in rows]
    heads = list(rows[0])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    numeric = [not isinstance(v, str) for v in rows[0].values()]
    fmt = [lambda s, w=w, n=n: s.rjust(w) if n else s.ljust(w) for w, n in zip(widths, numeric)]
    lines = [heads, *cells]
    return [("  " + "  ".join(f(c) for f, c in zip(fmt, line))).rstrip() for line in lines]


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def log_report(report: dict, tracker, folder: str) -> list[str]:
    """Each non-empty table as an MLflow table `<folder>/<name>.json` of the tracker's run, the counts and notes
    as `<folder>/summary.json`; returns the artifact paths."""
    paths = []
    for name, rows in report["tables"].items():
        if rows:
            paths.append(f"{folder}/{name}.json")
            tracker.log_table(rows, paths[-1])
    paths.append(f"{folder}/summary.json")
    tracker.log_dict({k: v for k, v in report.items() if k != "tables"}, paths[-1])
    return paths
