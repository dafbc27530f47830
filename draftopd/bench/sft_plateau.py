"""`draftopd bench sft-plateau`: SFT until held-out acceptance stops improving, tau against learner tokens.

The premise of Draft-OPD is that SFT plateaus: more offline data of the same kind stops lifting acceptance.
This trains a drafter with the recipe's SFT objective (TTT, forward KL to the target, decay**depth) on the
offline pool (target responses at the pool temperature), evaluates held-out tau every `eval_every` steps, and
stops when `patience` evaluations in a row improved on the best by less than `min_delta` (or at `max_steps`).
The drafter at the best evaluation is written out: the start of `draftopd bench opd-vs-sft --drafter`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from draftopd.bench.opd_vs_sft import epoch_batches, held_out
from draftopd.sft.trainer import SFTExample, collate, random_rows, ttt_loss


@dataclass
class PlateauSettings:
    batch_size: int = 16
    lr: float = 1e-3
    depth: int = 7
    decay: float = 0.8
    num_anchors: int = 0
    """Rows scored per sequence, drawn afresh each step (DFlash's random anchors); 0: every row."""
    max_seq_len: int = 320
    eval_every: int = 25
    patience: int = 4
    min_delta: float = 0.02
    max_steps: int = 1500
    num_draft_tokens: int = 4
    max_new_tokens: int = 96
    seed: int = 0


def run_plateau(drafter, target, eos, examples: list[SFTExample], prompts: list, s: PlateauSettings, save) -> dict:
    """Train `drafter` in place; `save(drafter)` is called at every new best. Returns the curve and the plateau."""
    torch.manual_seed(s.seed)
    batches, gen = (
        epoch_batches(len(examples), s.batch_size, random.Random(s.seed)),
        torch.Generator().manual_seed(s.seed),
    )
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=s.lr, betas=(0.9, 0.95))
    curve, tokens, best, since_best, t0 = [], 0, None, 0, time.perf_counter()

    def evaluate(step):
        nonlocal best, since_best
        tau = held_out(drafter, target, eos, prompts, s.num_draft_tokens, s.seed, s.max_new_tokens)["tau"]
        curve.append({"step": step, "learner_tokens": tokens, "tau": tau, "seconds": time.perf_counter() - t0})
        if best is None or tau > best["tau"] + s.min_delta:
            best, since_best = dict(curve[-1]), 0
            save(drafter)
        else:
            since_best += 1
        return tau

    evaluate(0)
    bar = tqdm(range(1, s.max_steps + 1), desc="SFT to the plateau", unit="step")
    for step in bar:
        batch = collate([examples[i] for i in next(batches)], s.max_seq_len)
        tokens += int(batch.valid.sum())
        drafter.train()
        rows = random_rows(batch, s.num_anchors, gen) if s.num_anchors else None
        loss, _ = ttt_loss(drafter, target, batch, s.depth, s.decay, rows=rows, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % s.eval_every == 0:
            tau = evaluate(step)
            bar.set_postfix(tau=f"{tau:.3f}", best=f"{best['tau']:.3f}")
            if since_best >= s.patience:
                break
    bar.close()
    return {
        "curve": curve,
        "best": best,
        "plateaued": since_best >= s.patience,
        "stopped_at_step": curve[-1]["step"],
        "epochs": curve[-1]["step"] * s.batch_size / len(examples),
    }


def plateau_plot(report: dict, out_png, reference: dict[str, float] | None = None) -> None:
    """Held-out tau against learner tokens, the best point marked, reference drafters as horizontal lines."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    xs = [c["learner_tokens"] for c in report["curve"]]
    ax.plot(xs, [c["tau"] for c in report["curve"]], marker="o", markersize=3, label="SFT on the offline pool")
    best = report["best"]
    ax.scatter([best["learner_tokens"]], [best["tau"]], color="black", zorder=3, label=f"best {best['tau']:.3f}")
    for name, tau in (reference or {}).items():
        ax.axhline(tau, linestyle="--", linewidth=1, color="gray")
        ax.annotate(f"{name} {tau:.3f}", (xs[0], tau), fontsize="small", va="bottom")
    ax.set_xlabel("learner tokens")
    ax.set_ylabel("held-out tau (greedy)")
    ax.set_title("SFT plateau: held-out acceptance against learner tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(out_png, format="png")
