"""`draftopd bench rollout`: what the recording hook costs, and how the vLLM backend compares with the native one.

Three arms decode the same rollout prompts (a rollout worker's batch, greedy, K
drafts): the native engine; stock vLLM speculative decoding (the drafter as its
EAGLE-3 speculator, nothing recorded); and the vLLM backend with the recording
hook and per-request step metrics, returning full Trajectory records. Each vLLM
arm runs in its own process (this module's `__main__`, started by
vllm_backend/stock.py's `run_job`), warms up once and is timed over `repeats`
passes; tokens/s is the median pass. The report gives the hook's overhead as a
ratio (hooked / stock tokens/s) and checks all three emit the same tokens.
"""

from __future__ import annotations

import statistics
import sys
import time


def _timed_passes(generate, repeats: int) -> tuple[list, list[float]]:
    generate()  # warm-up
    passes, outs = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        outs = generate()
        passes.append(time.perf_counter() - start)
    return outs, passes


def vllm_arm(job: dict) -> dict:
    """One vLLM arm: stock (record false) or with the recording hook (record true)."""
    from draftopd.engine.speculative import SamplingConfig
    from draftopd.vllm_backend.engine import VllmEngine

    engine = VllmEngine(job["target"], job["drafter"], job["eos"], job["k"], record=job["record"])
    sampling = SamplingConfig(job["max_new_tokens"], 0.0, job["k"])
    batch = job["batch_size"]

    def generate():
        out = []
        for i in range(0, len(job["prompts"]), batch):
            out += engine.generate(job["prompts"][i : i + batch], sampling)
        return out

    trajs, passes = _timed_passes(generate, job["repeats"])
    engine.shutdown()
    return {
        "outputs": [t.output_ids for t in trajs],
        "seconds": passes,
        "num_steps": sum(len(t.steps) for t in trajs),
    }


def _run_vllm_arm(job: dict) -> dict:
    from draftopd.vllm_backend.stock import run_job

    return run_job(job, module="draftopd.bench.rollout")[-1]


def run_rollout_bench(
    target,
    drafter,
    drafter_dir: str,
    target_dir: str,
    eos,
    prompts,
    k: int,
    max_new_tokens: int,
    batch_size: int = 8,
    repeats: int = 3,
) -> dict:
    from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine

    sampling = SamplingConfig(max_new_tokens, 0.0, k)

    def native():
        out = []
        for i in range(0, len(prompts), batch_size):
            out += SpeculativeEngine(target, drafter, eos).generate(prompts[i : i + batch_size], sampling)
        return out

    trajs, passes = _timed_passes(native, repeats)
    arms = {"native": {"outputs": [t.output_ids for t in trajs], "seconds": passes}}
    job = dict(
        target=target_dir,
        drafter=drafter_dir,
        eos=eos,
        k=k,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        repeats=repeats,
    )
    arms["vllm_stock"] = _run_vllm_arm({**job, "record": False})
    arms["vllm_recording"] = _run_vllm_arm({**job, "record": True})
    report = {"num_prompts": len(prompts), "batch_size": batch_size, "num_draft_tokens": k, "repeats": repeats}
    for name, arm in arms.items():
        tokens = sum(len(o) for o in arm["outputs"])
        arm["tokens"] = tokens
        arm["tokens_per_s"] = tokens / statistics.median(arm["seconds"])
        arm["same_tokens_as_native"] = sum(a == b for a, b in zip(arm.pop("outputs"), [t.output_ids for t in trajs]))
        report[name] = arm
    report["hook_overhead_ratio"] = arms["vllm_recording"]["tokens_per_s"] / arms["vllm_stock"]["tokens_per_s"]
    report["recording_vs_native_ratio"] = arms["vllm_recording"]["tokens_per_s"] / arms["native"]["tokens_per_s"]
    return report


def format_rollout(report: dict) -> str:
    n = report["num_prompts"]
    lines = [f"{'arm':<16} {'tokens/s':>9} {'same tokens as native':>22}"]
    for name in ("native", "vllm_stock", "vllm_recording"):
        r = report[name]
        lines.append(f"{name:<16} {r['tokens_per_s']:>9.1f} {r['same_tokens_as_native']:>19}/{n}")
    lines.append(
        f"recording / stock vLLM: {report['hook_overhead_ratio']:.3f}x; "
        f"recording / native: {report['recording_vs_native_ratio']:.3f}x"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    from draftopd.vllm_backend.stock import worker_main

    sys.exit(worker_main(sys.argv[1:], lambda job, emit: emit(vllm_arm(job))))
