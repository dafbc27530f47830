"""DraftLearner: one data-parallel rank that trains the drafter with DeepSpeed (gloo on CPU, NCCL on GPU).

A plain class: the Ray actor in opd/actors.py is a thin wrapper, and a test can
build one directly. It holds a frozen target (for aux states and teacher
distributions) and the drafter inside a DeepSpeed engine, runs SFT (TTT) steps
and Draft-OPD replay steps on the shard of a batch it is given, and owns the
drafter's weights: every rank builds the same initial drafter (from a checkpoint
directory, or fresh from the draft vocabulary and the seed; DeepSpeed also
broadcasts rank 0's parameters), rank 0 writes every checkpoint and the final
drafter, and hands out the weights for the rollout workers. The weights never
pass through the driver.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from draftopd.messages import ErrorState
from draftopd.schema import DrafterConfig


@dataclass
class LearnerSpec:
    """Everything a rank needs to build itself; plain data so it crosses process boundaries."""

    target_path: str
    aux_layer_ids: list[int]
    target_dtype: str
    drafter: DrafterConfig  # the recipe's drafter section (family, shape)
    init_path: str = ""  # start from this drafter directory; empty: a fresh drafter over `draft_vocab`
    draft_vocab: list[int] = dataclasses.field(default_factory=list)  # sorted target ids of a fresh drafter
    zero_stage: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    num_threads: int = 1
    seed: int = 0


def deepspeed_config(spec: LearnerSpec, micro_batch: int) -> dict:
    """ZeRO stage from the recipe; torch AdamW so nothing is JIT-compiled on CPU; fp32 master weights under bf16."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": spec.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": spec.lr, "betas": [0.9, 0.95], "weight_decay": spec.weight_decay, "torch_adam": True},
        },
        "zero_optimization": {"stage": spec.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if not torch.cuda.is_available():
        cfg["zero_allow_untested_optimizer"] = True
    if spec.target_dtype == "bfloat16":
        # The drafter takes the target's dtype; DeepSpeed's bf16 mode keeps fp32 master weights, so that
        # small updates (lr ~1e-5 on weights ~1e-2) are not rounded away in bf16.
        cfg["bf16"] = {"enabled": True}
    return cfg


def learner_device() -> torch.device:
    """The GPU Ray gave this rank (learner.num_gpus_per_learner > 0), else the CPU.

    Ray sets CUDA_VISIBLE_DEVICES per actor, so the rank's GPU is the current CUDA device (cuda:0).
    A rank given no GPU, or built outside Ray, stays on the CPU even where CUDA is visible.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    import ray

    if not (ray.is_initialized() and ray.get_gpu_ids()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def to_device(batch, device: torch.device):
    """A dataclass batch with its tensors on `device`; the batch itself when it is already there (CPU)."""
    moved = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor) and value.device != device:
            moved[f.name] = value.to(device)
    return dataclasses.replace(batch, **moved) if moved else batch


def _init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str) -> None:
    """Env-style rendezvous (no MPI discovery); the unused shared-memory all-reduce op is not built."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
        LOCAL_SIZE="1",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    import sys

    import deepspeed

    # `import deepspeed.comm.torch as m` would bind the real torch (the package re-exports it): go via sys.modules.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skips a ~1 min JIT build training never uses
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


class DraftLearner:
    """One rank. `setup` does the heavy work; the constructor only stores arguments."""

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int, master_addr: str, master_port: int):
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.master = (master_addr, master_port)
        self.engine = None
        self.num_nonfinite = 0
        self.step = 0

    def node_ip(self) -> str:
        """Address of this rank's node, for the rendezvous of rank 0."""
        import ray

        return ray.util.get_node_ip_address()

    def setup(self, micro_batch: int = 8, master: tuple[str, int] | None = None, target=None, initial=None) -> None:
        """`target`: a TargetModel already loaded on this rank's device to use instead of loading the spec's (the
        one-process server's learner shares its process's); `initial`: a drafter to start from (a copy of it)
        instead of the spec's `init_path`."""
        import deepspeed

        if master is not None:
            self.master = tuple(master)
        from draftopd.drafters import clone_drafter
        from draftopd.loading import load_target

        torch.set_num_threads(self.spec.num_threads)
        torch.manual_seed(self.spec.seed)  # every rank draws the same fresh drafter
        self.device = device = learner_device()
        _init_distributed(self.rank, self.world_size, *self.master, "nccl" if device.type == "cuda" else "gloo")
        if target is None:
            target = load_target(self.spec.target_path, self.spec.aux_layer_ids, self.spec.target_dtype)
        self.target = target
        self.target.model.to(device)
        drafter = self._initial_drafter() if initial is None else clone_drafter(initial, target)
        self.drafter = drafter = drafter.to(device)
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(
            model=drafter, model_parameters=params, config=deepspeed_config(self.spec, micro_batch)
        )

    def _grad_norm(self) -> float:
        """The global gradient norm after backward, before the step (ZeRO partitions: local squared norms summed)."""
        stage, params = self.spec.zero_stage, list(self.engine.module.parameters())
        if stage == 3:
            from deepspeed.utils import safe_get_local_grad

            grads = [safe_get_local_grad(p) for p in params if p.requires_grad]
        elif stage:
            grads = [g for gs in self.engine.optimizer.averaged_gradients.values() for g in (gs or [])]
        else:
            grads = [p.grad for p in params]  # already averaged over the ranks: the same on each
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for g in grads:
            if g is not None:
                sq += g.double().pow(2).sum()
        op = torch.distributed.ReduceOp.SUM if stage else torch.distributed.ReduceOp.MAX
        torch.distributed.all_reduce(sq, op=op)
        return math.sqrt(sq.item())

    def _drop_grads(self) -> None:
        """Forget this backward's gradients without stepping (ZeRO 1/2 keep theirs in the optimizer)."""
        if not self.spec.zero_stage:
            return self.engine.zero_grad()
        opt = self.engine.optimizer
        opt.zero_grad(set_to_none=True)
        if self.spec.zero_stage in (1, 2):
            for k in opt.averaged_gradients:
                opt.averaged_gradients[k] = None
            getattr(opt, "_release_preflattened_grad_buffers", lambda: None)()

    def _apply(self, loss: torch.Tensor, metrics: dict, lr: float | None) -> dict:
        """Backward and step through DeepSpeed; a non-finite loss or gradient norm skips the step (counted, on
        every rank)."""
        finite = torch.tensor([1.0 if math.isfinite(loss.item()) else 0.0], device=loss.device)
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if finite.item() == 0:
            self.num_nonfinite += 1
            return {**metrics, "skipped_nonfinite": 1, "num_nonfinite_total": self.num_nonfinite}
        if lr is not None:
            for g in self.engine.optimizer.param_groups:
                g["lr"] = lr
        self.engine.backward(loss)
        grad_norm = self._grad_norm()  # before clipping
        if not math.isfinite(grad_norm):
            self._drop_grads()
            self.num_nonfinite += 1
            out = {**metrics, "skipped_nonfinite": 1, "skipped_nonfinite_grad": 1, "grad_norm": grad_norm}
            return {**out, "num_nonfinite_total": self.num_nonfinite}
        self.engine.step()
        metrics = {**metrics, "grad_norm": grad_norm}
        self.step += 1
        return {**metrics, "skipped_nonfinite": 0, "num_nonfinite_total": self.num_nonfinite, "learner_step": self.step}

    def _all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the learner ranks in place (the loss's global denominators)."""
        moved = t.to(self.device)
        torch.distributed.all_reduce(moved)
        t.copy_(moved)

    def sft_step(self, examples, depth: int, decay: float, max_len: int, lr: float | None = None) -> dict:
        from draftopd.sft.trainer import collate, ttt_loss

        self.engine.train()
        batch = to_device(collate(examples, max_len), self.device)
        loss, metrics = ttt_loss(self.engine.module, self.target, batch, depth, decay, forward=self.engine)
        return self._apply(loss, metrics, lr)

    def opd_step(
        self,
        states: list[ErrorState],
        depth: int,
        decay: float,
        max_len: int,
        loss_cfg,
        lr: float | None = None,
        unit: str = "state",
    ) -> dict:
        from draftopd.opd.replay import build_replay_batch, opd_loss, target_to_draft_index

        self.engine.train()
        # The batch is built on the CPU (per-state Python loops), then moved in one go.
        t2d = target_to_draft_index(self.drafter.draft_to_target_ids().cpu(), self.target.vocab_size)
        batch = build_replay_batch(
            states,
            t2d,
            depth,
            decay,
            max_len,
            accepted_rows=loss_cfg.accepted_rows,
            unit=unit,
            rejected_offsets=loss_cfg.rejected_offsets,
        )
        batch = to_device(batch, self.device)
        loss, metrics = opd_loss(
            self.engine.module, self.target, batch, loss_cfg, self.engine, self._all_reduce, self.world_size
        )
        return self._apply(loss, {**metrics, "replay_depth": depth}, lr)

    def _initial_drafter(self):
        from draftopd.drafters import load_drafter, new_drafter

        if self.spec.init_path:
            return load_drafter(self.spec.init_path, self.target, self.spec.drafter.kind)
        return new_drafter(self.spec.drafter, self.target, torch.tensor(self.spec.draft_vocab))

    def snapshot(self):
        """The drafter as it is now: an independent model (its weights copied to the CPU) bound to this rank's
        target, in eval mode; rank 0 only (all ranks are called under ZeRO-3)."""
        from draftopd.drafters import family

        state = self.weights()
        if state is None:
            return None
        fam = family(self.engine.module.kind)
        return fam.from_state(fam.read_config(self.drafter_config()), state, self.target).eval()

    def drafter_config(self) -> dict:
        """The drafter's config.json: what the driver names in a WeightUpdate (shape, not weights)."""
        return self.engine.module.config()

    def weights(self) -> dict | None:
        """Drafter weights as tensor copies on the CPU (never views into DeepSpeed's flat buffers, which would
        drag the whole buffer along), in their own dtype, on rank 0; None elsewhere.

        Under ZeRO-3 the parameters are gathered first, which every rank must join: call all ranks.
        """
        import deepspeed

        params = list(self.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.spec.zero_stage == 3):
            if self.rank != 0:
                return None
            return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.engine.module.state().items()}

    def save_drafter(self, path: str) -> str | None:
        """Rank 0 writes the drafter directory (all ranks are called: ZeRO-3 gathers collectively)."""
        from draftopd.drafters import write_checkpoint

        state = self.weights()
        if state is None:
            return None
        return str(write_checkpoint(self.drafter_config(), state, path))

    # -- the sending end of a collective weight sync (opd/weight_sync.py) --------------------------

    def weight_manifest(self) -> list | None:
        from draftopd.opd.weight_sync import manifest

        state = self.weights()
        return manifest(state) if state is not None else None

    def free_port(self) -> tuple[str, int]:
        """A free port on this rank's node, for a group whose store this rank hosts."""
        from draftopd.ports import free_port

        return self.node_ip(), free_port("")

    def join_weight_group(self, name: str, rank: int, transport: str, host: str, port: int, size: int, timeout_s):
        """Leave the group this rank was in (its store and connections go with it), then join `name` as `rank`."""
        self.leave_weight_group()
        if transport == "vllm":  # NCCL into vLLM's weight-transfer engine: its own rendezvous, from this GPU
            from draftopd.vllm_backend.transfer import TrainerGroup

            self.weight_group = TrainerGroup.join(name, host, port, size, timeout_s)
            return
        from draftopd.opd.weight_sync import TorchGroup, join_group

        group = join_group(transport, host, port, rank, size, timeout_s)
        self.weight_group = TorchGroup(name, transport, group, timeout_s)

    def leave_weight_group(self) -> None:
        group, self.weight_group = getattr(self, "weight_group", None), None
        if group is not None:
            group.close()

    def broadcast_weights(self, name: str, items: list) -> None:
        """Rank 0 sends the drafter from where it lives (its GPU under NCCL); a failure closes this rank's end."""
        import deepspeed

        from draftopd.opd.weight_sync import WeightSyncError, sync_failure

        params = list(self.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.spec.zero_stage == 3):
            if self.rank != 0:
                return
            group = getattr(self, "weight_group", None)
            if group is None or group.name != name:
                raise WeightSyncError(f"learner rank 0 is not in weight-sync group {name!r}")
            state = {k: v.detach() for k, v in self.engine.module.state().items()}
            try:
                group.send(state, items)
            except Exception as exc:
                self.leave_weight_group()
                raise sync_failure("learner rank 0", name, exc) from None

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Leave the process as this rank found it: no process group, no DeepSpeed groups of this world.

        A Ray actor simply exits; a rank in the driver's own process (`ray.in_process`) must undo its
        `init_distributed`, or the next run in that process trips over DeepSpeed's cached groups.
        """
        import deepspeed.comm.comm as ds_comm
        from deepspeed.utils import groups

        self.engine = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        ds_comm.cdb = None
        for name, value in vars(groups).copy().items():
            if name.startswith("_") and name.isupper() and name.endswith(("_GROUP", "_GROUP_RANKS")):
                setattr(groups, name, {} if isinstance(value, dict) else None)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)

    def save_checkpoint(self, path: str, client_state: dict | None = None) -> None:
        self.engine.save_checkpoint(path, tag="state", client_state={"step": self.step, **(client_state or {})})

    def load_checkpoint(self, path: str) -> dict:
        _, client = self.engine.load_checkpoint(path, tag="state")
        self.step = int((client or {}).get("step", 0))
        return client or {}
