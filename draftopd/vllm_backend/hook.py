"""The one place draftopd reaches inside vLLM: a worker extension that records verification steps.

Stock vLLM reports, per request, how many drafts each step accepted
(`per_request_spec_decode_metrics="detailed"`), but not which tokens were
drafted nor how the target scored them, and those are what the rejected stream
of Draft-OPD learns from. This extension (loaded with
`LLM(worker_extension_cls=EXTENSION)` and driven with `collective_rpc`) wraps
two engine internals of vLLM's v1 model runner:

* the runner's `_sample(logits, spec_decode_metadata)`: before the rejection
  sampler runs, the raw target logits at the draft positions give the target's
  log-probs of the drafted tokens (temperature 1, as the native engine records);
* the EAGLE proposer's `propose` with its model's `compute_logits`: the
  drafter's log-probs of the tokens it chose, kept per request until they are
  verified (one call per chain position for EAGLE-3; one call for the whole
  block, request-major, for one-pass drafting: DFlash, and PARD as vLLM's
  draft model with parallel drafting).

It also reloads the drafter's weights in place (vLLM's layerwise reload, which
redoes the CPU backend's weight repacking) without touching the target.
`check_internals` fails loudly, naming the vLLM version, when any of this is
missing; nothing else in draftopd imports vLLM internals.
"""

from __future__ import annotations

from collections import defaultdict

EXTENSION = "draftopd.vllm_backend.hook.RecordingExtension"
TESTED_VLLM = "0.32.0"
PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: the rejection sampler's filler after a rejected draft


class VllmInternalsError(RuntimeError):
    """The installed vLLM lacks an internal the recording hook relies on."""


def _fail(what: str) -> None:
    import vllm

    raise VllmInternalsError(
        f"vLLM {vllm.__version__} lacks {what}, which draftopd's recording hook relies on "
        f"(tested with vLLM {TESTED_VLLM}); use the native rollout backend (rollout.backend=native) "
        f"or install vllm=={TESTED_VLLM}"
    )


def check_internals() -> None:
    """Import-level check, run before an engine is built: every internal the hook wraps exists."""
    import inspect

    try:
        from vllm.model_executor.model_loader import reload
        from vllm.v1.sample import rejection_sampler
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as exc:
        _fail(f"a module ({exc.name})")
    if list(inspect.signature(GPUModelRunner._sample).parameters)[1:] != ["logits", "spec_decode_metadata"]:
        _fail("GPUModelRunner._sample(logits, spec_decode_metadata)")
    if getattr(rejection_sampler, "PLACEHOLDER_TOKEN_ID", None) != PLACEHOLDER:  # what `emitted` filters out
        _fail(f"vllm.v1.sample.rejection_sampler.PLACEHOLDER_TOKEN_ID = {PLACEHOLDER}")
    if not hasattr(SpecDecodeBaseProposer, "propose"):
        _fail("SpecDecodeBaseProposer.propose")
    fields = getattr(SpecDecodeMetadata, "__dataclass_fields__", {})
    for name in ("draft_token_ids", "num_draft_tokens", "target_logits_indices"):
        if name not in fields:
            _fail(f"SpecDecodeMetadata.{name}")
    for name in ("initialize_layerwise_reload", "finalize_layerwise_reload"):
        if not hasattr(reload, name):
            _fail(f"vllm.model_executor.model_loader.reload.{name}")


