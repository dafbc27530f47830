"""The Draft-OPD phase synchronous (opd.max_policy_lag 0) against overlapped (1), in one run of this script.

    python scripts/overlap_time.py recipes/toy-opd.yaml --seeds 0 1 2 --out runs/overlap [OVERRIDE ...]

Per seed, both arms run `draftopd train` one after the other with one rollout worker and one learner rank (each
asks Ray for one core) and the same rounds, trajectories and learner steps; nothing else should run on the machine.
From each run's `opd_end` row: the phase's wall-clock and each role's busy seconds; from the synchronous run, R and
L (rollout and learner seconds per round), (R + L) / max(R, L), and the ideal speed-up: the synchronous phase over
the larger of the workers' decoding and everything else in it (learner steps, syncs, the driver's logging, plots
and checkpoints), all of which the overlap can hide behind decoding. Then the held-out tau of the
final drafter per arm and the paired ratio (overlapped over synchronous) with its 95% t-interval over the seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # Student's t, two-sided 95%, by degrees of freedom


def run_arm(recipe: str, seed: int, lag: int, out: Path, overrides: list[str]) -> dict:
    name = f"lag{lag}-seed{seed}"
    argv = [str(Path(sys.executable).parent / "draftopd"), "train", recipe, f"run.seed={seed}", f"run.name={name}"]
    argv += [f"run.out_dir={out}", f"opd.max_policy_lag={lag}", "rollout.num_workers=1", "learner.num_learners=1"]
    argv += ["rollout.num_cpus_per_worker=1", "learner.num_cpus_per_learner=1", *overrides]
    subprocess.run(argv, check=True)
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    end = next(r for r in reversed(rows) if r["phase"] == "opd_end")
    rounds = sum(1 for r in rows if r["phase"] == "rollout" and "rollout/tau" in r)
    tau = next(r for r in reversed(rows) if "eval/toy/tau" in r)
    busy = {k: end[f"pipeline/{k}"] for k in ("phase_s", "rollout_busy_s", "learner_busy_s")}
    return {"seed": seed, "lag": lag, "rounds": rounds, "tau": tau["eval/toy/tau"], **busy}


def interval(values: list[float]) -> tuple[float, float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="runs/overlap")
    p.add_argument("overrides", nargs="*")
    a, more = p.parse_known_args()  # overrides may follow the options
    a.overrides += more
    out = Path(a.out)
    results = []
    for seed in a.seeds:
        for lag in (0, 1):
            results.append(run_arm(a.recipe, seed, lag, out, a.overrides))
            print(json.dumps(results[-1]), flush=True)
    (out / "overlap.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{a.recipe} {' '.join(a.overrides)}")
    print("| seed | phase s sync / overlapped | speed-up | R, L s per round (sync) | (R + L) / max(R, L) | ideal | "
          "share of ideal | idle share rollout, learner (overlapped) | held-out tau sync / overlapped |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios = []
    for seed in a.seeds:
        s, o = (next(r for r in results if r["seed"] == seed and r["lag"] == lag) for lag in (0, 1))
        rr, ll = s["rollout_busy_s"] / s["rounds"], s["learner_busy_s"] / s["rounds"]
        # the workers idle whenever they do not decode: the rest of the synchronous phase (learner steps, syncs,
        # and the driver's own logging, plots and checkpoints) is what the overlap can hide
        rest = s["phase_s"] - s["rollout_busy_s"]
        ideal, speed = s["phase_s"] / max(s["rollout_busy_s"], rest), s["phase_s"] / o["phase_s"]
        idle = (1 - o["rollout_busy_s"] / o["phase_s"], 1 - o["learner_busy_s"] / o["phase_s"])
        ratios.append(o["tau"] / s["tau"])
        print(f"| {seed} | {s['phase_s']:.1f} / {o['phase_s']:.1f} | {speed:.3f} | {rr:.2f}, {ll:.2f} | "
              f"{(rr + ll) / max(rr, ll):.3f} | {ideal:.3f} | "
              f"{speed / ideal:.3f} | {idle[0]:.3f}, {idle[1]:.3f} | {s['tau']:.3f} / {o['tau']:.3f} |")  # fmt: skip
    mean, lo, hi = interval(ratios)
    print(f"\nheld-out tau, overlapped over synchronous: {mean:.4f} [{lo:.4f}, {hi:.4f}] (95% t-interval, "
          f"{len(ratios)} seeds)")  # fmt: skip


if __name__ == "__main__":
    main()
