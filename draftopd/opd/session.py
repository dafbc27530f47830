"""The mechanics behind the Draft-OPD driver: actors, data routing, sync, eval, logging, checkpoints.

Large data never passes through the driver: trajectories go from the rollout
workers to the buffer actor, error states from the buffer to the learners, and
drafter weights from learner rank 0 to the workers, all as Ray object references.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from draftopd.data.pool import pool_trajectories
from draftopd.data.prompts import encode_chats, load_prompts
from draftopd.eval.acceptance import acceptance_stats
from draftopd.loading import eos_ids, load_tokenizer, resolve_drafter_path
from draftopd.messages import SamplingConfig
from draftopd.opd.learner import LearnerSpec
from draftopd.opd.pipeline import RolloutPipeline
from draftopd.opd.replay import opd_loss_config
from draftopd.opd.runtime import InProcessRuntime, RayRuntime
from draftopd.opd.weight_sync import WeightSyncError, make_weight_sync
from draftopd.rundir import RunDir, latest_checkpoint
from draftopd.schema import Config, to_dict
from draftopd.sft.trainer import SFTExample, lr_at
from draftopd.sft.vocab import build_draft_vocab

# MLflow's UI charts a run's metrics in sections named by what precedes the last '/', sorted by name: under
# this prefix the buffer's bookkeeping sorts after the acceptance sections (`eval/...`, `rollout`).
BUFFER_METRICS = "rollout/buffer"


def buffer_metrics(stats: dict) -> dict[str, float]:
    """`ReplayBuffer.stats()` as metrics: `rollout/buffer/size`, `rollout/buffer/replayed_share`, ..."""
    return {f"{BUFFER_METRICS}/{k}": float(v) for k, v in stats.items()}


def _atomic_write(path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _first_line(exc: BaseException) -> str:
    """Ray's actor errors run to many lines; a stop message is one."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


class TrainingError(RuntimeError):
    """The job cannot go on (learner failure, repeated non-finite losses); a checkpoint is left to resume from."""


@dataclass
class DriverState:
    """What the driver itself must remember to resume; saved next to the learner checkpoint."""

    policy_version: int = 0
    round: int = 0  # rounds the learner has learned from
    rounds_decoded: int = 0  # rounds whose trajectories are in the buffer (one more than `round` with a lag)
    sft_done: bool = False
    mlflow_run_id: str = ""
    drafter_config: dict = field(default_factory=dict)
    history: list = field(default_factory=list)


