"""`draftopd bench families`: drafter families side by side on the same target, prompts and decoding settings.

Families differ in what one verification step costs the drafter, so tau alone
does not rank them: an EAGLE-3 step runs K chained drafter passes, a DFlash
step one, a D²SD step two (the first drafter's block, then the variable-prefix
rows in one batch). Per drafter this reports, over seeds of the held-out draw
(mean and 95% t-interval):

* tau, tokens per verification step (eval/acceptance.py);
* drafter passes per step, *measured*: a forward hook on a module every pass
  runs exactly once (EAGLE-3: the MLP of its one layer; DFlash and D²SD: the
  first decoder layer of each drafter; PARD: its draft LM's first layer); tau
  per pass = tau / passes per step;
* trainable parameters (what the family's shared, frozen embedding and head
  are is said per family, and their size reported apart);
* analytic drafter FLOPs per step (`step_flops`) at the run's tau and mean
  context length;
* tokens/s of speculative decoding vs the target alone, batch size 1, greedy,
  and whether every output equals the target alone's (lossless).

An arm holds one drafter, or one per seed (`NAME=DIR0,DIR1,...`: independently
trained drafters, drafter i evaluated on held-out draw i), so that the interval
covers the training seed as well as the prompts.

Beside each D²SD drafter run two arms made from it: `-first`, its first drafter
alone (a plain DFlash drafter, trained in the same run at the same anchors), and
`-naive`, the same D²SD step with the VP rows re-drafted by the first drafter
(a D2SDDrafter whose VP drafter *is* the first one: anchor and kept drafts
visible, the rest filled by the first drafter): what the trained VP drafter adds
over the first alone and over re-running the first, at the same step structure.
The report pairs them per seed (`pairs`: ratios of tau with 95% t-intervals).

Beside each PARD drafter runs `-ti`, the same weights decoding in the
target-independent mode (no target features); an arm whose name ends in `-ti`
decodes only in that mode (PARD-1, trained without features). Other pairs (an
ablation against its control, say) are named with `--pairs ARM/BASE`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from draftopd.bench.opd_vs_sft import t_interval
from draftopd.engine.speculative import SpeculativeEngine
from draftopd.eval.acceptance import acceptance_stats, speedup_note, timed_generate
from draftopd.messages import SamplingConfig

# Modules that run exactly once per drafter pass while decoding (training paths are not used here).
PASS_MODULES = {
    "eagle3": lambda d: [d.midlayer.mlp],
    "dflash": lambda d: [d.layers[0]],
    "d2sd": lambda d: [d.first.layers[0], d.vp.layers[0]],
    "pard": lambda d: [d.lm.model.layers[0]],
}

# The target's tensors a family reads but does not train, and what the parameter count leaves out.
SHARED = {
    "eagle3": (lambda d: [d.embed.weight], "embedding: the target's, a frozen copy (excluded); head: its own"),
    "dflash": (lambda d: [d.embed_weight, d.head_weight], "embedding and head: the target's, shared (excluded)"),
    "d2sd": (
        lambda d: [d.first.embed_weight, d.first.head_weight],
        "both drafters counted; embedding and head: the target's, shared (excluded)",
    ),
    "pard": (lambda d: [], "embedding and head: its own draft LM's (counted), with the feature projection"),
}


@dataclass
class Arm:
    """One drafter under test: `k` drafts per step (EAGLE-3: the option; block families: block size - 1)."""

    name: str
    drafters: list[torch.nn.Module]
    """One drafter for every seed, or one per seed (in the order of the seeds)."""
    source: str
    k: int

    @property
    def drafter(self) -> torch.nn.Module:
        return self.drafters[0]

    def for_seed(self, i: int) -> torch.nn.Module:
        return self.drafters[i] if len(self.drafters) > 1 else self.drafters[0]


def num_drafts(drafter, k_chain: int) -> int:
    """Drafts per step: the whole block for a family whose step holds a fixed most (DFlash, D²SD: block size - 1),
    `k_chain` for one that drafts any K (EAGLE-3, PARD)."""
    limit = drafter.max_drafts(drafter)
    return k_chain if limit is None else limit


def naive_resample(drafter):
    """The same D²SD step with the first drafter re-run in place of the VP drafter."""
    d2sd = type(drafter)  # the family's class, reached through the drafter: no import of a family's internals
    return d2sd(drafter.first, drafter.first, drafter.num_candidates, drafter.vp_prefix_base).eval()


def d2sd_arms(arm: Arm, naive: bool = True) -> list[Arm]:
    """The arms made from a D²SD arm: its first drafter alone (`-first`) and, with `naive`, `-naive`."""
    out = [Arm(f"{arm.name}-first", [d.first for d in arm.drafters], f"{arm.source} (first drafter alone)", arm.k)]
    if naive:
        drafters = [naive_resample(d) for d in arm.drafters]
        out.append(Arm(f"{arm.name}-naive", drafters, f"{arm.source} (VP rows by the first drafter)", arm.k))
    return out


def target_independent(drafter):
    """The same PARD drafter (shared weights) decoding in the target-independent mode."""
    ti = copy.copy(drafter)  # a shallow copy: the modules and parameters are the same objects
    ti.target_dependent = False
    return ti


def pard_arms(arm: Arm) -> list[Arm]:
    """The arm made from a PARD arm: its target-independent mode (`-ti`); an arm named `*-ti` decodes only so."""
    ti = [target_independent(d) for d in arm.drafters]
    if arm.name.endswith("-ti"):
        arm.drafters[:] = ti
        return []
    return [Arm(f"{arm.name}-ti", ti, f"{arm.source} (target-independent mode)", arm.k)]


def extra_arms(arm: Arm, naive: bool = True) -> list[Arm]:
    """The comparison arms a family adds to each of its arms: D²SD its first drafter alone and naive
    resampling, PARD its target-independent mode; none for the others."""
    make = EXTRA_ARMS.get(arm.drafters[0].kind)
    return make(arm, naive) if make else []


EXTRA_ARMS = {"d2sd": d2sd_arms, "pard": lambda arm, naive: pard_arms(arm)}


def parameter_counts(drafter) -> dict:
    """Trainable parameters, and the shared or frozen tensors of the target the count leaves out."""
    shared, note = SHARED[drafter.kind]
    return {
        "params_trainable": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "params_excluded": sum(t.numel() for t in shared(drafter)),
        "params_note": note,
    }


class PassCounter:
    """Counts drafter forward passes while active (a context manager): one forward hook per pass module."""

    def __init__(self, drafter):
        self.modules = list({id(m): m for m in PASS_MODULES[drafter.kind](drafter)}.values())
        self.count, self.handles = 0, []

    def _hook(self, *_):
        self.count += 1

    def __enter__(self) -> PassCounter:
        self.handles = [m.register_forward_hook(self._hook) for m in self.modules]
        return self

    def __exit__(self, *_):
        for h in self.handles:
            h.remove()


# ---- analytic FLOPs ---------------------------------------------------------------


def layer_macs(width_in: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> int:
    """Multiply-adds per row of a decoder layer's linears: q, k, v from `width_in`, o to `hidden`, SwiGLU MLP."""
    return width_in * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter


