"""Device check, section 2: one SFT step and one Draft-OPD learner step in bfloat16 on the device.

The in-process session (`ray.in_process: true`) cannot run where DeepSpeed and Ray are absent: its learner
rank, `DraftLearner`, builds a DeepSpeed engine in `setup` and asks Ray for its GPU. So this check drives
`DraftLearner` itself, the plain class the Ray actor wraps, with its real `sft_step` and `opd_step` (batch
collation, move to the device, TTT and replay losses, the global gradient norm over a one-rank
torch.distributed group, the non-finite guard), and in DeepSpeed's place a torch AdamW with the same
betas and gradient clip (`PlainEngine`). Unlike DeepSpeed's bf16 mode it keeps no fp32 master weights:
the step runs, its numbers are not DeepSpeed's.

The data is the toy pipeline's: target-written responses for SFT; greedy rollouts of the toy OPD
recipe's drafter (toy-eagle3-plateau, K = 4) through the replay buffer for Draft-OPD.
"""

from __future__ import annotations

import math
import time

import torch

from draftopd.config import BufferConfig, DrafterConfig, LearnerConfig
from draftopd.engine.speculative import SpeculativeEngine
from draftopd.loading import ASSETS, eos_ids, load_target, load_tokenizer
from draftopd.messages import SamplingConfig
from draftopd.opd.buffer import ReplayBuffer
from draftopd.opd.learner import DraftLearner, LearnerSpec
from draftopd.opd.replay import opd_loss_config
from draftopd.ports import free_port
from draftopd.sft.trainer import SFTExample


class PlainEngine:
    """What `DraftLearner` asks of its DeepSpeed engine (ZeRO stage 0, one rank), in plain torch."""

    def __init__(self, module: torch.nn.Module, spec: LearnerSpec):
        self.module, self.grad_clip = module, spec.grad_clip
        params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self) -> None:
        self.module.train()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.optimizer.param_groups[0]["params"], self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def build_learner(device: torch.device, dtype: str) -> DraftLearner:
    """A one-rank learner on `device`, set up as `DraftLearner.setup` would, with `PlainEngine` for DeepSpeed."""
    init = str(ASSETS / "toy-eagle3-plateau")  # recipes/toy-opd.yaml's drafter.init
    spec = LearnerSpec("toy", [1, 2, 3], dtype, DrafterConfig(), init, lr=3e-4)
    learner = DraftLearner(spec, 0, 1, "127.0.0.1", free_port())
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{learner.master[1]}", rank=0, world_size=1
    )
    torch.manual_seed(spec.seed)
    learner.device = device
    learner.target = load_target(spec.target_path, spec.aux_layer_ids, spec.target_dtype)
    learner.target.model.to(device)
    learner.drafter = learner._initial_drafter().to(device)
    learner.engine = PlainEngine(learner.drafter, spec)
    return learner


def _generate(learner, prompts, k: int, max_new: int, device) -> list:
    drafter = learner.drafter if k else None
    with torch.device(device):
        engine = SpeculativeEngine(learner.target, drafter, eos_ids(load_tokenizer("toy"), "toy"))
        return engine.generate(prompts, SamplingConfig(max_new, 0.0, k, 0), policy_version=0)


def _measured(fn, device) -> tuple[dict, float, float | None]:
    """fn()'s metrics, its seconds, and the peak CUDA memory (GiB) it reached."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = fn()
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
    return metrics, time.perf_counter() - t0, peak


def _summary(metrics: dict, before: torch.Tensor, learner, seconds: float, peak) -> dict:
    after = learner.drafter.fc.weight.detach()
    keep = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not k.startswith(("kl_", "acc_"))}
    ok = metrics.get("skipped_nonfinite") == 0 and math.isfinite(metrics.get("loss", math.nan))
    return {
        **keep,
        "weights_changed": not torch.equal(before, after),
        "ok": ok and not torch.equal(before, after),
        "seconds": seconds,
        "peak_gib": peak,
    }


def run(device: str, prompts: list[list[int]], max_new: int, dtype: str = "bfloat16") -> dict:
    """SFT step (TTT depth 7) then Draft-OPD step (whole-trajectory replay, toy-opd's learner settings)."""
    dev = torch.device(device)
    learner = build_learner(dev, dtype)
    try:
        out = {}
        responses = _generate(learner, prompts, 0, max_new, dev)
        examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in responses]
        before = learner.drafter.fc.weight.detach().clone()
        m, s, peak = _measured(lambda: learner.sft_step(examples, 7, 0.8, 384, 3e-4), dev)
        out["sft"] = _summary(m, before, learner, s, peak)

        buffer = ReplayBuffer(BufferConfig())
        buffer.add(_generate(learner, prompts, 4, max_new, dev))
        states = buffer.sample_trajectories(len(prompts), 0)
        cfg = LearnerConfig(lr=3e-4)
        before = learner.drafter.fc.weight.detach().clone()
        opd = lambda: learner.opd_step(
            states, 4, cfg.decay, cfg.max_seq_len, opd_loss_config(cfg), cfg.lr, cfg.replay_unit
        )  # noqa: E731
        m, s, peak = _measured(opd, dev)
        out["opd"] = {**_summary(m, before, learner, s, peak), "error_states": len(states)}
        return {"ok": out["sft"]["ok"] and out["opd"]["ok"], "dtype": dtype, **out}
    finally:
        torch.distributed.destroy_process_group()
