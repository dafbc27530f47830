"""`draftopd diagnose`: attention drift of a drafter along its draft chain.

The attention-drift argument: as a pre-norm EAGLE-3 drafter chains drafts, it
puts more and more attention on its own drafted states (and less on the
target's context), while the un-normalised state it feeds forward grows. We
measure both per chain depth on the target's own responses to held-out
prompts, with the training-time-test pass (which computes exactly what chained
inference computes) on teacher-forced tokens, i.e. on chains whose earlier
drafts were accepted, the chains that matter for acceptance.
"""

from __future__ import annotations

import torch

from draftopd.sft.trainer import SFTExample, collate


class DiagnoseError(ValueError):
    """A drafter this diagnosis does not apply to (the command line prints it as one line)."""


def check_diagnosable(name: str, drafter) -> None:
    """Drift is read off the attention of a chain that feeds its own states forward: EAGLE-3's alone."""
    if drafter.kind != "eagle3":
        raise DiagnoseError(
            f"drafter {name} is a '{drafter.kind}' drafter; attention drift is measured along EAGLE-3 chains only "
            "(families diagnose supports: eagle3)"
        )


def drift_profile(target, drafter, examples: list[SFTExample], depth: int, max_len: int = 512) -> dict:
    """Per depth: mean attention mass on own drafts, on the target's context, and the fed-forward state norm."""
    check_diagnosable(drafter.kind, drafter)
    batch = collate(examples, max_len)
    n = batch.input_ids.shape[1]
    with torch.no_grad():
        out = target.forward(batch.input_ids, torch.arange(n).expand_as(batch.input_ids))
        trace: list[dict] = []
        drafter.ttt_forward(batch.input_ids, drafter.features(out), batch.valid, depth, trace=trace)
    rows = batch.loss_pos[:, : n - 1]  # rows that start a chain inside a response
    own, norm = [], []
    for d, t in enumerate(trace):
        live = rows[:, : n - 1 - d]  # a chain of depth d needs d more tokens after the row
        own.append(t["own_mass"][:, : n - 1 - d][live].float().mean().item())
        norm.append(t["state_norm"][:, : n - 1 - d][live].float().mean().item())
    fused = drafter.fuse(drafter.features(out)[:, : n - 1])[rows].norm(dim=-1).mean().item()
    return {
        "depth": list(range(1, len(own) + 1)),
        "attention_on_own_drafts": own,
        "attention_on_context": [1 - x for x in own],
        "state_norm": norm,
        "fused_input_norm": fused,
        "num_chains": int(rows.sum()),
        "norm_output": drafter.cfg.norm_output,
        "fc_norm": drafter.cfg.fc_norm,
    }


def format_profiles(profiles: dict[str, dict]) -> str:
    lines = [f"{'drafter':<28} {'depth':>5} {'attn on own drafts':>18} {'attn on context':>15} {'state norm':>10}"]
    lines.append("-" * len(lines[0]))
    for name, p in profiles.items():
        for d, own, ctx, nrm in zip(
            p["depth"], p["attention_on_own_drafts"], p["attention_on_context"], p["state_norm"]
        ):
            lines.append(f"{name:<28} {d:>5} {own:>18.3f} {ctx:>15.3f} {nrm:>10.2f}")
    return "\n".join(lines)


def plot_profiles(profiles: dict[str, dict], out_png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, p in profiles.items():
        label = f"{name} (norm_output={p['norm_output']}, fc_norm={p['fc_norm']})"
        a.plot(p["depth"], p["attention_on_own_drafts"], marker="o", label=label)
        b.plot(p["depth"], p["state_norm"], marker="o", label=label)
    a.set(xlabel="chain depth", ylabel="attention mass on own drafts", title="Attention drift", ylim=(0, 1))
    b.set(xlabel="chain depth", ylabel="norm of the state fed forward", title="State norm")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    fig.savefig(out_png, dpi=120, bbox_inches="tight")
    plt.close(fig)