def eagle3_flops(cfg, k: int, committed: float, context: float) -> float:
    """FLOPs of one EAGLE-3 step, 2 x multiply-adds of linears and attention (norms, RoPE, softmax left out).

    The step fuses the `committed` rows of the last verification (fc: n_aux * H_t -> H), runs them through the
    layer, then K - 1 chained single rows; every row runs the layer (q/k/v read the 2H-wide input), attends
    over `context` keys (QK and PV: 2 * heads * head_dim each) and goes through the draft-vocabulary head:
    2 * [c * n_aux * H_t * H + (c + K - 1) * (layer(2H) + 2 * heads * head_dim * L + H * V_draft)].
    """
    h, hd, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    fuse = (len(cfg.aux_layer_ids) or 3) * cfg.target_hidden_size * h
    row = layer_macs(2 * h, h, nh, cfg.num_key_value_heads, hd, cfg.intermediate_size)
    row += 2 * nh * hd * context + h * cfg.draft_vocab_size
    return 2 * (committed * fuse + (committed + k - 1) * row)


def dflash_flops(cfg, k: int, committed: float, context: float, blocks: int = 1) -> float:
    """FLOPs of one DFlash step (`blocks` blocks at once: D²SD's VP rows), 2 x multiply-adds.

    The `committed` rows become context keys and values (fc: n_aux * H -> H, then k/v projections in each of
    the n_l layers); each block of B rows runs n_l layers (q/k/v read H), attending over the L context keys
    and its own B; the target's head (H x V) turns K of its rows into drafts:
    2 * [c * (n_aux * H * H + n_l * 2 * kv_heads * head_dim * H)
         + blocks * (n_l * B * (layer(H) + 2 * heads * head_dim * (L + B)) + K * H * V)].
    """
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    nl, bk = cfg.num_hidden_layers, cfg.block_size
    ctx_row = len(cfg.aux_layer_ids) * h * h + nl * 2 * nkv * hd * h
    blk_row = layer_macs(h, h, nh, nkv, hd, cfg.intermediate_size) + 2 * nh * hd * (context + bk)
    return 2 * (committed * ctx_row + blocks * (nl * bk * blk_row + k * h * cfg.vocab_size))


