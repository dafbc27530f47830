"""`draftopd bench opd-vs-sft`: Draft-OPD against more SFT from the same start, as a paired, seeded experiment.

Every arm starts from the same drafter and runs the same number of optimizer steps, each over the same number
of rows (sequences for SFT, whole replayed trajectories for Draft-OPD, learner.replay_unit=trajectory), through
the same loss code (`opd_loss`: the accepted stream's forward KL on every response row, decay**depth weights,
one normalisation) with the same optimizer, learning rate and clipping. What differs between two arms is what
the arm is about:

* `sft-pool`: more SFT on the recipe's offline pool, target responses sampled at the pool temperature
  (data.response_temperature): the practical baseline, what a user has;
* `sft-rollout-temp`: more SFT on target text at the rollout temperature: isolates what is on-policy beyond
  the data's distribution;
* `opd`: Draft-OPD with the recipe defaults (learner section of the config);
* `opd-control`: the same replay without the rejected stream (rej_coef=0): isolates the rejected drafts;
* `opd-fixed-anchors`: `opd-control`'s loss on rollouts taken once, from the starting drafter, before the first
  step and never refreshed (as many rollouts as the on-policy arms make): separates where the anchors are from
  their on-policy refresh;
* `opd-reference`: the reference's exact mode (two-scalar Bernoulli forward proxy on the accepted stream, k3
  against the recorded full-vocabulary log-probs, full-TTT accepted rows);
* search arms (`--arms`): other rejected-stream forms (`opd-tv`, `opd-margin`, `opd-margin-first`,
  `opd-k3-first`, `opd-tv-first`, `opd-stream-means`), and `opd-cat` / `opd-control-cat`: `opd` /
  `opd-control` with PARD-2's CAT weights on the accepted stream (learner.accepted_cat).

Seeds pair the arms (same held-out prompts, same start); the report gives each arm's held-out tau per seed,
toy set and K, and paired differences and ratios against the baselines with 95% t-intervals over seeds.
In-process and single-rank on purpose: it compares objectives, not the distributed system.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from draftopd.engine.speculative import SpeculativeEngine
from draftopd.eval.acceptance import acceptance_stats
from draftopd.messages import SamplingConfig
from draftopd.opd.buffer import ReplayBuffer
from draftopd.opd.replay import (
    OPDLossConfig,
    build_replay_batch,
    opd_loss,
    opd_loss_config,
    sequence_batch,
    target_to_draft_index,
)
from draftopd.schema import BufferConfig, LearnerConfig

ARMS: dict[str, dict] = {
    "sft-pool": {"data": "pool"},
    "sft-rollout-temp": {"data": "rollout"},
    "opd": {},
    "opd-control": {"rej_coef": 0.0},
    "opd-fixed-anchors": {"rej_coef": 0.0, "fixed": True},
    "opd-reference": {"accepted_divergence": "bernoulli_fkl", "k3_full_vocab_target": True, "rejection_loss": "k3"},
    "opd-tv": {"rejection_loss": "tv"},
    "opd-margin": {"rejection_loss": "margin"},
    "opd-margin-first": {"rejection_loss": "margin", "rejected_offsets": "first"},
    "opd-k3-first": {"rejection_loss": "k3", "rejected_offsets": "first"},
    "opd-tv-first": {"rejection_loss": "tv", "rejected_offsets": "first"},
    "opd-stream-means": {"normalisation": "stream_means"},
    "opd-cat": {"accepted_cat": True},
    "opd-control-cat": {"rej_coef": 0.0, "accepted_cat": True},
}
DEFAULT_ARMS = ("sft-pool", "sft-rollout-temp", "opd", "opd-control", "opd-reference")
BASELINES = ("sft-pool", "sft-rollout-temp", "opd-control")

# Two-sided 95% quantiles of Student's t by degrees of freedom (beyond 30: the normal's).
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
_T95 += [2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


@dataclass
class BenchSettings:
    """Sizes of the comparison; defaults fit about a minute per arm and seed on 2 CPU cores with the toy target."""

    steps: int = 40
    batch_size: int = 8
    lr: float = 3e-4
    depth: int = 4
    num_draft_tokens: int = 4
    eval_ks: tuple[int, ...] = (4, 7)
    eval_every: int = 10
    rollout_prompts: int = 8
    steps_per_round: int = 1
    max_staleness: int = 4
    max_new_tokens: int = 96
    max_seq_len: int = 0
    """Longest replayed sequence; 0: the longest prompt plus max_new_tokens (set by run_bench)."""
    decay: float = 0.8
    pool_temperature: float = 0.5
    rollout_temperature: float = 0.0
    eval_temperature: float = 0.0
    """Held-out tau is measured at this temperature: the one the drafter will be served at."""
    eval_samples: int = 1
    """Sampling seeds held-out tau is averaged over when eval_temperature > 0 (the same seeds for every arm)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    arms: tuple[str, ...] = DEFAULT_ARMS
    learner: dict = field(default_factory=dict)
    """Overrides of the recipe's learner section (LearnerConfig field: value) for every Draft-OPD arm."""


