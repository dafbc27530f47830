"""Training-curve plots: acceptance length and per-position acceptance against policy version."""

from __future__ import annotations

from pathlib import Path


def acceptance_curve_plot(history: list[dict], out_png: Path, sft_end_version: int | None = None) -> Path:
    """Draw tau and per-position acceptance against policy version into a 1200x450 PNG; return its path.

    `history` items: `{"policy_version": 3, "tau": 2.7, "tau_ceiling": 5,
    "acceptance_per_position": [0.8, 0.6, ...], "eval/<set>/tau": 2.5, ...}`; any key may be missing.
    """
    from matplotlib.figure import Figure  # a bare Figure renders with Agg and leaves pyplot's state alone

    rows = sorted(history, key=lambda h: h["policy_version"])
    fig = Figure(figsize=(12, 4.5), dpi=100, layout="constrained")
    ax_tau, ax_pos = fig.subplots(1, 2)
    _plot_tau(ax_tau, rows)
    _plot_positions(ax_pos, rows)
    for ax in (ax_tau, ax_pos):
        if sft_end_version is not None:
            start = min([h["policy_version"] for h in rows] + [sft_end_version])
            ax.axvspan(start, sft_end_version, color="tab:gray", alpha=0.15, label="SFT")
            ax.axvline(sft_end_version, color="tab:gray", linestyle=":", linewidth=1)
        ax.set_xlabel("policy version")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
    fig.suptitle("Drafter acceptance during training")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(h["policy_version"], h[key]) for h in rows if h.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _plot_tau(ax, rows: list[dict]) -> None:
    ax.plot(*_series(rows, "tau"), marker="o", markersize=3, label="tau (rollout)")
    xs, ys = _series(rows, "tau_ceiling")
    if xs:
        ax.plot(xs, ys, linestyle="--", color="black", linewidth=1, label="ceiling (K + 1)")
    eval_keys = sorted({k for h in rows for k in h if k.startswith("eval/") and k.endswith("/tau")})
    for key in eval_keys:
        ax.plot(*_series(rows, key), marker="s", markersize=3, label="eval " + key[len("eval/") : -len("/tau")])
    ax.set_ylabel("acceptance length tau (tokens per verification)")
    ax.set_title("Acceptance length")


def _plot_positions(ax, rows: list[dict]) -> None:
    num_positions = max((len(h.get("acceptance_per_position") or []) for h in rows), default=0)
    for i in range(num_positions):
        pts = [
            (h["policy_version"], h["acceptance_per_position"][i])
            for h in rows
            if len(h.get("acceptance_per_position") or []) > i
        ]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=f"position {i + 1}")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("acceptance rate")
    ax.set_title("Acceptance per draft position")