def pard_flops(cfg: dict, k: int, committed: float, context: float, num_features: int) -> float:
    """FLOPs of one PARD step with a KV cache, 2 x multiply-adds: the `committed` rows of the last verification
    (the pending token among them) plus K - 1 mask rows run every layer of the draft LM (`cfg`: its Hugging Face
    config dict), attending over the L context keys; in the target-dependent mode each row also projects its
    `num_features` target features (F -> H); the LM head turns the last K rows into drafts:
    2 * [(c + K - 1) * (n_l * (layer(H) + 2 * heads * head_dim * L) + F * H) + K * H * V].
    (The native proposer recomputes the whole context each step; this counts what a cached drafter runs.)"""
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    row = cfg["num_hidden_layers"] * (layer_macs(h, h, nh, nkv, hd, cfg["intermediate_size"]) + 2 * nh * hd * context)
    return 2 * ((committed + k - 1) * (row + num_features * h) + k * h * cfg["vocab_size"])


def _d2sd_flops(d, k: int, committed: float, context: float) -> float:
    """The first block plus min(num_candidates, K) VP blocks, each drafter with its own context rows."""
    first = dflash_flops(d.first.cfg, k, committed, context)
    return first + dflash_flops(d.vp.cfg, k, committed, context, min(d.num_candidates, k))


# The analytic FLOPs model of one verification step, per family (the formulas above).
STEP_FLOPS = {
    "eagle3": lambda d, k, c, ctx: eagle3_flops(d.cfg, k, c, ctx),
    "dflash": lambda d, k, c, ctx: dflash_flops(d.cfg, k, c, ctx),
    "d2sd": _d2sd_flops,
    "pard": lambda d, k, c, ctx: pard_flops(
        d.lm.config.to_dict(), k, c, ctx, d.target_proj.in_features if d.target_dependent else 0
    ),
}


def step_flops(drafter, k: int, committed: float, context: float) -> float:
    """Analytic drafter FLOPs of one verification step of any family."""
    return STEP_FLOPS[drafter.kind](drafter, k, committed, context)


# ---- the run ----------------------------------------------------------------------


def _warm_up(target, drafter, eos, prompt: list[int], k: int) -> None:
    SpeculativeEngine(target, drafter, eos).generate([prompt], SamplingConfig(8, 0.0, k))