def start_ray(cfg: Config) -> None:
    import ray

    if ray.is_initialized():
        return
    if cfg.ray.address:
        ray.init(address=cfg.ray.address)
        return
    if os.environ.get("RAY_ADDRESS"):  # `ray job submit` hands its entrypoint the cluster's address
        ray.init()
        return
    # Otherwise a Ray of the run's own, never some other cluster that happens to run on this machine (joining one
    # ties the run's actors to its lifetime). It listens on 127.0.0.1 alone: on Linux, Ray swaps a loopback node
    # address for the machine's (its servers then listen on every interface) unless multi-node clusters are off,
    # a switch it reads from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import: turned off here for this start only.
    from ray._private import ray_constants

    clusters, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(
            address="local",
            num_cpus=cfg.ray.num_cpus or None,
            object_store_memory=cfg.ray.object_store_memory_mb * 2**20,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = clusters


class Session:
    """One job: owns the run directory, the tracker and the actor handles."""

    def __init__(self, cfg: Config, run: RunDir, tracker, state: DriverState, runtime=None):
        self.cfg, self.run, self.tracker, self.state = cfg, run, tracker, state
        self.rt = runtime or (InProcessRuntime() if cfg.ray.in_process else RayRuntime())
        self.tokenizer = load_tokenizer(cfg.target.path)
        self.eos = eos_ids(self.tokenizer, cfg.target.path)
        think = cfg.data.enable_thinking
        self.train_prompts = encode_chats(
            self.tokenizer, load_prompts(cfg.data.prompts, "train", cfg.data.num_train_prompts, cfg.run.seed), think
        )
        self.eval_prompts = encode_chats(
            self.tokenizer,
            load_prompts(cfg.data.eval_prompts, "held_out", cfg.opd.num_eval_prompts, cfg.run.seed),
            think,
        )
        self.weight_sync = make_weight_sync(cfg.sync.backend, self.rt, cfg.rollout.backend, cfg.sync.timeout_s)
        self.eval_k = cfg.eval.num_draft_tokens[0]  # the periodic held-out eval's K (the eval section's first)
        self.update = None  # the WeightUpdate generate calls carry; set by `sync`
        self.nonfinite_in_a_row = 0
        self.num_skipped_stale = 0  # learner steps skipped because the buffer held no fresh state
        self.learner_seconds = 0.0  # the learner ranks' busy time: steps and publishes (the pipeline's idle shares)

    # -- placement ---------------------------------------------------------------

    def place_actors(self) -> None:
        from draftopd.opd.actors import buffer_actor, rollout_actors

        self.workers = rollout_actors(self.cfg, self.eos)
        self.buffer = buffer_actor(self.cfg)
        self.rollouts = RolloutPipeline(self, self.cfg.opd.max_policy_lag)

    def place_learners(self, init_path: str = "", draft_vocab: list[int] | None = None) -> None:
        """The DeepSpeed ranks, each building the initial drafter itself (from `init_path`, else fresh)."""
        from draftopd.opd.actors import learner_actors

        c = self.cfg
        spec = LearnerSpec(
            c.target.path,
            c.target.aux_layer_ids,
            c.target.dtype,
            c.drafter,
            init_path,
            list(draft_vocab or []),
            c.learner.zero_stage,
            c.sft.lr,
            c.sft.weight_decay,
            c.sft.grad_clip,
            c.learner.num_threads,
            c.run.seed,
        )
        self.learners = learner_actors(c, spec, 0)
        # DeepSpeed's rendezvous: a free port on rank 0's node, chosen there (under KubeRay the driver is another pod)
        master = tuple(self._learners_get([self.learners[0].free_port.remote()], "placement")[0])
        micro = max(1, c.learner.batch_size)
        self._learners_get([learner.setup.remote(micro, master) for learner in self.learners], "setup")
        self.state.drafter_config = self._learners_get([self.learners[0].drafter_config.remote()], "setup")[0]

    # -- the steps of the loop ---------------------------------------------------

    def _split(self, items: list, n: int) -> list[list]:
        return [items[i::n] for i in range(n)]

    def target_responses(self) -> list[SFTExample]:
        d = self.cfg.data
        # A pool made by `draftopd prepare-data` for this target and template already holds the target's responses.
        pooled = pool_trajectories(d.prompts, self.cfg.target.path, d.enable_thinking, d.num_train_prompts)
        if pooled is not None:
            return [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in pooled]
        sampling = SamplingConfig(d.max_new_tokens, d.response_temperature, 0, self.cfg.run.seed)
        indices = list(range(len(self.train_prompts)))
        refs = self.rollouts.decode(self.train_prompts, indices, sampling, False, "target responses")
        trajs = [t for chunk in self.rt.get(refs) for t in chunk]
        return [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs]

    def place_learners_for_start(self, examples: list[SFTExample]) -> None:
        """Learners with the recipe's starting drafter: `drafter.init`, or fresh over the responses' vocabulary."""
        if self.cfg.drafter.init:
            return self.place_learners(init_path=resolve_drafter_path(self.cfg.drafter.init))
        responses = [e.ids[e.prompt_len :] for e in examples]
        ids = build_draft_vocab(responses, self.cfg.drafter.draft_vocab_size, len(self.tokenizer), self.eos)
        return self.place_learners(draft_vocab=ids.tolist())

    def _learner_call(self, method: str, shards: list, *args) -> dict:
        """One synchronous step on every rank, its metrics merged; a dead learner ends the job with a clear
        message. The step then counts (`count_step`)."""
        t0 = time.perf_counter()
        refs = [getattr(learner, method).remote(shard, *args) for learner, shard in zip(self.learners, shards)]
        results = self._learners_get(refs, method)
        self.learner_seconds += time.perf_counter() - t0
        merged = {k: sum(r[k] for r in results) / len(results) for k in results[0] if isinstance(results[0][k], float)}
        merged.update({k: results[0][k] for k in results[0] if not isinstance(results[0][k], float)})
        return self.count_step(merged)

    def count_step(self, metrics: dict) -> dict:
        """The policy version's one owner: a step that updated the drafter makes the next version; a skipped one
        (non-finite loss) does not, and too many in a row end the job."""
        if metrics.get("skipped_nonfinite"):
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row >= self.cfg.learner.max_nonfinite_in_a_row:
                raise TrainingError(f"{self.nonfinite_in_a_row} non-finite losses in a row; stopping")
        else:
            self.nonfinite_in_a_row = 0
            self.state.policy_version += 1
        return metrics

    def sft_step(self, batch: list[SFTExample], step: int, total: int) -> dict:
        s = self.cfg.sft
        lr = lr_at(step, total, s.lr, s.warmup_ratio)
        shards = self._split(batch, len(self.learners))
        return self._learner_call("sft_step", shards, s.ttt_depth, s.depth_decay, s.max_seq_len, lr)

    def opd_lr(self, step: int, total: int) -> float:
        """learner.lr at OPD learner step `step` of `total`: linear warm-up, then constant or cosine decay."""
        lc = self.cfg.learner
        if lc.lr_schedule == "cosine":
            return lr_at(step, total, lc.lr, lc.warmup_ratio)
        warm = int(total * lc.warmup_ratio)
        return lc.lr * min(1.0, (step + 1) / warm) if warm else lc.lr

    def opd_step(self, step: int = 0, total: int = 0) -> dict:
        """One learner step on states drawn from the buffer (opd.accumulate_rounds rounds' worth per rank)."""
        lc = self.cfg.learner
        n, per_rank = len(self.learners), lc.batch_size * self.cfg.opd.accumulate_rounds
        self.rt.get(self.buffer.prune.remote(self.state.policy_version))
        if self.rt.get(self.buffer.stats.remote())["size"] == 0:
            # Nothing fresh to replay (empty, or every state older than buffer.max_staleness): skip, counted.
            self.num_skipped_stale += 1
            tqdm.write(f"policy version {self.state.policy_version}: learner step skipped, no fresh error state")
            return {
                "learner/skipped_no_fresh_states": 1.0,
                "learner/num_skipped_no_fresh_states": float(self.num_skipped_stale),
            }
        draw = self.buffer.sample_trajectories if lc.replay_unit == "trajectory" else self.buffer.sample
        samples = [draw.remote(per_rank, self.state.policy_version) for _ in range(n)]
        lr = self.opd_lr(step, total)
        loss_cfg = opd_loss_config(lc)
        t0 = time.perf_counter()
        m = self._learner_call(
            "opd_step",
            samples,
            lc.replay_depth or self.cfg.rollout.num_draft_tokens,
            lc.decay,
            lc.max_seq_len,
            loss_cfg,
            lr,
            lc.replay_unit,
        )
        m["learner/samples_per_s"] = n * per_rank / (time.perf_counter() - t0)
        m["learner/lr"] = lr
        if "target_tokens_per_token" in m:  # opd_loss's count, charted beside the step's other learner figures
            m["learner/target_tokens_per_token"] = m.pop("target_tokens_per_token")
        return m

    def sync(self) -> float:
        """Publish rank 0's drafter at the current policy version to every worker; returns the seconds it took.

        A collective sync that fails (a worker killed mid-broadcast, a timeout) is published once more over a new
        group, with the workers Ray restarted meanwhile; a second failure ends the job.
        """
        t0 = time.perf_counter()
        for attempt in (1, 2):
            try:
                self.update = self.weight_sync.publish(
                    self.learners, self.workers, self.state.drafter_config, self.state.policy_version
                )
                break
            except WeightSyncError as exc:
                if attempt == 2:
                    raise TrainingError(f"weight sync failed twice in a row ({_first_line(exc)})") from None
                tqdm.write(f"{_first_line(exc)}; publishing again over a new group")
            except self.rt.ActorDied as exc:
                raise TrainingError(f"a learner rank died during weight sync ({_first_line(exc)})") from None
        seconds = time.perf_counter() - t0
        self.learner_seconds += seconds
        return seconds

    def save_drafter(self, path: Path) -> Path:
        """Learner rank 0 writes the drafter directory (every rank is called: ZeRO-3 gathers collectively)."""
        self._learners_get([learner.save_drafter.remote(str(path)) for learner in self.learners], "saving the drafter")
        return path

    def _learners_get(self, refs: list, what: str) -> list:
        try:
            return self.rt.get(refs)
        except self.rt.ActorDied as exc:
            raise TrainingError(f"a learner rank died during {what} ({_first_line(exc)})") from None

    def eval_sampling(self) -> SamplingConfig:
        return SamplingConfig(self.cfg.eval.max_new_tokens, 0.0, self.eval_k, self.cfg.run.seed)

    def eval_metrics(self, chunks: list) -> dict:
        stats = acceptance_stats([t for chunk in chunks for t in chunk], self.eval_k)
        return {
            "eval/toy/tau": stats["tau"],
            **{f"eval/toy/accept_pos_{i}": a for i, a in enumerate(stats["acceptance_per_position"])},
        }

    def evaluate(self) -> dict:
        """The held-out evaluation of the drafter the workers hold, now (the pipeline's, when none is in flight)."""
        return self.eval_metrics(self.rt.get(self.rollouts.wait(self.rollouts.submit_eval())))

    # -- bookkeeping ---------------------------------------------------------------

    def log(self, metrics: dict, phase: str, version: int | None = None) -> None:
        """A row of metrics at `version` (default: the current policy version; an evaluation read later names
        the version it measured)."""
        version = self.state.policy_version if version is None else version
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        row = {"phase": phase, "policy_version": version, **clean}
        self.run.log(row)
        self.state.history.append(row)
        self.tracker.log_metrics(clean, step=version)

    def buffer_stats(self) -> dict:
        return buffer_metrics(self.rt.get(self.buffer.stats.remote(self.state.policy_version)))

    def log_rejections(self) -> None:
        """The rejection explorer's tables (eval/rejections.py) over the buffer as it is now, into the MLflow run
        under `rejections/end-v<policy version>/`; `draftopd rejections` reads the same from a checkpoint."""
        from draftopd.eval.rejections import log_report, prompt_domains, rejection_report

        d = self.cfg.data
        domains = prompt_domains(d.prompts, "train", d.num_train_prompts, self.cfg.run.seed)
        report = rejection_report(self.rt.get(self.buffer.state_dict.remote()), self.tokenizer, domains)
        try:
            log_report(report, self.tracker, f"rejections/end-v{self.state.policy_version:06d}")
        except FileExistsError:
            pass  # a resumed run that had logged them before it stopped

    def checkpoint(self) -> None:
        """Drafter, DeepSpeed state (optimizer included), buffer and driver state into a new directory.

        `latest.json` is switched to it only when it is complete, so a crash mid-checkpoint resumes from
        the previous one; the two newest checkpoints are kept.
        """
        root = self.run.path / "checkpoints"
        ckpt = root / f"v{self.state.policy_version:06d}-r{self.state.round:04d}"
        ckpt.mkdir(parents=True, exist_ok=True)
        self._learners_get([lr.save_checkpoint.remote(str(ckpt / "deepspeed")) for lr in self.learners], "checkpoint")
        self.save_drafter(ckpt / "drafter")
        _atomic_write(ckpt / "buffer.json", json.dumps(self.rt.get(self.buffer.state_dict.remote())))
        _atomic_write(ckpt / "driver_state.json", json.dumps(self.state.__dict__))
        _atomic_write(root / "latest.json", json.dumps({"dir": ckpt.name}))
        for old in sorted(p for p in root.glob("v*-r*") if p.is_dir())[:-2]:
            shutil.rmtree(old, ignore_errors=True)

    def restore(self) -> None:
        """The inverse of `checkpoint`: learners, buffer and workers back where the checkpoint left them."""
        ckpt = latest_checkpoint(self.run.path)
        saved = json.loads((ckpt / "driver_state.json").read_text())
        self.state.__dict__.update({k: v for k, v in saved.items() if k != "mlflow_run_id"})
        self.place_learners(init_path=str(ckpt / "drafter"))
        self._learners_get([lr.load_checkpoint.remote(str(ckpt / "deepspeed")) for lr in self.learners], "restore")
        self.rt.get(self.buffer.load_state_dict.remote(json.loads((ckpt / "buffer.json").read_text())))
        self.sync()

    def close(self) -> None:
        """In the driver's own process (`ray.in_process`), the learners release what they set up; Ray actors
        need nothing: they end with the job."""
        if isinstance(self.rt, InProcessRuntime):
            self.rt.get([learner.close.remote() for learner in getattr(self, "learners", [])])

    def log_config(self) -> None:
        self.tracker.log_params(to_dict(self.cfg))
        self.tracker.log_artifact(self.run.path / "config.yaml")
        self.tracker.log_artifact(self.run.path / "provenance.json")
