"""`draftopd plan`: what a recipe needs from each GPU, and how long it runs, before any job starts.

Per role (a rollout worker; a learner rank in the SFT phase and in the Draft-OPD phase) the peak memory at the
recipe's shapes, part by part, against the capacity of `cluster.gpu` (plan_specs.py); then the learner step time
and the rollout round time from FLOPs (and, for decoding, bytes read) at a stated utilisation, and the whole run's
wall-clock. `draftopd train` runs the same plan first and refuses a layout that cannot fit (`refusal`).

The memory model follows the code a run executes, tensor by tensor (tests/test_plan.py checks it against the
bytes autograd actually saves and the live optimizer's state): EAGLE-3 TTT with the linear-memory attention of
drafters/ttt_attention.py, the Draft-OPD loss with one teacher-forced target pass per trajectory and the rejected
stream read from the records, DeepSpeed's mixed-precision ZeRO layout, and vLLM's share of its GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftopd.plan_specs import (
    DrafterShape,
    GiB,
    GpuSpec,
    PlanError,
    TargetShape,
    drafter_shape,
    gpu_spec,
    shape_from_config,
    target_config,
)

MFU = 0.40
"""Share of the device's peak FLOP/s that training and prefill reach (a common figure for well-fed bf16 matmuls)."""
HBM_EFFICIENCY = 0.70
"""Share of the memory bandwidth that decoding reaches (each verification step reads the weights and the KV cache)."""
ASSUMED_TAU = 3.0
"""Tokens per verification step assumed for time and for the rejected stream's size (lower: slower, more rejected
drafts); drafters after SFT reach 3-5 at K=7 in the papers."""
ENGINE_START_S = 120.0
"""Seconds to (re)build a vLLM engine with CUDA graphs; paid twice per evaluation whose K differs from the rollout's."""
CUDA_RUNTIME_GIB = 1.5
"""CUDA context, NCCL communicators and allocator slack per GPU process."""
ZERO_BUCKET = 5e8
"""DeepSpeed's reduce bucket (elements; its default), held by ZeRO stages 1-3."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
F32 = 4


@dataclass
class Role:
    """One process's peak memory: `parts` in GiB, against `capacity_gib` (its device, or vLLM's share of it)."""

    name: str
    parts: dict[str, float]
    capacity_gib: float
    on_gpu: bool
    knobs: str = ""
    """What to change when it does not fit (the refusal's advice)."""
    note: str = ""

    @property
    def gib(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.gib <= self.capacity_gib

    def to_dict(self) -> dict:
        parts = {k: round(v, 3) for k, v in self.parts.items()}
        out = {"gib": round(self.gib, 2), "capacity_gib": round(self.capacity_gib, 2), "fits": self.fits}
        return {**out, "on_gpu": self.on_gpu, "parts": parts, **({"note": self.note} if self.note else {})}


@dataclass
class Plan:
    recipe: str
    device: GpuSpec
    roles: dict[str, Role]
    time: dict[str, float]
    assumptions: dict = field(default_factory=dict)
    split: dict | None = None
    """The GPUs' split between rollout workers and learner ranks that minimises the overlapped run."""

    @property
    def hours(self) -> float:
        return self.time["total_hours"]

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "gpu": self.device.name,
            "roles": {key: role.to_dict() for key, role in self.roles.items()},
            "hours": round(self.hours, 2),
            "time": {k: round(v, 3) for k, v in self.time.items()},
            "assumptions": self.assumptions,
            "split": self.split,
        }


# ---- memory: the tensors autograd keeps ------------------------------------------------------------------


def ttt_saved_bytes(d: DrafterShape, rows: int, seq: int, depth: int, e: int) -> float:
    """Bytes autograd saves for one EAGLE-3 TTT forward of `rows` sequences of `seq` tokens (decoder layer only).

    Per token per depth, as drafters/eagle3.py and ttt_attention.py compute it in dtype size `e`: four RMSNorm
    results before their weight, the MLP's and lm_head's inputs (6 H); the three trainable norms' fp32 inputs (3 H,
    in fp32 the fed-forward state is its own input: 2 H per depth and 1 once); the q/k/v input [embedding ; state]
    (2 H); q and the o_proj input (2 q-width); k and v at the kv heads (not repeated); the attention's fp32
    log-sum-exp per head; RoPE cos and sin; SwiGLU's gate, silu, up and product (4 I); three rsqrt. Once: the fc
    input (the target's aux states). Nothing grows with T squared.
    """
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    norms_fp32 = (3 if e < F32 else 2) * h * F32
    per_depth = 6 * h * e + norms_fp32 + 2 * h * e + 2 * q * e + 2 * kv * e + d.heads * F32
    per_depth += 2 * d.head_dim * e + 3 * F32 + 4 * d.intermediate * e
    once = d.num_aux * d.target_hidden * e + (h * F32 if e >= F32 else 0)
    return rows * (seq - 1) * (depth * per_depth + once)


def loss_saved_bytes(d: DrafterShape, rows: int, seq: int, depth: int, rejected_per_token: float = 0.0) -> float:
    """Bytes the loss saves: per depth the forward KL's fp32 drafter log-softmax and target probabilities over the
    draft vocabulary on the rows that have a label; the rejected stream's fp32 log-softmax at its tokens only."""
    n = seq - 1
    rows_by_depth = sum(max(n - k, 0) for k in range(depth))
    return rows * (rows_by_depth * 2 * d.draft_vocab * F32 + rejected_per_token * n * d.draft_vocab * F32)


def ttt_activation_bytes(*, hidden, intermediate, heads, kv_heads, draft_vocab, vocab, depth, seq_len, batch,
                         dtype_bytes) -> float:  # fmt: skip
    """What autograd saves for one SFT TTT loss forward at a drafter shape (head_dim hidden / heads, three aux
    states of the target's width): the figure scripts/gpu-check sets beside its measurement."""
    d = DrafterShape(hidden, intermediate, heads, kv_heads, hidden // heads, vocab, draft_vocab, hidden)
    return ttt_saved_bytes(d, batch, seq_len, depth, dtype_bytes) + loss_saved_bytes(d, batch, seq_len, depth)


def rejected_per_token(k: int, tau: float = ASSUMED_TAU) -> float:
    """Rejected-stream tokens per trajectory token: each step (tau tokens) scores its K + 1 - tau rejected drafts."""
    return max(k + 1 - tau, 0.0) / tau


# ---- memory per role -------------------------------------------------------------------------------------


def _optimizer_parts(trainable: int, e: int, zero: int, ranks: int, deepspeed: bool) -> dict[str, float]:
    """Gradients and Adam state. Mixed precision (DeepSpeed bf16): low-precision gradients, fp32 master weights,
    m and v (12 bytes a weight), an fp32 gradient of the partition at the step; ZeRO 1 partitions the optimizer
    state over the ranks, ZeRO 2 the gradients too. fp32: gradients and m, v (8 bytes), no master copy."""
    mixed = deepspeed and e < F32
    part = ranks if deepspeed and zero >= 1 else 1
    grads = trainable * e / (ranks if deepspeed and zero >= 2 else 1)
    if mixed:
        grads += trainable * F32 / part
    optimizer = trainable * ((F32 + 2 * F32) if mixed else 2 * e) / part
    return {"gradients": grads / GiB, "optimizer": optimizer / GiB}


def learner_role(name: str, cfg, t: TargetShape, d: DrafterShape, phase: dict, device: GpuSpec, on_gpu: bool):
    """A learner rank (or the SFT-only trainer) at one phase's shapes: `phase` has rows, seq, depth, rejected,
    knobs, ranks, deepspeed."""
    e = DTYPE_BYTES[cfg.target.dtype]
    rows, seq, depth, ranks = phase["rows"], phase["seq"], phase["depth"], phase["ranks"]
    zero = cfg.learner.zero_stage if phase["deepspeed"] else 0
    drafter = (d.trainable_params + d.frozen_params) * e + d.buffer_bytes
    if zero == 3:
        drafter -= d.trainable_params * e * (1 - 1 / ranks)
    parts = {"target weights": t.weight_bytes(e) / GiB, "drafter weights": drafter / GiB}
    parts.update(_optimizer_parts(d.trainable_params, e, zero, ranks, phase["deepspeed"]))
    parts["activations"] = ttt_saved_bytes(d, rows, seq, depth, e) / GiB
    loss = loss_saved_bytes(d, rows, seq, depth, phase["rejected"])
    target_logits = rows * seq * t.vocab * e  # the teacher's full-vocabulary logits, alive through the loss
    drafter_logits = 2 * rows * depth * (seq - 1) * d.draft_vocab * e  # [B, D, n, Vd], later its gradient
    working = 3 * rows * (seq - 1) * d.draft_vocab * F32  # one depth's fp32 restricted target, exp, difference
    parts["logits"] = (loss + target_logits + drafter_logits + working) / GiB
    if on_gpu:
        bucket = min(ZERO_BUCKET, d.trainable_params) * e if zero else 0
        attention_workspace = 4 * (1 << 26) * F32  # ttt_attention's backward: a few fp32 score blocks at once
        parts["runtime"] = CUDA_RUNTIME_GIB + (bucket + attention_workspace) / GiB
    return Role(name, parts, device.memory_gib, on_gpu, phase["knobs"])


def rollout_seq(cfg) -> int:
    """Tokens a rollout sequence may reach: the prompt budget (sft.max_seq_len - data.max_new_tokens, at least
    512) plus rollout.max_new_tokens and one block, capped by what the engine plans for."""
    prompt = max(cfg.sft.max_seq_len - cfg.data.max_new_tokens, 512)
    seq = prompt + cfg.rollout.max_new_tokens + cfg.rollout.num_draft_tokens + 1
    return min(seq, cfg.rollout.vllm_max_model_len) if cfg.rollout.backend == "vllm" else seq


def rollout_role(cfg, t: TargetShape, d: DrafterShape, device: GpuSpec, on_gpu: bool) -> Role:
    """A rollout worker: the target and drafter weights as served, the KV cache its batch needs, and (vLLM) the
    engine's profiled activations, against vLLM's share of the GPU (`rollout.vllm_memory_fraction`)."""
    r, e = cfg.rollout, DTYPE_BYTES[cfg.target.dtype]
    vllm = r.backend == "vllm"
    kv_token = t.kv_bytes_per_token(e) + 2 * d.kv_heads * d.head_dim * e  # the drafter's one layer too
    seq = rollout_seq(cfg)
    kv = kv_token * max(r.batch_size * seq, r.vllm_max_model_len if vllm else 0)  # vLLM admits a full-length one
    parts = {
        "target weights": t.weight_bytes(e, serving=vllm) / GiB,
        "drafter weights": d.trainable_params * e / GiB,  # vLLM shares the target's embedding
        "kv cache": kv / GiB,
    }
    if vllm:
        big = device.memory_gib >= 70 and "A100" not in device.name  # vLLM 0.32's LLM-class defaults
        tokens, seqs = (16384, 1024) if big else (8192, 256)
        act = tokens * (4 * t.hidden + 3 * max(t.intermediate, t.expert_intermediate)) * e + seqs * t.vocab * 2 * F32
        parts["activations"] = act / GiB
        parts["runtime"] = CUDA_RUNTIME_GIB if on_gpu else 0.0
        capacity = r.vllm_memory_fraction * device.memory_gib
        knobs = (
            f"lower rollout.batch_size ({r.batch_size}) or rollout.vllm_max_model_len ({r.vllm_max_model_len}), "
            f"or raise rollout.vllm_memory_fraction ({r.vllm_memory_fraction})"
        )
        note = f"vLLM's share: {r.vllm_memory_fraction} x {device.memory_gib:g} GiB"
        return Role("rollout worker", parts, capacity, on_gpu, knobs, note)
    parts["logits"] = r.batch_size * (r.num_draft_tokens + 1) * t.vocab * F32 * 2 / GiB
    knobs = f"lower rollout.batch_size ({r.batch_size}) or rollout.max_new_tokens ({r.max_new_tokens})"
    return Role("rollout worker", parts, device.memory_gib, on_gpu, knobs)


def _phases(cfg) -> dict[str, dict]:
    """The learner's shapes per phase: SFT (on the learner ranks in a Draft-OPD run, else in the driver's process)
    and Draft-OPD replay."""
    lc, s = cfg.learner, cfg.sft
    ranks = 1 if cfg.ray.in_process else lc.num_learners
    out = {}
    if s.epochs > 0 and cfg.opd.enabled:
        rows = math.ceil(s.batch_size / ranks)
        knobs = f"lower sft.batch_size ({s.batch_size}, {rows} per rank) or sft.max_seq_len ({s.max_seq_len})"
        out["learner_sft"] = dict(rows=rows, seq=s.max_seq_len, depth=s.ttt_depth, rejected=0.0, ranks=ranks,
                                  deepspeed=True, knobs=knobs, name="learner rank (SFT)")  # fmt: skip
    elif s.epochs > 0:
        knobs = f"lower sft.batch_size ({s.batch_size}) or sft.max_seq_len ({s.max_seq_len})"
        out["sft_trainer"] = dict(rows=s.batch_size, seq=s.max_seq_len, depth=s.ttt_depth, rejected=0.0, ranks=1,
                                  deepspeed=False, knobs=knobs, name="SFT trainer (driver process, CPU)")  # fmt: skip
    if cfg.opd.enabled:
        k = cfg.rollout.num_draft_tokens
        depth = lc.replay_depth or k
        rows = lc.batch_size * cfg.opd.accumulate_rounds
        rejected = rejected_per_token(k) if lc.rej_coef else 0.0
        knobs = f"lower learner.batch_size ({lc.batch_size}) or learner.max_seq_len ({lc.max_seq_len})"
        out["learner_opd"] = dict(rows=rows, seq=lc.max_seq_len, depth=depth, rejected=rejected, ranks=ranks,
                                  deepspeed=True, knobs=knobs, name="learner rank (Draft-OPD)")  # fmt: skip
    return out


# ---- time ------------------------------------------------------------------------------------------------


def train_step_flops(t: TargetShape, d: DrafterShape, rows: int, seq: int, depth: int) -> float:
    """One learner step on one rank: the target's teacher-forced forward, the drafter's TTT forward and backward
    (3x the forward's matmuls; attention once more, as backward recomputes its scores)."""
    tokens = rows * seq
    target = 2 * t.active_params * tokens + 2 * t.layers * t.heads * t.head_dim * rows * seq**2  # causal: half
    matmul = 2 * (d.layer_params * depth + d.num_aux * d.target_hidden * d.hidden) * tokens
    attention = 2 * d.heads * d.head_dim * rows * seq**2 * depth
    return target + 3 * matmul + 4 * attention


def decode_seconds(t: TargetShape, d: DrafterShape, batch: int, tokens: int, k: int, prompt: int, device, e: int):
    """One batch of `batch` prompts decoded to `tokens` new tokens by speculative decoding at K=k: the prefill
    (FLOPs), then tokens / ASSUMED_TAU verification steps, each the slower of its FLOPs (the target over
    batch x (k + 1) tokens, k drafter steps) and its bytes read (weights touched, the KV cache)."""
    prefill = 2 * t.active_params * batch * prompt / (device.peak_flops * MFU)
    steps = tokens / ASSUMED_TAU
    context = prompt + tokens / 2
    flops = 2 * t.active_params * batch * (k + 1) + 2 * k * d.layer_params * batch
    flops += 4 * t.layers * t.heads * t.head_dim * context * batch * (k + 1)
    touched = 1.0
    if t.experts:  # share of the experts a step's tokens route to
        touched = 1 - (1 - t.experts_active / t.experts) ** (batch * (k + 1))
    weights = t.weight_bytes(e, serving=True) - t.expert_params * e * (1 - touched)
    read = weights + k * d.layer_params * e + batch * context * t.kv_bytes_per_token(e)
    step = max(flops / (device.peak_flops * MFU), read / (device.bandwidth * HBM_EFFICIENCY))
    return prefill + steps * step


def run_time(cfg, t: TargetShape, d: DrafterShape, phases: dict, device: GpuSpec) -> dict[str, float]:
    """Seconds per learner step and rollout round, and the whole run's hours (SFT epochs over the pool, OPD rounds
    x learner steps, periodic evaluations with any engine rebuilds), at full-length sequences: an upper bound."""
    e, r, o = DTYPE_BYTES[cfg.target.dtype], cfg.rollout, cfg.opd
    speed = device.peak_flops * MFU
    out: dict[str, float] = {}
    sft_steps = opd_steps = 0
    for key, p in phases.items():
        step = train_step_flops(t, d, p["rows"], p["seq"], p["depth"]) / speed
        if key in ("learner_sft", "sft_trainer"):
            sft_steps = cfg.sft.epochs * max(1, cfg.data.num_train_prompts // cfg.sft.batch_size)
            out["sft_step_s"], out["sft_hours"] = step, step * sft_steps / 3600
        else:
            opd_steps = o.num_rounds // o.accumulate_rounds * o.steps_per_round
            out["opd_step_s"], out["opd_learner_hours"] = step, step * opd_steps / 3600
    prompt = max(cfg.sft.max_seq_len - cfg.data.max_new_tokens, 512)
    workers = max(r.num_workers, 1)
    if cfg.opd.enabled:
        chunks = math.ceil(r.prompts_per_round / (workers * r.batch_size))
        batch = min(r.batch_size, r.prompts_per_round)
        out["rollout_round_s"] = chunks * decode_seconds(
            t, d, batch, r.max_new_tokens, r.num_draft_tokens, prompt, device, e
        )
        out["opd_rollout_hours"] = o.num_rounds * out["rollout_round_s"] / 3600
        eval_k = cfg.eval.num_draft_tokens[0]
        evals = (sft_steps + opd_steps) // o.eval_every - sft_steps // o.eval_every + (2 if sft_steps else 1)
        prompts = math.ceil(o.num_eval_prompts / workers)
        one = math.ceil(prompts / r.batch_size) * decode_seconds(
            t, d, min(prompts, r.batch_size), cfg.eval.max_new_tokens, eval_k, prompt, device, e
        )
        rebuild = 2 * ENGINE_START_S if r.backend == "vllm" and eval_k != r.num_draft_tokens else 0.0
        out["evaluations"] = float(evals)
        out["eval_s"] = one + rebuild
        out["eval_hours"] = evals * (one + rebuild) / 3600
    keys = ("sft_hours", "opd_learner_hours", "opd_rollout_hours", "eval_hours")
    out["total_hours"] = sum(out.get(k, 0.0) for k in keys)
    if cfg.opd.enabled:
        # the evaluations ride on the rollout workers: in the overlapped loop they lengthen the rollout side
        rollout_s = (out["opd_rollout_hours"] + out["eval_hours"]) * 3600 / max(1, o.num_rounds)
        learner_s = out.get("opd_learner_hours", 0.0) * 3600 / max(1, o.num_rounds)
        overlapped = overlapped_seconds(o.num_rounds, rollout_s, learner_s) / 3600
        out["opd_overlapped_hours"] = overlapped
        out["total_overlapped_hours"] = out.get("sft_hours", 0.0) + overlapped
    return out


def overlapped_seconds(rounds: int, rollout_s: float, learner_s: float) -> float:
    """The Draft-OPD phase at opd.max_policy_lag 1 (opd/pipeline.py): the first round decodes alone, each later
    one beside the learning on the round before it, and the last round's learning runs alone."""
    if rounds <= 0:
        return 0.0
    return rollout_s + (rounds - 1) * max(rollout_s, learner_s) + learner_s


def best_split(cfg) -> dict | None:
    """The split of the recipe's GPUs between rollout workers and learner ranks that minimises the overlapped
    run, among those where every role fits; the global learner batch (learner.batch_size x ranks) is kept, so
    each rank's rows change with the rank count. None when the roles are not on GPUs."""
    import copy

    r, lc = cfg.rollout, cfg.learner
    if not cfg.opd.enabled or r.num_gpus_per_worker < 1 or lc.num_gpus_per_learner < 1 or cfg.ray.in_process:
        return None
    per_worker = int(r.num_gpus_per_worker)
    gpus = r.num_workers * per_worker + lc.num_learners
    rows = lc.batch_size * lc.num_learners
    best = None
    for workers in range(1, gpus // per_worker + 1):
        ranks = gpus - workers * per_worker
        if ranks < 1:
            break
        sub = copy.deepcopy(cfg)
        sub.rollout.num_workers, sub.learner.num_learners = workers, ranks
        sub.learner.batch_size = math.ceil(rows / ranks)
        plan = make_plan(sub, split=False)
        if not all(role.fits for role in plan.roles.values()):
            continue
        option = {"rollout_workers": workers, "learner_ranks": ranks, "learner_batch_size": sub.learner.batch_size,
                  "gpus": gpus, "hours_overlapped": plan.time["total_overlapped_hours"],
                  "hours_synchronous": plan.time["total_hours"]}  # fmt: skip
        if best is None or option["hours_overlapped"] < best["hours_overlapped"]:
            best = option
    return best


# ---- the plan --------------------------------------------------------------------------------------------


def make_plan(cfg, recipe: str = "", split: bool = True) -> Plan:
    """The plan of a loaded config; PlanError when the family or the target's shape is not known here. With
    `split`, also the split of its GPUs between the roles that minimises the overlapped run (`best_split`)."""
    if cfg.drafter.kind != "eagle3":
        raise PlanError(f"drafter.kind={cfg.drafter.kind}: the planner models EAGLE-3 drafters only")
    t = shape_from_config(target_config(cfg.target.path))
    d = drafter_shape(cfg, t)
    device = gpu_spec(cfg.cluster.gpu)
    if device is None:
        raise PlanError(f"cluster.gpu={cfg.cluster.gpu!r} is not one of CPU, {', '.join(_gpu_names())}")
    on_gpu_learner = cfg.learner.num_gpus_per_learner >= 1 and device.name != "CPU"
    roles: dict[str, Role] = {}
    if cfg.opd.enabled:
        on_gpu = cfg.rollout.num_gpus_per_worker >= 1 and device.name != "CPU"
        roles["rollout_worker"] = rollout_role(cfg, t, d, device, on_gpu)
    phases = _phases(cfg)
    for key, p in phases.items():
        on_gpu = on_gpu_learner and key != "sft_trainer"
        roles[key] = learner_role(p["name"], cfg, t, d, p, device if on_gpu else gpu_spec(""), on_gpu)
    assumptions = {
        "mfu": MFU,
        "hbm_efficiency": HBM_EFFICIENCY,
        "assumed_tau": ASSUMED_TAU,
        "engine_start_s": ENGINE_START_S,
        "cuda_runtime_gib": CUDA_RUNTIME_GIB,
        "sequences": "every sequence at its length cap (memory and time are upper bounds)",
        "target_params_b": round(t.params / 1e9, 3),
        "drafter_trainable_params_m": round(d.trainable_params / 1e6, 2),
    }
    plan = Plan(recipe, device, roles, run_time(cfg, t, d, phases, device), assumptions)
    if split:
        plan.split = best_split(cfg)
    return plan


def _gpu_names() -> list[str]:
    from draftopd.plan_specs import GPUS

    return list(GPUS)


def refusal(plan: Plan) -> str | None:
    """The one line `draftopd train` stops with when a GPU role cannot fit; None when all fit (CPU roles are
    reported, never refused: the host's memory is shared by every role and other work)."""
    for role in plan.roles.values():
        if role.on_gpu and not role.fits:
            where = role.note or f"an {plan.device.name}'s {plan.device.memory_gib:g}"
            return f"{role.name} needs {role.gib:.1f} GiB of {where} (draftopd plan shows the parts): {role.knobs}"
    return None


def format_plan(plan: Plan) -> str:
    """The plan as a table: one column per role, one row per part, then a verdict per role and the times."""
    roles = list(plan.roles.values())
    names = sorted({p for r in roles for p in r.parts}, key=_PART_ORDER.index)
    head = ["GiB".ljust(18)] + [r.name.rjust(26) for r in roles]
    lines = [
        f"plan for {plan.recipe or 'recipe'} on {plan.device.name} ({plan.device.memory_gib:g} GiB)",
        "".join(head),
    ]
    for part in names:
        cells = [f"{r.parts[part]:.2f}" if part in r.parts else "-" for r in roles]
        lines.append(part.ljust(18) + "".join(c.rjust(26) for c in cells))
    lines.append("total".ljust(18) + "".join(f"{r.gib:.2f}".rjust(26) for r in roles))
    lines.append("capacity".ljust(18) + "".join(f"{r.capacity_gib:.2f}".rjust(26) for r in roles))
    lines.append("")
    for r in roles:
        verdict = "fits" if r.fits else "DOES NOT FIT"
        where = r.note or f"{plan.device.name}, {plan.device.memory_gib:g} GiB"
        lines.append(f"{r.name}: {verdict}: {r.gib:.1f} of {r.capacity_gib:.1f} GiB ({where})")
    lines.append("")
    lines += _time_lines(plan)
    return "\n".join(lines)


_PART_ORDER = ["target weights", "drafter weights", "gradients", "optimizer", "activations", "logits", "kv cache",
               "runtime"]  # fmt: skip


def _time_lines(plan: Plan) -> list[str]:
    t, a = plan.time, plan.assumptions
    lines = [f"time at {a['mfu']:.0%} MFU, {a['hbm_efficiency']:.0%} of HBM bandwidth when decoding, tau "
             f"{a['assumed_tau']:g}, full-length sequences (upper bounds):"]  # fmt: skip
    if "sft_step_s" in t:
        lines.append(f"  SFT step {t['sft_step_s']:.2f} s; SFT {t['sft_hours']:.1f} h")
    if "opd_step_s" in t:
        lines.append(f"  Draft-OPD learner step {t['opd_step_s']:.2f} s; learner total {t['opd_learner_hours']:.1f} h")
        lines.append(f"  rollout round {t['rollout_round_s']:.1f} s; rollouts total {t['opd_rollout_hours']:.1f} h")
        lines.append(f"  {t['evaluations']:.0f} evaluations of {t['eval_s']:.0f} s: {t['eval_hours']:.1f} h")
    if "total_overlapped_hours" in t:
        lines.append(f"  whole run: {t['total_hours']:.1f} h synchronous (opd.max_policy_lag 0), "
                     f"{t['total_overlapped_hours']:.1f} h overlapped (opd.max_policy_lag 1)")  # fmt: skip
    else:
        lines.append(f"  whole run: {t['total_hours']:.1f} h")
    sp = plan.split
    if sp:
        lines.append(
            f"  split of the {sp['gpus']} GPUs for the overlapped run: {sp['rollout_workers']} rollout workers, "
            f"{sp['learner_ranks']} learner ranks (learner.batch_size {sp['learner_batch_size']} per rank): "
            f"{sp['hours_overlapped']:.1f} h overlapped, {sp['hours_synchronous']:.1f} h synchronous; every role fits"
        )
    return lines


# ---- the commands ----------------------------------------------------------------------------------------


def plan_command(recipe: str, overrides: list[str], json_path: str | None = None) -> None:
    """`draftopd plan`: the table on stdout, the plan as JSON in `json_path` when given."""
    import json
    from pathlib import Path

    from draftopd.config import ConfigError, load_config

    cfg = load_config(recipe, overrides)
    try:
        plan = make_plan(cfg, str(recipe))
    except PlanError as exc:
        raise ConfigError(str(exc)) from None
    print(format_plan(plan))
    if json_path:
        Path(json_path).write_text(json.dumps(plan.to_dict(), indent=2) + "\n")


def check_before_train(cfg, recipe: str) -> None:
    """`draftopd train`'s first step: a ConfigError (one line: role, figure, knob) when a GPU role cannot fit.

    A recipe the planner cannot size (another family, a target whose shape is unknown here) goes ahead: the run
    itself then reports what it finds."""
    from draftopd.config import ConfigError

    try:
        plan = make_plan(cfg, str(recipe))
    except (PlanError, OSError, ValueError, KeyError):
        return
    why = refusal(plan)
    if why:
        raise ConfigError(why)