def _one_seed(arm: Arm, drafter, target, eos, prompts, cfg: SamplingConfig, baseline) -> dict:
    with PassCounter(drafter) as counter:
        spec = timed_generate(SpeculativeEngine(target, drafter, eos), prompts, cfg, 1)
    stats = acceptance_stats(spec.trajectories, arm.k)
    steps = [s for t in spec.trajectories for s in t.steps]
    per_step = counter.count / len(steps)
    context = sum(s.position for s in steps) / len(steps)
    same = sum(a.output_ids == b.output_ids for a, b in zip(baseline.trajectories, spec.trajectories))
    return {
        "tau": stats["tau"],
        "num_steps": len(steps),
        "num_emitted": sum(len(s.emitted) for s in steps),
        "drafter_passes": counter.count,
        "passes_per_step": per_step,
        "tau_per_pass": stats["tau"] / per_step,
        "mean_context": context,
        "flops_per_step": step_flops(drafter, arm.k, stats["tau"], context),
        "acceptance_per_position": stats["acceptance_per_position"],
        "tokens_per_s": spec.tokens_per_s,
        "tokens_per_s_target_alone": baseline.tokens_per_s,
        "speedup": spec.tokens_per_s / baseline.tokens_per_s,
        "identical": same,
        "num_prompts": len(prompts),
    }


def _summary(arm: Arm, seeds: dict) -> dict:
    runs = list(seeds.values())

    def mean(key):
        return sum(r[key] for r in runs) / len(runs)

    same, total = sum(r["identical"] for r in runs), sum(r["num_prompts"] for r in runs)
    return {
        "kind": arm.drafter.kind,
        "source": arm.source,
        "num_drafters": len(arm.drafters),
        "num_draft_tokens": arm.k,
        **parameter_counts(arm.drafter),
        "tau": t_interval([r["tau"] for r in runs]),
        "tau_per_pass": t_interval([r["tau_per_pass"] for r in runs]),
        "passes_per_step": mean("passes_per_step"),
        "flops_per_step": mean("flops_per_step"),
        "flops_per_token": mean("flops_per_step") / mean("tau"),
        "tokens_per_s": mean("tokens_per_s"),
        "tokens_per_s_target_alone": mean("tokens_per_s_target_alone"),
        "speedup": t_interval([r["speedup"] for r in runs]),
        "identical_to_target_alone": f"{same}/{total}",
        "lossless": same == total,
        "seeds": seeds,
    }


def paired(report_arms: dict, arm: str, base: str) -> dict:
    """tau of `arm` over `base`, seed by seed: mean ratio and difference with 95% t-intervals."""
    seeds = report_arms[arm]["seeds"]
    ratios = [seeds[k]["tau"] / report_arms[base]["seeds"][k]["tau"] for k in seeds]
    diffs = [seeds[k]["tau"] - report_arms[base]["seeds"][k]["tau"] for k in seeds]
    return {"ratio": t_interval(ratios), "diff": t_interval(diffs), "per_seed_ratio": ratios}


