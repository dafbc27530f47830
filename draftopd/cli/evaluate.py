"""Commands that decode and measure: `generate`, `eval`, `diagnose` (attention drift) and `rejections` (what a
drafter gets wrong, from a Draft-OPD run's replay buffer or the traffic `draftopd serve` recorded)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftopd.cli.common import SHIPPED, add_command, at_least_one, resolve_drafter_path
from draftopd.data.eval_sets import EvalSetError
from draftopd.reports import write_json


def register(sub) -> None:
    p = add_command(sub, "generate", cmd_generate, "decode prompts, with or without a drafter, writing step records")
    _sampling_args(p)
    p.add_argument(
        "--drafter",
        default=None,
        type=resolve_drafter_path,
        help=f"drafter directory, or {SHIPPED} (omit: target alone)",
    )
    p.add_argument("--out", required=True, help="output JSONL")

    p = add_command(sub, "eval", cmd_eval, "acceptance length and speedup of a drafter on prompt files or named sets")
    _sampling_args(p, multi_k=True)
    p.add_argument(
        "--drafter", required=True, type=resolve_drafter_path, help=f"drafter directory (any family), or {SHIPPED}"
    )
    p.add_argument(
        "--sets",
        nargs="+",
        default=[],
        help="named sets: toy, toy-arithmetic, toy-code, mt_bench, gsm8k, math500, humaneval, mbpp, alpaca, "
        "cnn_dm; NAME=PATH reads a local copy (file or folder), 'all' takes every set that is available",
    )
    p.add_argument("--robustness", action="store_true", help="also run template and long-context variants")
    p.add_argument("--long-context-tokens", type=int, default=384, help="padding of the long-context variant")
    p.add_argument("--json", required=True, help="write the report here (plots go to a folder beside it)")
    p.add_argument("--mlflow", default=None, help="log the results to MLflow: a run directory (its store) to use")
    p.add_argument("--mlflow-run", default=None, help="append to this MLflow run (say, the training run)")

    p = add_command(
        sub, "diagnose", cmd_diagnose, "attention drift and state norm along a drafter's chain, drafters side by side"
    )
    p.add_argument(
        "--drafter",
        nargs="+",
        required=True,
        type=resolve_drafter_path,
        help=f"EAGLE-3 drafter directories, or {SHIPPED}",
    )
    p.add_argument("--target", default="toy", help="target model directory, or 'toy'")
    p.add_argument("--prompts", default="toy", help="JSONL prompt file, or 'toy' for the toy held-out set")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts whose target responses are analysed")
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the target responses analysed")
    p.add_argument("--depth", type=at_least_one, default=7, help="chain depth")
    p.add_argument("--aux-layer-ids", type=int, nargs="*", default=None, help="target layers the drafter reads")
    p.add_argument("--json", required=True, help="write the profiles here (and a PNG beside it)")

    p = add_command(
        sub,
        "rejections",
        cmd_rejections,
        "which draft tokens, offsets, contexts and domains get rejected, from a run's replay buffer or served traffic",
    )
    p.add_argument(
        "run_dir",
        help="a Draft-OPD run directory (the buffer of its newest checkpoint is read) or a draftopd serve run "
        "directory (its saved traffic buffer, both slices)",
    )
    p.add_argument(
        "--target",
        default=None,
        help="serving runs: the target (directory or 'toy') whose tokenizer decodes the traffic (default: the one "
        "the run's MLflow run names)",
    )
    p.add_argument("--top", type=int, default=20, help="rows of the ranked tables (tokens, pairs, contexts) printed")
    p.add_argument("--context", type=int, default=3, help="tokens before the rejection point that make a context")
    p.add_argument("--json", default=None, help="write the whole report (every row) here")
    p.add_argument("--log-mlflow", action="store_true", help="log the tables to the run's MLflow run, as tables")


def _sampling_args(p: argparse.ArgumentParser, multi_k: bool = False) -> None:
    p.add_argument("--target", default="toy", help="target model directory, or 'toy'")
    p.add_argument(
        "--prompts",
        required=not multi_k,
        help="JSONL prompt file ({'prompt': ...} or {'messages': [...]}), or 'toy' for the toy held-out set",
    )
    p.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt, at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    if multi_k:
        p.add_argument(
            "--num-draft-tokens", type=at_least_one, nargs="+", default=[4], help="one or more K (drafts per step)"
        )
    else:
        p.add_argument("--num-draft-tokens", type=at_least_one, default=4, help="K, drafts per step (with --drafter)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-thinking", action="store_true", help="render prompts with thinking off")
    p.add_argument("--aux-layer-ids", type=int, nargs="*", default=None, help="target layers the drafter reads")
    p.add_argument("--dtype", default="float32", help="target and drafter dtype")
    p.add_argument(
        "--backend",
        choices=["native", "vllm"],
        default="native",
        help="native: draftopd's torch engine; vllm: stock vLLM with the drafter as its EAGLE-3 speculator",
    )
    p.add_argument("--memory-fraction", type=float, default=0.2, help="vllm: gpu_memory_utilization, all engines")


def _engines(args, eos: list[int], num_engines: int):
    """The EngineSet of --backend: native loads the torch models here; vLLM loads them in its own engines."""
    from draftopd.drafters import load_drafter
    from draftopd.eval.engines import EngineSet
    from draftopd.loading import load_target

    if args.backend == "vllm":
        return EngineSet(
            "vllm",
            eos,
            target_path=args.target,
            drafter_path=args.drafter or "",
            num_engines=num_engines,
            dtype=args.dtype,
            memory_fraction=args.memory_fraction,
        )
    target = load_target(args.target, args.aux_layer_ids, args.dtype)
    drafter = load_drafter(args.drafter, target) if args.drafter else None
    return EngineSet("native", eos, target=target, drafter=drafter)


def cmd_generate(args) -> None:
    import json

    from tqdm import tqdm

    from draftopd.data.prompts import encode_chats, read_prompt_file, toy_prompts
    from draftopd.eval.acceptance import timed_generate
    from draftopd.loading import eos_ids, load_tokenizer
    from draftopd.messages import SamplingConfig

    # Prompts first, so a bad prompt file fails before any model is loaded.
    chats = toy_prompts("held_out", args.num_prompts or 48) if args.prompts == "toy" else read_prompt_file(args.prompts)
    chats = chats[: args.num_prompts] if args.num_prompts else chats
    tokenizer = load_tokenizer(args.target)
    prompts = encode_chats(tokenizer, chats, enable_thinking=not args.no_thinking)
    eos = eos_ids(tokenizer, args.target)
    k = args.num_draft_tokens if args.drafter else 0
    cfg = SamplingConfig(args.max_new_tokens, args.temperature, k, args.seed)
    engines = _engines(args, eos, 1)
    try:
        with tqdm(total=len(prompts), desc="generate", unit="prompt") as bar:
            run = timed_generate(engines.get(k), prompts, cfg, args.batch_size, bar)
    finally:
        engines.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for t in run.trajectories:
            row = {
                "prompt_index": t.prompt_index,
                "text": tokenizer.decode(t.output_ids, skip_special_tokens=False),
                **t.to_dict(),
            }
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(run.trajectories)} lines to {out} ({run.num_tokens} tokens, {run.tokens_per_s:.1f} tokens/s)")


def _eval_sets(args) -> list:
    from draftopd.data.eval_sets import EvalSet, available_sets, load_set
    from draftopd.data.prompts import read_prompt_file

    limit = args.num_prompts or None
    given = dict(item.split("=", 1) for item in args.sets if "=" in item)
    names = [item.split("=", 1)[0] for item in args.sets]
    if "all" in names:
        names = available_sets(given)
    sets = [load_set(n, given.get(n), limit, args.seed) for n in dict.fromkeys(names)]
    if args.prompts == "toy":
        sets.insert(0, load_set("toy", None, limit or 48, args.seed))
    elif args.prompts:
        chats = read_prompt_file(args.prompts)[:limit]
        sets.insert(0, EvalSet("prompts", [[chat] for chat in chats], args.prompts))
    if not sets:
        raise EvalSetError("nothing to evaluate: give --prompts or --sets")
    return sets


def cmd_eval(args) -> None:
    from tqdm import tqdm

    from draftopd.eval.suite import VARIANTS, SuiteSettings, format_suite_table, num_generations, plot_suite, run_suite
    from draftopd.loading import eos_ids, load_tokenizer

    sets = _eval_sets(args)  # before any model is loaded: a bad set fails fast
    tokenizer = load_tokenizer(args.target)
    eos = eos_ids(tokenizer, args.target)
    engines = _engines(args, eos, 1 + len(args.num_draft_tokens))
    settings = SuiteSettings(
        args.num_draft_tokens,
        args.temperature,
        args.max_new_tokens,
        args.batch_size,
        args.seed,
        not args.no_thinking,
        VARIANTS if args.robustness else ("clean",),
        args.long_context_tokens,
    )
    try:
        with tqdm(total=num_generations(sets, settings), desc="eval", unit="seq") as bar:
            reports = run_suite(engines, tokenizer, sets, settings, bar)
    finally:
        engines.close()
    out = Path(args.json)
    write_json(out, reports)
    plots = plot_suite(reports, out.with_name(out.stem + "_plots"))
    print(format_suite_table(reports))
    print(f"report: {out}; plots: {', '.join(str(p) for p in plots)}")
    if args.mlflow:
        from draftopd.eval.suite import log_to_mlflow

        name = f"eval-{Path(args.drafter).name}"
        run_id = log_to_mlflow(reports, [out, *plots], Path(args.mlflow), args.mlflow_run, name)
        print(f"MLflow run {run_id} in {args.mlflow}")


def cmd_diagnose(args) -> None:
    import torch

    from draftopd.data.prompts import encode_chats, read_prompt_file, toy_prompts
    from draftopd.drafters import load_drafter
    from draftopd.engine.speculative import SpeculativeEngine
    from draftopd.eval.diagnose import check_diagnosable, drift_profile, format_profiles, plot_profiles
    from draftopd.loading import eos_ids, load_target, load_tokenizer
    from draftopd.messages import SamplingConfig
    from draftopd.sft.trainer import SFTExample

    chats = toy_prompts("held_out", args.num_prompts) if args.prompts == "toy" else read_prompt_file(args.prompts)
    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, args.aux_layer_ids)
    drafters = {Path(d).name: load_drafter(d, target) for d in args.drafter}
    for path, drafter in zip(args.drafter, drafters.values(), strict=True):
        check_diagnosable(path, drafter)  # before the target's responses are decoded
    prompts = encode_chats(tokenizer, chats[: args.num_prompts])
    engine = SpeculativeEngine(target, None, eos_ids(tokenizer, args.target))
    trajs = engine.generate(prompts, SamplingConfig(args.max_new_tokens))
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs]
    torch.manual_seed(0)
    profiles = {name: drift_profile(target, d, examples, args.depth) for name, d in drafters.items()}
    out = Path(args.json)
    write_json(out, profiles)
    plot_profiles(profiles, out.with_suffix(".png"))
    print(format_profiles(profiles))
    print(f"profiles: {out}; plot: {out.with_suffix('.png')}")


def cmd_rejections(args) -> None:
    from draftopd.eval.rejections import is_serving_run

    if is_serving_run(args.run_dir):
        return _serving_rejections(args)
    from draftopd.config import load_config
    from draftopd.eval.rejections import format_report, log_report, prompt_domains, read_run_buffer, rejection_report
    from draftopd.loading import load_tokenizer
    from draftopd.tracking import Tracker

    ckpt, state, driver_state = read_run_buffer(args.run_dir)  # before any tokenizer: no buffer fails fast
    cfg = load_config(Path(args.run_dir) / "config.yaml")
    d = cfg.data
    domains = prompt_domains(d.prompts, "train", d.num_train_prompts, cfg.run.seed)
    report = {"run_dir": str(args.run_dir), "checkpoint": str(ckpt), "policy_version": driver_state["policy_version"]}
    report |= rejection_report(state, load_tokenizer(cfg.target.path), domains, args.context)
    print(f"{ckpt} (policy version {report['policy_version']})")
    print(format_report(report, args.top))
    if args.json:
        write_json(Path(args.json), report)
        print(f"report: {args.json}")
    if args.log_mlflow:
        tracker = Tracker(args.run_dir, cfg.tracking.experiment, tracking_uri=cfg.tracking.tracking_uri or None)
        tracker.attach(driver_state["mlflow_run_id"])
        paths = log_report(report, tracker, f"rejections/{ckpt.name}")
        print(f"MLflow run {tracker.run_id}: {', '.join(paths)}")


def _serving_rejections(args) -> None:
    """`rejections` on a `draftopd serve` run directory: its saved traffic buffer, by drafter version and domain;
    --log-mlflow logs to the newest serving session's MLflow run."""
    from draftopd.eval import rejections as rj
    from draftopd.loading import load_tokenizer
    from draftopd.tracking import Tracker

    run = Path(args.run_dir)
    records, stats = rj.read_traffic(run)  # before any tokenizer: no traffic fails fast
    mlflow_run = rj.serving_mlflow_run(run) if args.log_mlflow or not args.target else None
    if args.log_mlflow and mlflow_run is None:
        raise FileNotFoundError(f"{run} holds no MLflow run of draftopd serve to log to")
    target = args.target or (mlflow_run[1].get("target") if mlflow_run else None)
    if not target:
        raise FileNotFoundError(f"{run}: no MLflow run of draftopd serve names its target; give --target DIR|toy")
    serving = run / "serving.json"
    stats = {k: v for k, v in stats.items() if k != "capacity"}  # the loader's, not the server's
    report = {"run_dir": str(run), "buffer": "traffic buffer", "target": target, "buffer_stats": stats}
    report["version_serving"] = json.loads(serving.read_text())["version"] if serving.is_file() else None
    report |= rj.traffic_report(records, load_tokenizer(target), args.context)
    print(
        f"{run / 'traffic'}: {stats['train']} training and {stats['holdout']} held-out trajectories of "
        f"{stats['added']} recorded (drafter version serving: {report['version_serving']})"
    )
    print(rj.format_report(report, args.top))
    if args.json:
        write_json(Path(args.json), report)
        print(f"report: {args.json}")
    if args.log_mlflow:
        tracker = Tracker(run, rj.SERVE_EXPERIMENT)
        tracker.attach(mlflow_run[0])
        paths = rj.log_report(report, tracker, f"rejections/traffic-{stats['added']:06d}")
        print(f"MLflow run {tracker.run_id}: {', '.join(paths)}")