class RecordingExtension:
    """Mixed into vLLM's worker class; its methods run in the worker process via `collective_rpc`."""

    def draftopd_install(self) -> bool:
        """Wrap the runner's sampling step and the proposer; idempotent. Returns whether a drafter is present."""
        runner = self.model_runner
        if getattr(runner, "_draftopd", None) is not None:
            return runner._draftopd["has_drafter"]
        drafter = getattr(runner, "drafter", None)
        if not hasattr(runner, "_sample") or not hasattr(runner, "input_batch"):
            _fail("the model runner's _sample/input_batch")
        state = {"steps": defaultdict(list), "pending": {}, "captured": [], "has_drafter": drafter is not None}
        runner._draftopd = state
        _wrap_sample(runner, state)
        if drafter is not None:
            if getattr(drafter, "use_local_argmax_reduction", False):
                _fail("drafter logits (use_local_argmax_reduction is on)")
            _wrap_proposer(runner, drafter, state)
        return state["has_drafter"]

    def draftopd_records(self) -> dict:
        """Recorded steps, then forgotten: {req_id: [[drafts, target_lp, draft_lp, n_acc, emitted]]}, keyed by the
        request ids of the worker's input batch, which are those `LLM.enqueue` returns."""
        state = self.model_runner._draftopd
        out = {rid: steps for rid, steps in state["steps"].items()}
        state["steps"].clear()
        state["pending"].clear()
        return out

    def draftopd_reload_drafter(self, safetensors_bytes: bytes, version: int) -> int:
        """Load new drafter weights (checkpoint names, safetensors bytes) in place; returns the version now held."""
        import torch
        from safetensors.torch import load
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        runner = self.model_runner
        model = runner.drafter.model
        weights = load(safetensors_bytes)
        # The drafter borrows the target's embedding: hide it, or the reload would move the target's onto meta.
        inner = model.model
        shared = inner.embed_tokens
        inner.embed_tokens = torch.nn.Identity()
        try:
            initialize_layerwise_reload(model)
            model.load_weights(iter(weights.items()))
            finalize_layerwise_reload(model, runner.vllm_config.speculative_config.draft_model_config)
        finally:
            inner.embed_tokens = shared
        runner._draftopd_version = version
        return runner._draftopd_version


def _wrap_sample(runner, state: dict) -> None:
    import torch

    original = runner._sample

    def _sample(logits, spec_decode_metadata):
        meta = spec_decode_metadata
        if meta is None or logits is None:
            return original(logits, meta)
        # before the sampler, which may scale logits in place
        drafts = meta.draft_token_ids.long()
        rows = torch.log_softmax(logits[meta.target_logits_indices].float(), dim=-1)
        # -1 pads drafts the scheduler dropped (a request that ended while its drafts were in flight)
        target_lp = rows.gather(1, drafts.clamp_min(0)[:, None]).squeeze(1)
        target_lp = torch.where(drafts >= 0, target_lp, float("nan")).tolist()
        out = original(logits, meta)
        _record_step(runner, state, meta.num_draft_tokens, drafts.tolist(), target_lp, out.sampled_token_ids.tolist())
        return out

    runner._sample = _sample


def _record_step(runner, state, num_drafts, drafts, target_lp, sampled) -> None:
    req_ids = runner.input_batch.req_ids
    offset = 0
    for i, n in enumerate(num_drafts):
        if n == 0:
            continue
        rid = req_ids[i]
        emitted = [t for t in sampled[i] if t != PLACEHOLDER]
        draft_lp = state["pending"].pop(rid, None)
        state["steps"][rid].append(
            [drafts[offset : offset + n], target_lp[offset : offset + n], draft_lp, len(emitted) - 1, emitted]
        )
        offset += n


def _wrap_proposer(runner, drafter, state: dict) -> None:
    import torch

    model = drafter.model
    compute_logits = model.compute_logits
    propose = drafter.propose

    def capture_logits(hidden_states):
        logits = compute_logits(hidden_states)
        state["captured"].append(logits)
        return logits

    def recording_propose(*args, **kwargs):
        state["captured"].clear()
        out = propose(*args, **kwargs)
        ids = out[0] if isinstance(out, tuple) else out
        captured, state["captured"] = state["captured"], []
        if ids.dim() != 2:
            return out
        batch, k = ids.shape
        if len(captured) == k:  # a chain (EAGLE-3): one call per position, rows = requests
            logits = torch.stack([c[:batch] for c in captured], 1)
        elif len(captured) == 1 and captured[0].shape[0] == batch * k:  # one pass (DFlash): request-major rows
            logits = captured[0].view(batch, k, -1)
        else:  # no reading of these logits is known to be right: record nothing, so the engine refuses the step
            return out
        lp = torch.log_softmax(logits.float(), -1).gather(2, ids[..., None].long()).squeeze(2).tolist()
        req_ids = runner.input_batch.req_ids
        for i in range(batch):
            state["pending"][req_ids[i]] = lp[i]
        return out

    model.compute_logits = capture_logits
    drafter.propose = recording_propose
