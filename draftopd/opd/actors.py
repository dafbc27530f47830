"""The one place where roles become Ray actors, with resources taken from the config.

Each actor is the plain class of its role; Ray adds placement, restarts and
remote calls. Rollout workers restart on failure and their in-flight calls are
retried (the calls carry the weights they need, see opd/rollout.py). With
`ray.in_process`, the same plain objects are wrapped to be called alike in the
driver's process (opd/runtime.py).
"""

from __future__ import annotations

from draftopd.opd.buffer import ReplayBuffer
from draftopd.opd.learner import DraftLearner
from draftopd.opd.rollout import RolloutWorker
from draftopd.schema import Config


def _in_process(cls):
    from draftopd.opd.runtime import InProcessClass

    return InProcessClass(cls)


def rollout_actors(cfg: Config, eos: list[int]):
    import ray

    if cfg.ray.in_process:
        actor = _in_process(RolloutWorker)
    else:
        actor = ray.remote(RolloutWorker).options(
            num_cpus=cfg.rollout.num_cpus_per_worker,
            num_gpus=cfg.rollout.num_gpus_per_worker,
            max_restarts=cfg.rollout.max_restarts,
            max_task_retries=cfg.rollout.max_restarts,
        )
    r = cfg.rollout
    options = None
    if r.backend == "vllm":
        from draftopd.vllm_backend.rollout import VllmOptions

        options = VllmOptions(cfg.target.dtype, r.vllm_memory_fraction, r.vllm_max_model_len, r.vllm_enforce_eager)
        options.num_draft_tokens = r.num_draft_tokens  # K of an engine started to receive a weight transfer
        options.record = r.record
    args = (cfg.target.path, cfg.target.aux_layer_ids, cfg.target.dtype, eos, r.num_threads)
    return [actor.remote(*args, i, r.backend, options) for i in range(r.num_workers)]


def buffer_actor(cfg: Config):
    import ray

    actor = _in_process(ReplayBuffer) if cfg.ray.in_process else ray.remote(ReplayBuffer).options(num_cpus=0)
    return actor.remote(cfg.buffer)


def learner_actors(cfg: Config, spec, master_port: int):
    import ray

    if cfg.ray.in_process:
        actor = _in_process(DraftLearner)
    else:
        actor = ray.remote(DraftLearner).options(
            num_cpus=cfg.learner.num_cpus_per_learner, num_gpus=cfg.learner.num_gpus_per_learner, max_restarts=0
        )
    n = cfg.learner.num_learners
    return [actor.remote(spec, rank, n, "127.0.0.1", master_port) for rank in range(n)]
