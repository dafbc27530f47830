"""`draftopd bench engines`: the native engine against Hugging Face `generate` on the same target and prompts.

Compared, greedy, batch size 1, the same prompts and token budget:
* `hf`: `model.generate` of the target alone (the peer's baseline);
* `hf_prompt_lookup`: Hugging Face assisted generation with prompt-lookup
  drafting (`prompt_lookup_num_tokens`), the assisted mode that needs no draft
  model; an EAGLE-3 drafter reads the target's hidden states, which Hugging
  Face's `assistant_model` cannot supply, so it cannot use ours;
* `native`: this project's engine, target alone;
* `native_eagle3`: this project's engine with the EAGLE-3 drafter;
* `vllm`, `vllm_eagle3` (when a Python with vllm is given): stock vLLM, target
  alone and with the same drafter checkpoint as its EAGLE-3 speculator, each a
  stock vLLM job in its own process (`vllm_backend/stock.py`).
Every arm must produce the same tokens as `hf` (greedy decoding is exact), and
the report says whether it did. Speed is tokens per second over the whole set.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from draftopd.drafters import family
from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
from draftopd.eval.acceptance import acceptance_stats, speedup_note
from draftopd.vllm_backend.stock import LlmSettings, cut_at_eos, run_job


def _hf_generate(model, prompts, max_new_tokens: int, eos: list[int], **kwargs) -> tuple[list[list[int]], float]:
    outs = []
    start = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
                **kwargs,
            )
        outs.append(cut_at_eos(gen[0, len(p) :].tolist(), eos))
    return outs, time.perf_counter() - start


def _vllm_arm(python: str, job: dict) -> tuple[list[list[int]], float, float | None]:
    """One vLLM arm: job {target, drafter ("" for none), num_draft_tokens, prompts, eos, max_new_tokens}, decoded
    greedily at batch size 1 after one untimed prompt. Returns the outputs, seconds and tau (with a drafter)."""
    spec = family("eagle3").speculative_config(job["drafter"], job["num_draft_tokens"]) if job["drafter"] else None
    llm = LlmSettings(
        job["target"],
        speculative_config=spec,
        max_model_len=job.get("max_model_len", 2048),
        memory_fraction=job.get("memory_fraction", 0.2),
        enable_prefix_caching=False,  # every arm recomputes every prompt
        log_stats=True,  # the spec-decode counters tau is read from
    )
    batches = [
        {"index": i, "prompts": [p], "temperature": 0.0, "max_new_tokens": job["max_new_tokens"]}
        for i, p in enumerate(job["prompts"])
    ]
    *lines, done = run_job({"llm": asdict(llm), "eos": job["eos"], "batches": batches, "warmup": True}, python)
    outs = [line["outputs"][0][0] for line in lines]
    spec_counts = done["spec"]
    # tau as this project counts it: accepted drafts + 1 per verification step
    tau = 1 + spec_counts["accepted"] / spec_counts["drafts"] if spec_counts["drafts"] else None
    return outs, sum(line["seconds"] for line in lines), tau


def run_engines_bench(
    target,
    drafter,
    eos,
    prompts,
    max_new_tokens: int,
    k: int,
    lookup_tokens: int,
    vllm_python: str | None = None,
    paths: tuple[str, str] | None = None,
) -> dict:
    """Each arm decodes one prompt untimed first (allocator and kernel warm-up), then the whole set, timed.

    `vllm_python` with `paths` (target and drafter directories) adds the two vLLM arms.
    """
    _hf_generate(target.model, prompts[:1], 8, eos)
    _hf_generate(target.model, prompts[:1], 8, eos, prompt_lookup_num_tokens=lookup_tokens)
    for d in (None, drafter):
        SpeculativeEngine(target, d, eos).generate(prompts[:1], SamplingConfig(8, 0.0, k))
    arms = {}
    hf_out, secs = _hf_generate(target.model, prompts, max_new_tokens, eos)
    arms["hf"] = (hf_out, secs, None)
    out, secs = _hf_generate(target.model, prompts, max_new_tokens, eos, prompt_lookup_num_tokens=lookup_tokens)
    arms["hf_prompt_lookup"] = (out, secs, None)
    for name, d in (("native", None), ("native_eagle3", drafter)):
        engine = SpeculativeEngine(target, d, eos)
        start = time.perf_counter()
        trajs = [engine.generate([p], SamplingConfig(max_new_tokens, 0.0, k))[0] for p in prompts]
        arms[name] = ([t.output_ids for t in trajs], time.perf_counter() - start, trajs if d is not None else None)
    taus = {"native_eagle3": acceptance_stats(arms["native_eagle3"][2], k)["tau"]}
    if vllm_python:
        job = {"target": paths[0], "prompts": prompts, "eos": eos, "max_new_tokens": max_new_tokens}
        for name, d in (("vllm", ""), ("vllm_eagle3", paths[1])):
            outs, secs, tau = _vllm_arm(vllm_python, {**job, "drafter": d, "num_draft_tokens": k})
            arms[name] = (outs, secs, None)
            if tau is not None:
                taus[name] = tau
    base_tps = sum(len(o) for o in hf_out) / arms["hf"][1]
    report = {"num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "num_draft_tokens": k, "arms": {}}
    for name, (outs, secs, _) in arms.items():
        tps = sum(len(o) for o in outs) / secs
        row = {
            "tokens_per_s": tps,
            "speedup_vs_hf": tps / base_tps,
            "identical_to_hf": f"{sum(a == b for a, b in zip(outs, hf_out))}/{len(prompts)}",
        }
        if name in taus:
            row["tau"] = taus[name]
        report["arms"][name] = row
    return report


def format_engines(report: dict) -> str:
    lines = [f"{'arm':<18} {'tok/s':>8} {'vs hf':>7} {'same as hf':>10} {'tau':>6}", "-" * 53]
    for name, r in report["arms"].items():
        tau = f"{r['tau']:.3f}" if "tau" in r else "-"
        lines.append(
            f"{name:<18} {r['tokens_per_s']:>8.1f} {r['speedup_vs_hf']:>6.2f}x {r['identical_to_hf']:>10} {tau:>6}"
        )
    return "\n".join(lines + speedup_note())
