"""Commands that read and write checkpoints and data: `export` (with the command that serves the result),
`inspect`, `prepare-data`, and the toy models' `make-toy-target` / `make-toy-draft-lm`."""

from __future__ import annotations

import json
from pathlib import Path

from draftopd.cli.common import SHIPPED, add_command, at_least_one, resolve_drafter_path

PLACEHOLDER_TARGET = "TARGET"  # in the printed serving command when --target is not given


def register(sub) -> None:
    p = add_command(
        sub,
        "export",
        cmd_export,
        "write a drafter in a serving layout (vllm, sglang, speculators); print the command serving it",
        "write a drafter in a layout vLLM/SGLang (vllm) or speculators serve as is, and print the command that "
        "serves it (vllm serve ... --speculative-config, or SGLang's launch_server flags)",
    )
    p.add_argument(
        "--drafter", required=True, type=resolve_drafter_path, help=f"drafter directory (any layout), or {SHIPPED}"
    )
    p.add_argument("--format", choices=["vllm", "sglang", "speculators"], default="vllm", help="serving layout")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--target",
        default="",
        help=f"the target model directory (or 'toy') named in the printed serving command (empty: "
        f"--verifier, else {PLACEHOLDER_TARGET})",
    )
    p.add_argument("--verifier", default="", help="speculators: the target model's name or path (empty: --target)")
    p.add_argument(
        "--num-draft-tokens", type=at_least_one, default=4, help="draft tokens per step (speculators, serving command)"
    )

    p = add_command(
        sub, "inspect", cmd_inspect, "a drafter checkpoint's family, layout, conventions, shapes and fit to a target"
    )
    p.add_argument("ckpt", help="drafter directory (any published layout)")
    p.add_argument("--target", default="", help="target model (name or path) to check the drafter against")

    _prepare_data_args(sub)

    p = add_command(sub, "make-toy-target", cmd_make_toy_target, "rebuild the toy target model from scratch")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--minutes", type=float, default=35.0, help="training time budget")
    p.add_argument("--seed", type=int, default=0, help="training seed")
    p = add_command(
        sub,
        "make-toy-draft-lm",
        cmd_make_toy_draft_lm,
        "train the toy autoregressive draft LM (PARD's starting point) on the toy corpus",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--minutes", type=float, default=20.0, help="training time budget")
    p.add_argument("--target", default="toy", help="target whose tokenizer the draft LM uses")
    p.add_argument("--seed", type=int, default=0, help="training seed")


def _prepare_data_args(sub) -> None:
    p = add_command(
        sub,
        "prepare-data",
        cmd_prepare_data,
        "a prompt pool from local dataset copies, with the target's own responses (resumable)",
        "a prompt pool from local ShareGPT/UltraChat/GSM8K/MATH/AoPS/CodeAlpaca copies, mixed, deduplicated, "
        "split, with the target's regenerated responses, in shards with a manifest (resumable)",
    )
    p.add_argument("--out", required=True, help="output folder (rerunning with the same flags resumes it)")
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="KIND[=PATH][:WEIGHT]",
        help="sharegpt, ultrachat, chat, gsm8k, math, aops, codealpaca; PATH a file or folder (omitted: the HF "
        "datasets cache); WEIGHT its share of the mix (1 unless given); repeat per source",
    )
    p.add_argument("--mix", default=None, help="YAML mix file: sources: [{name, kind, path, weight}, ...]")
    p.add_argument("--target", default="toy", help="target model directory, or 'toy'")
    p.add_argument("--num-prompts", type=int, default=0, help="training prompts, split by weight (0: every row)")
    p.add_argument("--num-heldout", type=int, default=0, help="held-out prompts, split by weight, disjoint")
    p.add_argument("--no-thinking", action="store_true", help="render prompts with thinking off")
    p.add_argument("--backend", choices=["native", "vllm"], default="native", help="engine writing the responses")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length cap of each response")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="mixing, split and sampling seed")
    p.add_argument("--batch-size", type=int, default=8, help="native: prompts decoded together")
    p.add_argument("--shard-size", type=int, default=1000, help="rows per shard")
    p.add_argument("--shard-format", choices=["jsonl", "parquet"], default="jsonl", help="shard file format")
    p.add_argument("--max-malformed-fraction", type=float, default=0.05, help="per source; above it is an error")
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="skip longer rendered prompts (0: no limit)")
    p.add_argument("--dtype", default="float32", help="target dtype")
    p.add_argument("--vllm-python", default=None, help="vllm: a Python with vllm and draftopd (empty: this one)")
    p.add_argument("--memory-fraction", type=float, default=0.2, help="vllm: gpu_memory_utilization")
    p.add_argument("--vllm-eager", action="store_true", help="vllm: enforce_eager (no compile: faster start)")


def cmd_prepare_data(args) -> None:
    from draftopd.data.prepare import PrepareSettings, prepare_data
    from draftopd.data.sources import parse_source_arg, read_mix_file

    sources = (read_mix_file(args.mix) if args.mix else []) + [parse_source_arg(a) for a in args.source]
    settings = PrepareSettings(
        out=args.out,
        sources=sources,
        target=args.target,
        num_prompts=args.num_prompts,
        num_heldout=args.num_heldout,
        enable_thinking=not args.no_thinking,
        backend=args.backend,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        shard_format=args.shard_format,
        max_malformed_fraction=args.max_malformed_fraction,
        max_prompt_tokens=args.max_prompt_tokens,
        dtype=args.dtype,
        vllm_python=args.vllm_python,
        memory_fraction=args.memory_fraction,
        vllm_eager=args.vllm_eager,
    )
    prepare_data(settings)
    print(f"pool: {Path(args.out) / 'manifest.json'}")


def cmd_export(args) -> None:
    from draftopd.drafters import export_drafter, read_raw, serving_command
    from draftopd.loading import resolve_target_path

    if not (Path(args.drafter) / "config.json").is_file():
        raise FileNotFoundError(f"drafter {args.drafter}: no config.json")
    target = str(resolve_target_path(args.target).resolve()) if args.target else ""
    kind, _ = read_raw(args.drafter)
    out = export_drafter(args.drafter, args.format, args.out, args.verifier or target, args.num_draft_tokens)
    print(f"{args.format} checkpoint: {out}")
    command = serving_command(
        kind, args.format, target or args.verifier or PLACEHOLDER_TARGET, out, args.num_draft_tokens
    )
    print(f"serve it with:\n{command}")


def cmd_inspect(args) -> None:
    from draftopd.drafters import inspect_checkpoint
    from draftopd.loading import load_target

    target = load_target(args.target) if args.target else None
    print("\n".join(inspect_checkpoint(args.ckpt, target)))


def cmd_make_toy_target(args) -> None:
    from draftopd.toy.target import ToyTargetSpec, make_toy_target

    report = make_toy_target(args.out, ToyTargetSpec(minutes=args.minutes, seed=args.seed))
    print(json.dumps(report, indent=2))


def cmd_make_toy_draft_lm(args) -> None:
    from draftopd.toy.draft_lm import ToyDraftLMSpec, make_toy_draft_lm

    report = make_toy_draft_lm(args.out, args.target, ToyDraftLMSpec(minutes=args.minutes, seed=args.seed))
    print(json.dumps(report, indent=2))
