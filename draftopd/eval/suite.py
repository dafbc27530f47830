"""`draftopd eval` over named sets: acceptance, speed, robustness variants, JSON, table and plots.

Each conversation is decoded turn by turn: the target alone once (the baseline
for speed, and at temperature 0 the reference the drafter must reproduce), then
with the drafter for each K. Later turns of a multi-turn set (MT-Bench) append
the target-alone answer, so every K and every drafter sees the same prompts.

Robustness variants, after the attention-drift paper: the same prompts under
altered system prompts and with thinking toggled (template perturbation), and
padded with long preceding context; each is reported as tau relative to the
clean set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftopd.eval.acceptance import acceptance_stats, speedup_note, timed_generate
from draftopd.messages import SamplingConfig

SYSTEM_SHORT = "You are a helpful assistant."
SYSTEM_LONG = (
    "You are a meticulous assistant. Read the whole request before answering. Think about edge cases, state "
    "any assumptions you make, keep the answer focused on what was asked, prefer short sentences, and check "
    "arithmetic and code carefully before you reply. If the request is ambiguous, pick the most likely reading."
)
VARIANTS = ("clean", "system_short", "system_long", "thinking_toggled", "long_context")


@dataclass
class SuiteSettings:
    num_draft_tokens: list[int] = field(default_factory=lambda: [4])
    temperature: float = 0.0
    max_new_tokens: int = 128
    batch_size: int = 1
    seed: int = 0
    enable_thinking: bool = True
    variants: tuple[str, ...] = ("clean",)
    long_context_tokens: int = 384


def padding_text(tokenizer, num_tokens: int) -> str:
    """About `num_tokens` tokens of unrelated material (toy-corpus code) to put before a request."""
    from draftopd.toy.corpus import code_samples

    pieces, total = [], 0
    for sample in code_samples():
        text = sample.messages[-1]["content"].split("```python\n", 1)[-1].rsplit("```", 1)[0]
        pieces.append(text)
        total += len(tokenizer.encode(text))
        if total >= num_tokens:
            break
    ids = tokenizer.encode("\n\n".join(pieces))[:num_tokens]
    return tokenizer.decode(ids)


def first_turn(variant: str, messages: list[dict], padding: str) -> list[dict]:
    """The first turn's messages under a variant (thinking_toggled changes the template flag instead)."""
    msgs = [dict(m) for m in messages]
    if variant in ("system_short", "system_long"):
        text = SYSTEM_SHORT if variant == "system_short" else SYSTEM_LONG
        msgs = [{"role": "system", "content": text}] + [m for m in msgs if m["role"] != "system"]
    if variant == "long_context":
        msgs[-1]["content"] = f"Background material:\n\n{padding}\n\nNow the request.\n\n{msgs[-1]['content']}"
    return msgs


def run_variant(engines, tokenizer, conversations, variant: str, s: SuiteSettings, progress=None):
    """One set under one variant: a report per K (acceptance over all turns, speed over all turns)."""
    from draftopd.data.prompts import encode_chats

    think = s.enable_thinking != (variant == "thinking_toggled")
    padding = padding_text(tokenizer, s.long_context_tokens) if variant == "long_context" else ""
    chats = [first_turn(variant, turns[0], padding) for turns in conversations]
    base_tokens = base_seconds = 0.0
    per_k = {k: {"trajs": [], "seconds": 0.0, "same": 0} for k in s.num_draft_tokens}
    for turn in range(max(len(c) for c in conversations)):
        live = [i for i, c in enumerate(conversations) if len(c) > turn]
        prompts = encode_chats(tokenizer, [chats[i] for i in live], enable_thinking=think)
        sampling = SamplingConfig(s.max_new_tokens, s.temperature, 0, s.seed + turn)
        base = timed_generate(engines.get(0), prompts, sampling, s.batch_size, progress)
        base_tokens, base_seconds = base_tokens + base.num_tokens, base_seconds + base.seconds
        for k, acc in per_k.items():
            sampling = SamplingConfig(s.max_new_tokens, s.temperature, k, s.seed + turn)
            spec = timed_generate(engines.get(k), prompts, sampling, s.batch_size, progress)
            acc["trajs"] += spec.trajectories
            acc["seconds"] += spec.seconds
            acc["same"] += sum(a.output_ids == b.output_ids for a, b in zip(base.trajectories, spec.trajectories))
        for i, t in zip(live, base.trajectories):
            reply = tokenizer.decode(t.output_ids, skip_special_tokens=True)
            chats[i] = chats[i] + [{"role": "assistant", "content": reply}]
            if len(conversations[i]) > turn + 1:
                chats[i] += conversations[i][turn + 1]
    reports = []
    for k, acc in per_k.items():
        r = acceptance_stats(acc["trajs"], k)
        spec_tps = sum(len(t.output_ids) for t in acc["trajs"]) / acc["seconds"]
        base_tps = base_tokens / base_seconds
        r.update(
            variant=variant,
            num_draft_tokens=k,
            temperature=s.temperature,
            batch_size=s.batch_size,
            num_prompts=len(conversations),
            num_turns=len(acc["trajs"]),
            tau_over_ceiling=r["tau"] / (k + 1),
            tokens_per_s_target_alone=base_tps,
            tokens_per_s_speculative=spec_tps,
            speedup=spec_tps / base_tps,
        )
        if s.temperature <= 0:
            r["identical_to_target_alone"] = f"{acc['same']}/{len(acc['trajs'])}"
        reports.append(r)
    return reports