def run_families(target, eos, arms: list[Arm], prompts_by_seed: dict[int, list], max_new_tokens: int, pairs=()) -> dict:
    """Every arm on each seed's held-out prompts after the target alone, batch size 1, greedy; an arm with one
    drafter per seed runs its i-th drafter on the i-th seed's prompts. `pairs`: (arm, base) names to pair
    beside the automatic ones (D²SD over `-first` and `-naive`, PARD over `-ti`)."""
    names = {arm.name for arm in arms}
    for a, b in pairs:
        if a not in names or b not in names:
            raise ValueError(f"pair {a}/{b}: both must be arms ({', '.join(sorted(names))})")
    for arm in arms:
        if len(arm.drafters) not in (1, len(prompts_by_seed)):
            raise ValueError(f"arm {arm.name!r}: {len(arm.drafters)} drafters for {len(prompts_by_seed)} seeds")
    first = next(iter(prompts_by_seed.values()))[0]
    _warm_up(target, None, eos, first, 0)
    for arm in arms:
        _warm_up(target, arm.drafter, eos, first, arm.k)
    per_arm = {arm.name: {} for arm in arms}
    for i, (seed, prompts) in enumerate(prompts_by_seed.items()):
        alone = SamplingConfig(max_new_tokens, 0.0, 0, seed)
        baseline = timed_generate(SpeculativeEngine(target, None, eos), prompts, alone, 1)
        for arm in arms:
            cfg = SamplingConfig(max_new_tokens, 0.0, arm.k, seed)
            per_arm[arm.name][str(seed)] = _one_seed(arm, arm.for_seed(i), target, eos, prompts, cfg, baseline)
    summaries = {arm.name: _summary(arm, per_arm[arm.name]) for arm in arms}
    auto = [
        (arm.name, f"{arm.name}-{base}")
        for arm in arms
        for base in {"d2sd": ("first", "naive"), "pard": ("ti",)}.get(arm.drafter.kind, ())
        if f"{arm.name}-{base}" in summaries
    ]
    pairs = {f"{a}/{b}": paired(summaries, a, b) for a, b in [*auto, *pairs]}
    return {
        "settings": {
            "seeds": list(prompts_by_seed),
            "num_eval_prompts": len(next(iter(prompts_by_seed.values()))),
            "max_new_tokens": max_new_tokens,
            "batch_size": 1,
            "temperature": 0.0,
        },
        "arms": summaries,
        "pairs": pairs,
    }


def table(report: dict) -> str:
    """The terminal table: one row per drafter."""
    head = (
        f"{'drafter':<20} {'kind':<6} {'K':>2} {'params':>9} {'MFLOP/step':>10} {'passes':>6} "
        f"{'tau [95% CI]':>20} {'tau/pass':>8} {'tok/s':>7} {'alone':>7} {'speedup':>7} {'lossless':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, r in report["arms"].items():
        tau, lo, hi = r["tau"]
        lines.append(
            f"{name:<20} {r['kind']:<6} {r['num_draft_tokens']:>2} {r['params_trainable']:>9,} "
            f"{r['flops_per_step'] / 1e6:>10.2f} {r['passes_per_step']:>6.2f} "
            f"{f'{tau:.3f} [{lo:.2f},{hi:.2f}]':>20} {r['tau_per_pass'][0]:>8.3f} {r['tokens_per_s']:>7.1f} "
            f"{r['tokens_per_s_target_alone']:>7.1f} {r['speedup'][0]:>6.2f}x {r['identical_to_target_alone']:>8}"
        )
    notes = {r["kind"]: r["params_note"] for r in report["arms"].values()}
    lines += ["", "params: trainable only; " + "; ".join(f"{kind}: {note}" for kind, note in notes.items())]
    lines += speedup_note()
    if report.get("pairs"):
        lines += ["", "paired tau ratios (mean [95% CI] over seeds; per seed):"]
    for name, p in report.get("pairs", {}).items():
        (r, lo, hi), per_seed = p["ratio"], ", ".join(f"{x:.3f}" for x in p["per_seed_ratio"])
        lines.append(f"  {name:<28} {r:.3f} [{lo:.3f},{hi:.3f}]  ({per_seed})")
    return "\n".join(lines)


def bar_plot(report: dict, out_png) -> None:
    """tau, tau per drafter pass and speedup per drafter, with 95% intervals over seeds, into one PNG."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg and leaves pyplot's state alone

    names = list(report["arms"])
    fig = Figure(figsize=(12, 4), dpi=100, layout="constrained")
    for ax, key, label in zip(
        fig.subplots(1, 3), ("tau", "tau_per_pass", "speedup"), ("tau", "tau per drafter pass", "speedup")
    ):
        vals = [report["arms"][n][key] for n in names]
        err = [[m - lo for m, lo, _ in vals], [hi - m for m, _, hi in vals]]
        ax.bar(range(len(names)), [v[0] for v in vals], yerr=err, capsize=4, color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize="small")
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Drafter families on held-out prompts (batch size 1, greedy)")
    fig.savefig(out_png, format="png")
