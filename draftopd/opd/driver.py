"""`draftopd train` for Draft-OPD recipes: the loop, as the architecture reads.

place actors -> (SFT on target responses) -> repeat: rollout into the buffer ->
learner steps on replayed error states -> weight sync -> log, eval, checkpoint.
"""

from __future__ import annotations

import json
import random
import sys

from tqdm import tqdm

from draftopd.eval.plots import acceptance_curve_plot
from draftopd.opd.session import DriverState, Session, TrainingError, start_ray
from draftopd.rundir import RunDir, latest_checkpoint
from draftopd.schema import Config
from draftopd.tracking import Tracker


def sft_batches(examples: list, batch_size: int, epochs: int, seed: int):
    """Full batches, the examples shuffled afresh each epoch (seeded); fewer examples than a batch repeat."""
    rng = random.Random(seed)
    for _ in range(epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        order += order
        for i in range(max(1, len(examples) // batch_size)):
            yield [examples[j] for j in order[i * batch_size : (i + 1) * batch_size]]


def sft_phase(s: Session) -> None:
    # target responses feed SFT and the draft vocabulary; a recipe that starts from a drafter and skips SFT needs none
    needed = s.cfg.sft.epochs > 0 or not s.cfg.drafter.init
    examples = s.target_responses() if needed else []
    s.place_learners_for_start(examples)
    s.log({"sync_seconds": s.sync(), **s.evaluate()}, "sft_start")
    cfg = s.cfg.sft
    total = cfg.epochs * max(1, len(examples) // cfg.batch_size)
    batches = sft_batches(examples, cfg.batch_size, cfg.epochs, s.cfg.run.seed)
    for step, batch in enumerate(tqdm(batches, total=total, desc="SFT (TTT) on learners", unit="step")):
        s.log(s.sft_step(batch, step, total), "sft")
    s.state.sft_done = True
    s.log({"sync_seconds": s.sync(), **s.evaluate()}, "sft_end")


def opd_phase(s: Session) -> None:
    o, rollouts = s.cfg.opd, s.rollouts  # opd/pipeline.py: what runs ahead of the learner (opd.max_policy_lag)
    total = o.num_rounds // o.accumulate_rounds * o.steps_per_round  # learner steps of the phase (lr schedule)
    rollouts.begin()
    plotted = None  # held-out evaluations in the plot last drawn
    for _ in tqdm(range(s.state.round, o.num_rounds), desc="Draft-OPD rounds", unit="round"):
        s.log({**rollouts.collect(s.state.round), **s.buffer_stats()}, "rollout")
        phase = (s.state.round + 1) // o.accumulate_rounds - 1  # learner phases before this one
        learns = (s.state.round + 1) % o.accumulate_rounds == 0  # after every accumulate_rounds-th round
        for j in range(o.steps_per_round if learns else 0):
            metrics = s.opd_step(phase * o.steps_per_round + j, total)
            if s.state.policy_version % o.sync_every == 0:
                metrics["sync_seconds"] = rollouts.sync()  # None (not logged) while a round is in flight: after it
            if s.state.policy_version % o.eval_every == 0:
                metrics.update(rollouts.evaluate())  # {} while a round is in flight: logged when read
            s.log(metrics, "opd")
        for version, metrics in rollouts.finished_evals():
            s.log(metrics, "eval", version)
        s.state.round += 1
        boundary = s.state.round % o.checkpoint_every == 0 or s.state.round == o.num_rounds
        if boundary:
            drain(s)  # a checkpoint holds every decoded round; the last evaluation is read
        # redrawn when a held-out evaluation lands and at checkpoints, not every round: the driver's own work runs
        # beside both roles when rounds overlap learning (MLflow's metric charts show rollout tau every round)
        evals = sum("eval/toy/tau" in r for r in s.state.history)
        if evals != plotted or boundary:
            refresh_plot(s)
            plotted = evals
        if s.state.round % o.checkpoint_every == 0:
            s.checkpoint()
    s.log(rollouts.summary(), "opd_end")


def drain(s: Session) -> None:
    """Whatever the rollout workers have in flight, finished and logged (before a checkpoint, at the end)."""
    for metrics in s.rollouts.drain():
        s.log(metrics, "rollout")
    for version, metrics in s.rollouts.finished_evals(block=True):
        s.log(metrics, "eval", version)


def refresh_plot(s: Session) -> None:
    """Rollout tau and held-out tau (with per-position acceptance, held-out) against policy version."""
    k = s.eval_k
    history = []
    for r in s.state.history:
        row = {"policy_version": r["policy_version"], "tau_ceiling": k + 1}
        if "rollout/tau" in r:
            row["tau"] = r["rollout/tau"]
        if "eval/toy/tau" in r:
            row["eval/toy/tau"] = r["eval/toy/tau"]
            row["acceptance_per_position"] = [r[f"eval/toy/accept_pos_{i}"] for i in range(k)]
        if len(row) > 2:
            history.append(row)
    if history:
        sft_end = next((r["policy_version"] for r in s.state.history if r["phase"] == "sft_end"), None)
        png = acceptance_curve_plot(history, s.run.path / "acceptance_curve.png", sft_end)
        s.tracker.log_artifact(png, "plots")


def run_opd(cfg: Config, argv: list[str] | None = None, runtime=None) -> dict:
    """The whole job; `runtime` (opd/runtime.py) defaults to Ray, or the driver's process with ray.in_process."""
    run = RunDir(cfg, list(sys.argv if argv is None else argv))
    state = DriverState()
    ckpt = latest_checkpoint(run.path) if cfg.run.resume else None
    resuming = ckpt is not None
    if cfg.run.resume and not resuming:
        print(f"run.resume=true but {run.path} holds no checkpoint yet: starting from the beginning")
    if resuming:
        state = DriverState(**json.loads((ckpt / "driver_state.json").read_text()))
    tracker = Tracker(run.path, cfg.tracking.experiment, cfg.run.name, cfg.tracking.tracking_uri or None)
    state.mlflow_run_id = tracker.start(state.mlflow_run_id or None)
    if not cfg.ray.in_process:
        start_ray(cfg)
    s = Session(cfg, run, tracker, state, runtime)
    s.log_config()
    s.place_actors()
    try:
        if resuming:
            s.restore()
            print(f"resumed at policy version {state.policy_version}, round {state.round}")
        else:
            sft_phase(s)
            s.checkpoint()
        opd_phase(s)
        s.log_rejections()
        final = run.checkpoint_dir("final")
        s.save_drafter(final)
        tracker.log_artifact(final, "drafter")
        tracker.end("FINISHED")
    except TrainingError as exc:
        tracker.end("FAILED")
        ckpt = latest_checkpoint(run.path)
        where = f"; resumable checkpoint {ckpt}" if ckpt else ""
        raise TrainingError(f"{exc}{where}") from None
    except BaseException:
        tracker.end("FAILED")
        raise
    finally:
        s.close()
    last = next(r for r in reversed(state.history) if "eval/toy/tau" in r)
    print(
        f"held-out tau = {last['eval/toy/tau']:.3f} (K={s.eval_k}, policy version "
        f"{state.policy_version}); MLflow run {state.mlflow_run_id}"
    )
    return {
        "run_dir": str(run.path),
        "drafter": str(final),
        "history": state.history,
        "mlflow_run_id": state.mlflow_run_id,
    }