def arm_loss(name: str, s: BenchSettings) -> OPDLossConfig:
    """The loss of arm `name`: the recipe's learner defaults, the bench's overrides, then the arm's own."""
    base = dataclasses.replace(LearnerConfig(), **s.learner)
    own = {k: v for k, v in ARMS[name].items() if k not in ("data", "fixed")}
    return dataclasses.replace(opd_loss_config(base), **own)


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean; a single value gives an interval of zero width."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = (_T95[n - 2] if n - 2 < len(_T95) else 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _optimizer(drafter, lr):
    return torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95))


def _step(opt, drafter, loss) -> float:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    return float(norm)


def epoch_batches(n: int, batch_size: int, rng: random.Random):
    """Endless batches of indices into n examples, reshuffled every epoch; a batch may straddle two epochs."""
    order: list[int] = []
    while True:
        while len(order) < batch_size:  # a new epoch: reshuffled
            fresh = list(range(n))
            rng.shuffle(fresh)
            order += fresh
        picked, order = order[:batch_size], order[batch_size:]
        yield picked


def held_out(
    drafter, target, eos, prompts, k: int, seed: int, max_new_tokens: int, temperature: float = 0.0, samples: int = 1
) -> dict:
    """Acceptance on `prompts` at `temperature`; above 0, tau is the mean over `samples` sampling seeds (seed*1000
    + j, so two drafters measured with the same seed see the same sampling seeds: a paired comparison)."""
    engine = SpeculativeEngine(target, drafter.eval(), eos)
    if temperature <= 0:
        return acceptance_stats(engine.generate(prompts, SamplingConfig(max_new_tokens, 0.0, k, seed)), k)
    runs = [
        acceptance_stats(engine.generate(prompts, SamplingConfig(max_new_tokens, temperature, k, seed * 1000 + j)), k)
        for j in range(max(samples, 1))
    ]
    return {"tau": sum(r["tau"] for r in runs) / len(runs), "tau_per_sample": [r["tau"] for r in runs]}


def _tau(drafter, target, eos, prompts, k: int, seed: int, s: BenchSettings) -> float:
    """Held-out tau at the bench's serving temperature."""
    return held_out(drafter, target, eos, prompts, k, seed, s.max_new_tokens, s.eval_temperature, s.eval_samples)["tau"]


class _Rows:
    """Where an arm's rows come from: shuffled sequences each epoch (SFT), or rollouts into a buffer (OPD)."""

    def __init__(self, name, drafter, target, eos, prompts, texts, s: BenchSettings, seed: int):
        self.name, self.drafter, self.target, self.eos, self.s, self.seed = name, drafter, target, eos, s, seed
        self.prompts, self.texts = prompts, texts
        self.batches = epoch_batches(len(texts), s.batch_size, random.Random(seed))
        self.buffer = ReplayBuffer(BufferConfig(capacity=4096, max_staleness=s.max_staleness, seed=seed))
        self.next_prompt, self.rollout_s, self.rollout_tokens, self.recorded = seed * 7919, 0.0, 0, 0
        self.versions: list[int] = []  # the policy version of every rollout trajectory, in order

    def sft_batch(self) -> list:
        return [self.texts[i] for i in next(self.batches)]

    def rollout(self, version: int, seed_offset: int | None = None) -> None:
        s, n = self.s, len(self.prompts)
        chunk = [self.prompts[(self.next_prompt + i) % n] for i in range(s.rollout_prompts)]
        self.next_prompt += s.rollout_prompts
        t0 = time.perf_counter()
        offset = version if seed_offset is None else seed_offset
        sampling = SamplingConfig(s.max_new_tokens, s.rollout_temperature, s.num_draft_tokens, self.seed + offset)
        trajs = SpeculativeEngine(self.target, self.drafter.eval(), self.eos).generate(chunk, sampling, version)
        self.rollout_s += time.perf_counter() - t0
        self.rollout_tokens += sum(len(t.output_ids) for t in trajs)
        self.versions += [t.policy_version for t in trajs]
        self.recorded += self.buffer.add(trajs)


