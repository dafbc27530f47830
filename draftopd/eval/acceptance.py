"""Acceptance metrics from verification records, and timed runs with and without the drafter.

tau (acceptance length) = tokens emitted per verification step, bonus included,
i.e. the mean of (accepted + 1) except where the sequence ended inside a step
(end-of-sequence or the token budget); its ceiling is K + 1. The per-position rate at
position i is the fraction of steps whose draft i was accepted; the conditional
rate divides by the steps that reached draft i (all drafts before it accepted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from draftopd.engine.speculative import SpeculativeEngine
from draftopd.messages import SamplingConfig, Trajectory


def acceptance_stats(trajs: list[Trajectory], k: int) -> dict:
    """tau, per-position rates and the histogram of accepted counts over all steps."""
    counts = [s.num_accepted for t in trajs for s in t.steps]
    emitted = sum(len(s.emitted) for t in trajs for s in t.steps)  # a step cut by EOS or the budget emits less
    n = len(counts)
    if n == 0:
        return {"tau": float("nan"), "num_steps": 0}
    hist = [counts.count(a) for a in range(k + 1)]
    reached = [sum(c >= i for c in counts) for i in range(k)]
    passed = [sum(c > i for c in counts) for i in range(k)]
    return {
        "tau": emitted / n,
        "tau_ceiling": k + 1,
        "num_steps": n,
        "acceptance_per_position": [p / n for p in passed],
        "conditional_acceptance_per_position": [p / r if r else float("nan") for p, r in zip(passed, reached)],
        "accepted_histogram": hist,
    }


@dataclass
class TimedRun:
    trajectories: list[Trajectory]
    seconds: float

    @property
    def num_tokens(self) -> int:
        return sum(len(t.output_ids) for t in self.trajectories)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else float("nan")


def timed_generate(
    engine: SpeculativeEngine, prompts: list[list[int]], cfg: SamplingConfig, batch_size: int, progress=None
) -> TimedRun:
    """Generate in batches and time the whole of it (the first batch warms up caches too)."""
    trajs: list[Trajectory] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = engine.generate(prompts[i : i + batch_size], cfg)
        for j, t in enumerate(chunk):
            t.prompt_index = i + j
        trajs.extend(chunk)
        if progress is not None:
            progress.update(len(chunk))
    return TimedRun(trajs, time.perf_counter() - start)


def evaluate(
    target,
    drafter,
    eos: list[int],
    prompts: list[list[int]],
    k: int,
    temperature: float,
    max_new_tokens: int,
    batch_size: int = 1,
    seed: int = 0,
    baseline: TimedRun | None = None,
    progress=None,
) -> tuple[dict, TimedRun]:
    """Acceptance and speed of `drafter` on `prompts`; returns the report and the target-alone run (reusable)."""
    cfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, num_draft_tokens=k, seed=seed)
    if baseline is None:
        baseline = timed_generate(SpeculativeEngine(target, None, eos), prompts, cfg, batch_size, progress)
    spec = timed_generate(SpeculativeEngine(target, drafter, eos), prompts, cfg, batch_size, progress)
    report = acceptance_stats(spec.trajectories, k)
    report.update(
        num_draft_tokens=k,
        temperature=temperature,
        batch_size=batch_size,
        num_prompts=len(prompts),
        tokens_per_s_target_alone=baseline.tokens_per_s,
        tokens_per_s_speculative=spec.tokens_per_s,
        speedup=spec.tokens_per_s / baseline.tokens_per_s,
    )
    if temperature <= 0:
        same = sum(a.output_ids == b.output_ids for a, b in zip(baseline.trajectories, spec.trajectories))
        report["identical_to_target_alone"] = f"{same}/{len(prompts)}"
    return report, baseline


def format_table(reports: list[dict]) -> str:
    """A plain-text table, one row per (K, temperature), with what its speedup means on this machine under it."""
    head = (
        f"{'K':>3} {'temp':>5} {'tau':>6} {'ceil':>5} {'tau/(K+1)':>9} {'tok/s spec':>10} {'tok/s base':>10} "
        f"{'speedup':>7}  accept@pos"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        pos = " ".join(f"{a:.2f}" for a in r.get("acceptance_per_position", []))
        lines.append(
            f"{r['num_draft_tokens']:>3} {r['temperature']:>5.2f} {r['tau']:>6.3f} {r['tau_ceiling']:>5} "
            f"{r['tau'] / r['tau_ceiling']:>9.3f} {r['tokens_per_s_speculative']:>10.1f} "
            f"{r['tokens_per_s_target_alone']:>10.1f} {r['speedup']:>6.2f}x  {pos}"
        )
    return "\n".join(lines + speedup_note())


def speedup_note() -> list[str]:
    """The line printed under a table with a speedup column when the run had no GPU (empty on one): what a
    wall-clock speedup measured on CPU says, and which figure carries."""
    import torch

    if torch.cuda.is_available():
        return []
    return [
        "speedup: wall-clock tokens/s over the target alone on this machine's CPU, where a small target's pass is "
        "mostly per-call overhead and verifying K + 1 tokens costs more than one; below 1x here says nothing of a GPU. "
        "tau and tau/(K+1), the acceptance the drafter earns, are what carry to a large target (docs/toy.md)."
    ]
