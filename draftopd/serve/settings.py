"""ServeSettings: what `draftopd serve` is told (the command line's flags), with the defaults in one place."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field

LOOPBACK_NAMES = ("localhost",)
# stock: from the responses, vLLM's per-request metrics (any model runner); full: the recording hook as well
# (drafted tokens and their scores, V1 pinned); off: nothing recorded
RECORD_MODES = ("stock", "full", "off")


@dataclass
class ServeSettings:
    """One serving session. Defaults suit the device it runs on: the toy target on CPU, a real one on a GPU."""

    target: str = "toy"  # the target model's directory (`toy`: the shipped toy target)
    drafter: str = "toy"  # the drafter's directory (or a shipped toy drafter's name)
    host: str = "127.0.0.1"  # loopback unless told otherwise; any other address needs an API key
    port: int = 8000
    api_key: str = ""  # bearer token of /v1/* and /draftopd/* (vLLM's own api-key mechanism for /v1)
    num_draft_tokens: int = 4  # K, fixed when vLLM starts
    learning: bool = False  # a learner beside the server trains the drafter on its traffic
    record: str = "stock"  # RECORD_MODES: how served requests are recorded (off: plain speculative serving)
    run_dir: str = "serve-run"  # versions, the saved buffer, the MLflow store, serving.json
    buffer_capacity: int = 4096  # trajectories kept in memory, oldest dropped first
    keep_text: bool = False  # the buffer keeps token ids only unless this is set
    retention_s: float | None = None  # trajectories older than this are dropped (None: kept until pushed out)
    keep_versions: int = 5  # drafter versions kept in the run directory
    rollback_window: int = 32  # requests of a new version before automatic rollback judges it
    rollback_margin: float = 0.02  # roll back when the new version's live tau < previous * (1 - margin)
    poll_s: float = 0.5  # how often finished requests' records are taken from vLLM's worker
    save_every_s: float = 60.0  # how often the buffer is saved to the run directory
    log_every_s: float = 10.0  # how often live tau goes to MLflow
    dtype: str = "auto"  # vLLM's dtype for the target and drafter, and the learner's copy (`auto`: serving_dtype)
    max_model_len: int = 2048
    memory_fraction: float | None = None  # vLLM's gpu_memory_utilization (None: serving_memory_fraction)
    seed: int = 0
    enforce_eager: bool = True  # no torch.compile: minutes less to start on CPU
    served_model_name: str = ""  # the model name clients send ('' : the target's directory name, `toy` for toy)
    aux_layer_ids: list[int] = field(default_factory=list)  # the learner's target layers ([]: the drafter's own)
    learner: dict = field(default_factory=dict)  # LearnerSettings overrides (field: value)


# On CPU vLLM's gpu_memory_utilization is the share of the machine's memory it reserves (the KV cache itself is
# VLLM_CPU_KVCACHE_SPACE); a fifth is what the toy target needs beside the learner on 24 GiB.
CPU_MEMORY_FRACTION = 0.2


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def serving_dtype(s: ServeSettings, cuda: bool | None = None) -> str:
    """The dtype vLLM serves in and the learner's torch copy loads in. `auto` is vLLM's rule, the target config's
    own dtype with a float32 target in bfloat16, on a GPU; on CPU a float32 target stays float32 (vLLM's rule would
    take the toy to bfloat16, and its served text is checked against the float32 target alone)."""
    if s.dtype != "auto":
        return s.dtype
    from draftopd.loading import resolve_target_path

    config = json.loads((resolve_target_path(s.target) / "config.json").read_text())
    own = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    if own == "float32" and (_cuda() if cuda is None else cuda):
        return "bfloat16"
    return own


def serving_memory_fraction(s: ServeSettings, cuda: bool | None = None) -> float | None:
    """vLLM's gpu_memory_utilization: as set, else vLLM's own default on a GPU (None: the flag is not passed) and
    CPU_MEMORY_FRACTION on CPU."""
    if s.memory_fraction is not None:
        return s.memory_fraction
    return None if (_cuda() if cuda is None else cuda) else CPU_MEMORY_FRACTION


def learner_loss(settings: ServeSettings) -> dict:
    """The serving learner's loss overrides (LearnerConfig fields). Stock records carry the accepted stream only,
    so with them the rejected stream is off (`rej_coef` 0) unless told otherwise (which `refusal` refuses)."""
    told = settings.learner.get("loss") or {}
    return ({"rej_coef": 0.0} if settings.record == "stock" else {}) | dict(told)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost` are loopback; a name or any other address is not."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refusal(settings: ServeSettings) -> str:
    """Why these settings must not start a server ('' when they may): a non-loopback address without a key."""
    if not is_loopback(settings.host) and not settings.api_key:
        return (
            f"--host {settings.host} is reachable from other machines: give an API key (--api-key KEY or "
            "DRAFTOPD_API_KEY) or bind 127.0.0.1"
        )
    if settings.record not in RECORD_MODES:
        return f"--record {settings.record}: one of {', '.join(RECORD_MODES)}"
    if settings.learning and settings.record == "off":
        return "--learning on needs the traffic recorded (--record stock or full): the learner trains on its records"
    rej = float(learner_loss(settings).get("rej_coef", 0.0))
    if settings.learning and settings.record == "stock" and rej > 0:
        return (
            f"--learner loss.rej_coef={rej:g} needs the rejected drafts' scores, which only --record full records "
            "(stock records carry the accepted stream)"
        )
    return ""