def train_arm(name: str, drafter, target, eos, prompts, texts, curve_prompts, s: BenchSettings, seed: int) -> dict:
    """`s.steps` optimizer steps of arm `name`; returns its compute, shares and the curve of held-out tau."""
    torch.manual_seed(seed)
    loss_cfg, sft, fixed = arm_loss(name, s), "data" in ARMS[name], ARMS[name].get("fixed", False)
    opt = _optimizer(drafter, s.lr)
    t2d = target_to_draft_index(drafter.draft_to_target_ids(), target.vocab_size)
    rows = _Rows(name, drafter, target, eos, prompts, texts, s, seed)
    totals = {"rows": 0, "tokens": 0, "accepted_tokens": 0, "rejected_tokens": 0, "replayed_steps": 0}
    shares, curve = [], []

    def point():
        tau = _tau(drafter, target, eos, curve_prompts, s.num_draft_tokens, seed, s)
        curve.append({"step": len(shares), "learner_tokens": totals["tokens"], "tau": tau})

    point()
    if fixed:  # every rollout the on-policy arms make, all from the starting drafter, as policy version 0
        rows.buffer = ReplayBuffer(BufferConfig(capacity=1 << 20, max_staleness=1 << 30, seed=seed))
        for k in range(0, s.steps, s.steps_per_round):
            rows.rollout(0, seed_offset=k)
    for step in tqdm(range(s.steps), desc=f"seed {seed} {name}", unit="step", leave=False):
        if sft:
            batch = sequence_batch(rows.sft_batch(), s.depth, s.decay, s.max_seq_len)
        else:
            if step % s.steps_per_round == 0 and not fixed:
                rows.rollout(step)
            states = rows.buffer.sample_trajectories(s.batch_size, 0 if fixed else step)
            batch = build_replay_batch(
                states,
                t2d,
                s.depth,
                s.decay,
                s.max_seq_len,
                accepted_rows=loss_cfg.accepted_rows,
                unit="trajectory",
                rejected_offsets=loss_cfg.rejected_offsets,
            )
        drafter.train()
        loss, m = opd_loss(drafter, target, batch, loss_cfg)
        _step(opt, drafter, loss)
        totals["rows"] += m["num_rows"]
        totals["tokens"] += m["num_tokens"]
        totals["accepted_tokens"] += m["num_accepted_tokens"]
        totals["rejected_tokens"] += m["num_rejected_tokens"]
        totals["replayed_steps"] += m["num_replayed_steps"]
        shares.append(m["share_rejected"])
        if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
            point()
    out = {
        "optimizer_steps": s.steps,
        **{f"learner_{k}": v for k, v in totals.items()},
        "share_rejected_mean": sum(shares) / len(shares),
        "loss": dataclasses.asdict(loss_cfg),
        "curve": curve,
    }
    if not sft:
        stats = rows.buffer.stats(s.steps)
        out["rollout"] = {
            "seconds": rows.rollout_s,
            "tokens": rows.rollout_tokens,
            "tokens_per_s": rows.rollout_tokens / max(rows.rollout_s, 1e-9),
            "error_states_recorded": rows.recorded,
            "error_states_sampled": stats["num_sampled"],
            "trajectories": len(rows.versions),
            "policy_versions": sorted(set(rows.versions)),
        }
    return out