def run_suite(engines, tokenizer, sets: list, s: SuiteSettings, progress=None) -> list[dict]:
    """Every set under every variant (engines: an `EngineSet`); robustness variants carry `tau_vs_clean`."""
    reports = []
    for evalset in sets:
        clean = {}
        for variant in s.variants:
            for r in run_variant(engines, tokenizer, evalset.conversations, variant, s, progress):
                r.update(set=evalset.name, source=evalset.source, num_malformed_rows=evalset.num_malformed)
                if variant == "clean":
                    clean[r["num_draft_tokens"]] = r["tau"]
                elif r["num_draft_tokens"] in clean:
                    r["tau_vs_clean"] = r["tau"] / clean[r["num_draft_tokens"]]
                reports.append(r)
    return reports


def num_generations(sets: list, s: SuiteSettings) -> int:
    """Sequences decoded by `run_suite`, for a progress bar."""
    turns = sum(len(c) for e in sets for c in e.conversations)
    return turns * len(s.variants) * (1 + len(s.num_draft_tokens))


def format_suite_table(reports: list[dict]) -> str:
    head = (
        f"{'set':<15} {'variant':<16} {'K':>2} {'temp':>4} {'tau':>6} {'tau/(K+1)':>9} {'vs clean':>8} "
        f"{'tok/s spec':>10} {'tok/s base':>10} {'speedup':>7}  accept@pos"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        pos = " ".join(f"{a:.2f}" for a in r.get("acceptance_per_position", []))
        rel = f"{r['tau_vs_clean']:.3f}" if "tau_vs_clean" in r else "-"
        lines.append(
            f"{r['set']:<15} {r['variant']:<16} {r['num_draft_tokens']:>2} {r['temperature']:>4.1f} {r['tau']:>6.3f} "
            f"{r['tau_over_ceiling']:>9.3f} {rel:>8} {r['tokens_per_s_speculative']:>10.1f} "
            f"{r['tokens_per_s_target_alone']:>10.1f} {r['speedup']:>6.2f}x  {pos}"
        )
    return "\n".join(lines + speedup_note())


def plot_suite(reports: list[dict], out_dir) -> list:
    """PNG plots: per-position acceptance per set, acceptance-length histograms, robustness (if any)."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clean = [r for r in reports if r["variant"] == "clean"]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in clean:
        acc = r["acceptance_per_position"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['set']} K={r['num_draft_tokens']}")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="Per-position acceptance")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(out / "acceptance_per_position.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(1, len(clean), figsize=(3.2 * len(clean), 3.2), squeeze=False)
    for ax, r in zip(axes[0], clean):
        hist = r["accepted_histogram"]
        total = sum(hist) or 1
        ax.bar([a + 1 for a in range(len(hist))], [h / total for h in hist])
        ax.set(title=f"{r['set']} K={r['num_draft_tokens']}\ntau={r['tau']:.2f}", xlabel="tokens per step")
    axes[0][0].set_ylabel("fraction of steps")
    paths.append(out / "acceptance_length_histogram.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    robust = [r for r in reports if "tau_vs_clean" in r]
    if robust:
        names = sorted({(r["set"], r["num_draft_tokens"]) for r in robust})
        variants = [v for v in VARIANTS if any(r["variant"] == v for r in robust)]
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names) * len(variants) / 2), 4))
        width = 0.8 / len(variants)
        for j, v in enumerate(variants):
            ys = [
                next(
                    (r["tau_vs_clean"] for r in robust if (r["set"], r["num_draft_tokens"]) == n and r["variant"] == v),
                    float("nan"),
                )
                for n in names
            ]
            ax.bar([i + j * width for i in range(len(names))], ys, width, label=v)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], [f"{s} K={k}" for s, k in names])
        ax.set(ylabel="tau / tau on the clean set", title="Robustness to template and context changes")
        ax.legend(fontsize=8)
        paths.append(out / "robustness.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths


def log_to_mlflow(reports: list[dict], files: list, run_dir, run_id: str | None = None, run_name: str = "eval") -> str:
    """Eval results as one MLflow run (a new one, or appended to a training run): metrics and plots."""
    from draftopd.tracking import Tracker

    tracker = Tracker(run_dir, "draftopd", run_name)
    rid = tracker.start(run_id)
    for r in reports:
        key = f"eval/{r['set']}/{r['variant']}/K{r['num_draft_tokens']}"
        scalars = ("tau", "tau_over_ceiling", "tau_vs_clean", "speedup", "tokens_per_s_speculative")
        tracker.log_metrics({f"{key}/{m}": r[m] for m in scalars if m in r}, step=0)
        for pos, rate in enumerate(r.get("acceptance_per_position", []), 1):  # a curve: step = draft position
            tracker.log_metrics({f"{key}/acceptance": rate}, step=pos)
    for f in files:
        tracker.log_artifact(f, "eval")
    tracker.end("FINISHED")
    return rid
