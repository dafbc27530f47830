"""The device check (`scripts/gpu-check`): what CPU tests cannot show, in one command on one GPU.

1. identity: the native engine's greedy output equals the target alone's, every drafter: token for token in
   fp32, and in bf16 up to near-ties of rounding (each one priced by the target's logits, then followed);
2. learner: one SFT step and one Draft-OPD learner step in bf16 on the device;
3. memory: one EAGLE-3 TTT step at the qwen3-8b drafter's shape and 4,608 tokens, beside the plan's figure.

It needs torch and transformers only (no Ray, DeepSpeed, MLflow, OmegaConf or vLLM): a machine with a
GPU and those two runs it from a checkout. Each section runs on its own, so one failure does not hide
the others; the report prints as it goes and the JSON (--out) holds every figure.
Exit status: 0 all passed, 1 an identity check failed (or could not run), 2 another section failed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path


def environment(device: str) -> dict:
    import torch
    import transformers

    env = {
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    if device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name()
        env["device_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def section(name: str, fn, report: dict) -> dict:
    """Run one section, timed; an exception becomes its `error` (with the traceback's last lines)."""
    print(f"\n== {name} ==", flush=True)
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:
        tail = traceback.format_exc().strip().splitlines()[-6:]
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tail}
        print("\n".join(tail))
    result["seconds"] = time.perf_counter() - t0
    report["sections"][name] = result
    print(f"-- {name}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']:.1f} s", flush=True)
    return result


def _identity_lines(result: dict) -> list[str]:
    lines = []
    for c in result["checks"]:
        head = f"  {c['dtype']:<9} batch {c['batch']:<2} {c['drafter']:<22}"
        if "identical" not in c:
            lines.append(f"{head} reference   {c['seconds']:6.1f} s")
        elif "error" in c:
            lines.append(f"{head} ERROR {c['error']}")
        else:
            verdict = "identical" if c["identical"] else f"MISMATCH {c['first_mismatch']}"
            if not c["identical"] and c["passed"]:
                margins = ", ".join(f"{x['target_margin']:+.4f}" for x in c["partings"])
                verdict = f"identical up to {len(c['partings'])} near-tie(s) (target margins {margins})"
            elif "partings" in c:
                verdict += f"; partings {c['partings']}"
            lines.append(
                f"{head} K={c['k']:<2} tau {c['tau']:.2f}  {c['tokens']} tokens  {verdict}  {c['seconds']:.1f} s"
            )
    return lines


def _learner_lines(result: dict) -> list[str]:
    lines = []
    for step in ("sft", "opd"):
        m = result.get(step, {})
        peak = f"peak {m['peak_gib']:.2f} GiB" if m.get("peak_gib") is not None else ""
        lines.append(
            f"  {step}: loss {m.get('loss', float('nan')):.4f}  grad_norm {m.get('grad_norm', float('nan')):.3f}"
            f"  weights changed {m.get('weights_changed')}  {m.get('seconds', 0):.2f} s  {peak}"
        )
    return lines


def _memory_lines(result: dict) -> list[str]:
    s = result["shape"]
    lines = [
        f"  shape: hidden {s['hidden']}, heads {s['heads']}/{s['kv_heads']}, draft vocab {s['draft_vocab']}, "
        f"vocab {s['vocab']}, depth {s['depth']}, T {s['seq_len']}, batch {s['batch']}"
    ]
    if "peak_gib" in result:
        lines.append(
            f"  peak {result['peak_gib']:.2f} GiB = resident {result['resident_gib']:.2f} GiB"
            f" + step {result['step_gib']:.2f} GiB"
        )
    lines.append(
        f"  saved for backward: {result['saved_activation_gib']:.3f} GiB;  step {result['step_seconds']:.1f} s"
    )
    plan = result["plan"]
    if plan["available"]:
        ratio = plan["measured_over_plan"]
        lines.append(f"  plan: {plan['activation_gib']:.3f} GiB saved for backward (measured / plan {ratio:.3f})")
    else:
        lines.append(f"  plan: {plan['note']}")
    return lines


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--out", default="gpu-check.json", help="JSON report path")
    p.add_argument("--quick", action="store_true", help="small shapes and few tokens (the CPU test)")
    p.add_argument("--prompts", type=int, default=0, help="toy prompts per identity check (default 8; quick 2)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="tokens per prompt (default 128; quick 24)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--only", default="identity,learner,memory", help="comma-separated sections to run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()  # the total counts the imports of torch and transformers too
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: pass --device cpu", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would bury the report
    import gpu_check_identity
    import gpu_check_learner
    import gpu_check_memory

    num_prompts = args.prompts or (2 if args.quick else 8)
    max_new = args.max_new_tokens or (24 if args.quick else 128)
    shape = gpu_check_memory.QUICK if args.quick else gpu_check_memory.QWEN3_8B
    report = {"environment": environment(args.device), "args": vars(args), "sections": {}}
    print("  ".join(f"{k}: {v}" for k, v in report["environment"].items()), flush=True)
    cache = {}

    def prompts() -> list[list[int]]:  # built inside the first section that needs them, so a failure is its own
        if "ids" not in cache:
            cache["ids"] = gpu_check_identity.toy_prompts(num_prompts, arithmetic_only=args.quick)
        return cache["ids"]

    sections = {
        "identity": (lambda: gpu_check_identity.run(args.device, prompts(), max_new), _identity_lines),
        "learner": (lambda: gpu_check_learner.run(args.device, prompts(), max_new), _learner_lines),
        "memory": (lambda: gpu_check_memory.run(args.device, shape), _memory_lines),
    }
    for name in args.only.split(","):
        fn, lines = sections[name]
        result = section(name, fn, report)
        if "error" not in result:
            print("\n".join(lines(result)), flush=True)
    report["total_seconds"] = time.perf_counter() - t0
    results = report["sections"]
    failed_identity = "identity" in results and not results["identity"]["ok"]
    status = 1 if failed_identity else 2 if not all(r["ok"] for r in results.values()) else 0
    report["exit_status"] = status
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\ntotal {report['total_seconds']:.1f} s; exit status {status}; report in {args.out}")
    return status