@torch.no_grad()
def rejection_points(target, drafter, eos, prompts, k: int, max_new_tokens: int, seed: int) -> dict:
    """Where greedy verification rejects: the target's entropy and top-1 probability at the first rejected draft
    of each step against every response position, and the share of response tokens that are rejection points.
    Greedy rollouts follow the target's own text, so these positions are all that is on-policy in them."""
    trajs = SpeculativeEngine(target, drafter.eval(), eos).generate(
        prompts, SamplingConfig(max_new_tokens, 0.0, k, seed)
    )
    at_rej, everywhere = [], []
    for t in trajs:
        ids = torch.tensor([t.full_ids])
        logp = torch.log_softmax(target.forward(ids, torch.arange(ids.shape[1])[None], want_aux=False).logits[0], -1)
        ent = -(logp.exp() * logp).sum(-1)
        top = logp.max(-1).values.exp()
        p = len(t.prompt_ids)
        everywhere += [(float(ent[j - 1]), float(top[j - 1])) for j in range(p, len(t.full_ids))]
        for step in t.steps:
            j = step.position + step.num_accepted  # the first rejected draft's position
            if step.rejected and j < len(t.full_ids):
                at_rej.append((float(ent[j - 1]), float(top[j - 1])))

    def mean(xs, i):
        return sum(x[i] for x in xs) / max(len(xs), 1)

    return {
        "rejection_points": len(at_rej),
        "response_tokens": len(everywhere),
        "share_of_response_tokens": len(at_rej) / max(len(everywhere), 1),
        "target_entropy_at_rejections": mean(at_rej, 0),
        "target_entropy_everywhere": mean(everywhere, 0),
        "target_top1_prob_at_rejections": mean(at_rej, 1),
        "target_top1_prob_everywhere": mean(everywhere, 1),
    }


def _paired(per_seed: dict[str, dict[int, float]], arm: str, base: str) -> dict:
    seeds = sorted(set(per_seed[arm]) & set(per_seed[base]))
    diffs = [per_seed[arm][k] - per_seed[base][k] for k in seeds]
    ratios = [per_seed[arm][k] / per_seed[base][k] for k in seeds]
    d, dl, dh = t_interval(diffs)
    r, rl, rh = t_interval(ratios)
    return {"diff": d, "diff_ci95": [dl, dh], "ratio": r, "ratio_ci95": [rl, rh], "per_seed_ratio": ratios}


def run_bench(target, eos, load_start, train_prompts, eval_sets: dict[str, list], s: BenchSettings) -> dict:
    """`load_start()` returns a fresh copy of the starting drafter each time; `eval_sets` maps a held-out set's
    name to its prompts, the first is the headline (and the curves' set)."""
    for name in s.arms:
        if name not in ARMS:
            raise ValueError(f"unknown bench arm {name!r}; known: {', '.join(ARMS)}")
    head = next(iter(eval_sets))
    if not s.max_seq_len:
        longest = max(len(p) for p in train_prompts)
        s = dataclasses.replace(s, max_seq_len=longest + s.max_new_tokens)
    engine = SpeculativeEngine(target, None, eos)
    results: dict[str, dict] = {name: {"seeds": {}} for name in s.arms}
    start, where = {}, {}
    for seed in s.seeds:
        texts = {}
        for data, temp in (("pool", s.pool_temperature), ("rollout", s.rollout_temperature)):
            trajs = engine.generate(train_prompts, SamplingConfig(s.max_new_tokens, temp, 0, seed))
            texts[data] = [(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs]
        first = load_start()
        where[seed] = rejection_points(target, first, eos, train_prompts, s.num_draft_tokens, s.max_new_tokens, seed)
        start[seed] = {
            f"{n}/k{k}": _tau(first, target, eos, p, k, seed, s) for n, p in eval_sets.items() for k in s.eval_ks
        }
        for name in s.arms:
            drafter = load_start()
            data = ARMS[name].get("data", "rollout")
            info = train_arm(name, drafter, target, eos, train_prompts, texts[data], eval_sets[head], s, seed)
            info["tau"] = {
                f"{n}/k{k}": _tau(drafter, target, eos, p, k, seed, s) for n, p in eval_sets.items() for k in s.eval_ks
            }
            results[name]["seeds"][seed] = info
            tqdm.write(f"seed {seed} {name}: held-out tau {info['tau'][f'{head}/k{s.num_draft_tokens}']:.3f}")
    keys = list(start[s.seeds[0]])
    for name, r in results.items():
        r["tau"] = {key: t_interval([r["seeds"][k]["tau"][key] for k in s.seeds]) for key in keys}
        r["tau_over_ceiling"] = {key: r["tau"][key][0] / (int(key.rsplit("/k", 1)[1]) + 1) for key in keys}
        r["vs"] = {}
        for base in BASELINES:
            if base in results and base != name:
                per_seed = {a: {k: results[a]["seeds"][k]["tau"] for k in s.seeds} for a in (name, base)}
                r["vs"][base] = {
                    key: _paired({a: {k: v[key] for k, v in per_seed[a].items()} for a in per_seed}, name, base)
                    for key in keys
                }
    return {
        "settings": dataclasses.asdict(s),
        "headline": f"{head}/k{s.num_draft_tokens}",
        "eval_sets": {n: len(p) for n, p in eval_sets.items()},
        "start": {key: t_interval([start[k][key] for k in s.seeds]) for key in keys},
        "rejection_points": where,
        "arms": results,
    }


def table(report: dict) -> str:
    """The terminal table: per arm, held-out tau (mean and 95% interval over seeds) per set and K, and the
    headline's paired ratios against the baselines."""
    head = report["headline"]
    keys = list(report["start"])
    lines = [f"{'arm':<18} " + " ".join(f"{k:>22}" for k in keys)]
    lines.append(f"{'start':<18} " + " ".join(f"{report['start'][k][0]:>22.3f}" for k in keys))
    for name, r in report["arms"].items():
        cells = [f"{m:.3f} [{lo:.3f},{hi:.3f}]" for m, lo, hi in (r["tau"][k] for k in keys)]
        lines.append(f"{name:<18} " + " ".join(f"{c:>22}" for c in cells))
    lines.append("")
    lines.append(f"paired ratios on {head} (mean [95% CI] over seeds; per seed):")
    for name, r in report["arms"].items():
        for base, by_key in r["vs"].items():
            p = by_key[head]
            seeds = ", ".join(f"{x:.3f}" for x in p["per_seed_ratio"])
            lines.append(
                f"  {name:<18} / {base:<17} {p['ratio']:.3f} [{p['ratio_ci95'][0]:.3f},{p['ratio_ci95'][1]:.3f}]"
                f"  diff {p['diff']:+.3f} [{p['diff_ci95'][0]:+.3f},{p['diff_ci95'][1]:+.3f}]  ({seeds})"
            )
    lines.append("")
    head_cols = f"{'arm':<18} {'steps':>6} {'rows':>6} {'tokens':>8} {'rej. tokens':>11} {'rej. share':>10}"
    lines.append(head_cols + f" {'rollout tok':>11} {'rollout s':>9}")
    for name, r in report["arms"].items():
        one = next(iter(r["seeds"].values()))
        n = len(r["seeds"])
        toks = sum(v["learner_tokens"] for v in r["seeds"].values()) / n
        rej = sum(v["learner_rejected_tokens"] for v in r["seeds"].values()) / n
        share = sum(v["share_rejected_mean"] for v in r["seeds"].values()) / n
        rollouts = [v["rollout"] for v in r["seeds"].values() if "rollout" in v]
        cost = "{:>11} {:>9}".format("-", "-")
        if rollouts:
            cost = f"{sum(x['tokens'] for x in rollouts) / n:>11.0f} {sum(x['seconds'] for x in rollouts) / n:>9.1f}"
        lines.append(
            f"{name:<18} {one['optimizer_steps']:>6} {one['learner_rows']:>6} {toks:>8.0f} {rej:>11.0f} {share:>10.4f}"
            f" {cost}"
        )
    lines.append("(means over seeds; rollout: tokens decoded with the drafter and their seconds, not learner compute)")
    return "\n".join(lines)


def curve_plot(report: dict, out_png) -> None:
    """Held-out tau (headline set, K of the rollouts) against learner tokens per arm: mean over seeds with the
    95% t-interval as a band."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    for name, r in report["arms"].items():
        curves = [v["curve"] for v in r["seeds"].values()]
        n = min(len(c) for c in curves)
        xs = [sum(c[i]["learner_tokens"] for c in curves) / len(curves) for i in range(n)]
        stats = [t_interval([c[i]["tau"] for c in curves]) for i in range(n)]
        line = ax.plot(xs, [m for m, _, _ in stats], marker="o", markersize=3, label=name)[0]
        ax.fill_between(xs, [lo for _, lo, _ in stats], [hi for _, _, hi in stats], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("learner tokens")
    ax.set_ylabel(f"held-out tau ({report['headline']}, greedy)")
    ax.set_title(f"Draft-OPD vs more SFT, {len(report['settings']['seeds'])} seeds (bands: 95% t-interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(out_png, format="png")
