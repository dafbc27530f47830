"""The `draftopd` command line: one entry, one subcommand per job.

Bad input (a missing file, a malformed prompt line, a config typo, a drafter that
does not fit the target) ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftopd.cluster import add_arguments as add_cluster_arguments
from draftopd.config import ConfigError
from draftopd.data.eval_sets import EvalSetError
from draftopd.data.prompts import PromptError
from draftopd.loading import LoadError

USER_ERRORS = (
    ConfigError,
    EvalSetError,
    PromptError,
    LoadError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    PermissionError,
)


def _sampling_args(p: argparse.ArgumentParser, multi_k: bool = False) -> None:
    p.add_argument("--target", default="toy", help="target model directory, or 'toy' (default)")
    p.add_argument(
        "--prompts",
        required=not multi_k,
        help="JSONL prompt file ({'prompt': ...} or {'messages': [...]}), or 'toy' for the toy held-out set",
    )
    p.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    if multi_k:
        p.add_argument("--num-draft-tokens", type=int, nargs="+", default=[4], help="one or more K")
    else:
        p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-thinking", action="store_true", help="render prompts with thinking off")
    p.add_argument("--aux-layer-ids", type=int, nargs="*", default=None, help="target layers the drafter reads")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--backend",
        choices=["native", "vllm"],
        default="native",
        help="native: draftopd's torch engine; vllm: stock vLLM with the drafter as its EAGLE-3 speculator",
    )
    p.add_argument("--memory-fraction", type=float, default=0.2, help="vllm: gpu_memory_utilization, all engines")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftopd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run a recipe: SFT of a drafter, then Draft-OPD when the recipe enables it")
    p.add_argument("recipe", help="recipe YAML, or a run directory to resume")
    p.add_argument("overrides", nargs="*", help="section.field=value")

    p = sub.add_parser("plan", help="a recipe's memory per GPU role against cluster.gpu, step times and hours")
    p.add_argument("recipe", help="recipe YAML")
    p.add_argument("overrides", nargs="*", help="section.field=value")
    p.add_argument("--json", default=None, help="also write the plan here (roles, parts, hours)")

    p = sub.add_parser("generate", help="decode prompts, with or without a drafter, writing step records")
    _sampling_args(p)
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter directory (omit: target alone)")
    p.add_argument("--out", required=True, help="output JSONL")

    p = sub.add_parser("eval", help="acceptance length and speedup of a drafter on prompt files or named sets")
    _sampling_args(p, multi_k=True)
    p.add_argument("--drafter", required=True)
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

    p = sub.add_parser("diagnose", help="attention drift and state norm along a drafter's chain, drafters side by side")
    p.add_argument("--drafter", nargs="+", required=True, help="one or more drafter directories")
    p.add_argument("--target", default="toy")
    p.add_argument("--prompts", default="toy", help="JSONL prompt file, or 'toy' for the toy held-out set")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the target responses analysed")
    p.add_argument("--depth", type=int, default=7, help="chain depth")
    p.add_argument("--aux-layer-ids", type=int, nargs="*", default=None)
    p.add_argument("--json", required=True, help="write the profiles here (and a PNG beside it)")

    p = sub.add_parser("export", help="write a drafter in a layout vLLM/SGLang (vllm) or speculators serve as is")
    p.add_argument("--drafter", required=True, help="drafter directory (either layout)")
    p.add_argument("--format", choices=["vllm", "sglang", "speculators"], default="vllm")
    p.add_argument("--out", required=True)
    p.add_argument("--verifier", default="", help="speculators: the target model's name or path")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="speculators: draft tokens per step")

    p = sub.add_parser("inspect", help="a drafter checkpoint's family, layout, conventions, shapes and fit to a target")
    p.add_argument("ckpt", help="drafter directory (any published layout)")
    p.add_argument("--target", default="", help="target model (name or path) to check the drafter against")

    p = sub.add_parser("make-toy-target", help="rebuild the toy target model from scratch")
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=35.0, help="training time budget")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser(
        "make-toy-draft-lm", help="train the toy autoregressive draft LM (PARD's starting point) on the toy corpus"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=20.0, help="training time budget")
    p.add_argument("--target", default="toy", help="target whose tokenizer the draft LM uses (default: toy)")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser(
        "bench",
        help="benchmarks; 'opd-vs-sft': Draft-OPD vs more SFT as a paired, seeded experiment with a control arm; "
        "'sft-plateau': SFT until held-out tau stops improving; "
        "'engines': the native engine vs Hugging Face generate (plain and prompt-lookup assisted); "
        "'rollout': rollout tokens/s of the vLLM backend with its recording hook vs stock vLLM and the native engine; "
        "'families': drafter families side by side (tau, tau per drafter pass, parameters, FLOPs, tokens/s)",
    )
    p.add_argument("which", choices=["opd-vs-sft", "sft-plateau", "engines", "rollout", "families"])
    p.add_argument("--target", default="toy")
    p.add_argument(
        "--drafter",
        default=None,
        help="starting drafter: a directory, `toy` or `toy-plateau` (default: toy-plateau for opd-vs-sft, else toy)",
    )
    p.add_argument("--aux-layer-ids", type=int, nargs="*", default=[1, 2, 3])
    p.add_argument("--num-train-prompts", type=int, default=None, help="training prompts (opd-vs-sft 64, else 800)")
    p.add_argument("--num-eval-prompts", type=int, default=None, help="held-out prompts per set (engines 16, else 32)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="token budget per prompt (engines 128, else 96)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=4, help="engines: drafts of prompt lookup")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="engines: a Python with vllm (and draftopd) installed; adds stock vLLM arms, alone and with EAGLE-3",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per arm (opd-vs-sft 40; sft-plateau: max)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per step (opd-vs-sft 8, sft-plateau 16)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (opd-vs-sft 3e-4, sft-plateau 1e-3)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="K of the rollouts and of the curves")
    p.add_argument("--eval-ks", type=int, nargs="+", default=[4, 7], help="opd-vs-sft: K of the final held-out taus")
    p.add_argument(
        "--depth",
        type=int,
        default=None,
        help="opd-vs-sft, sft-plateau: training depth (drafts scored per row; default: opd-vs-sft K, sft-plateau 7;"
        " a block family: block size - 1)",
    )
    p.add_argument(
        "--decay", type=float, default=0.8, help="opd-vs-sft, sft-plateau: loss weight of depth d is decay**d"
    )
    p.add_argument(
        "--num-anchors",
        type=int,
        default=0,
        help="sft-plateau: rows scored per sequence, drawn afresh each step (DFlash's random anchors); 0: every row",
    )
    p.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="opd-vs-sft: paired seeds; families: held-out draws"
    )
    p.add_argument(
        "--drafters",
        nargs="*",
        default=[],
        metavar="NAME=DIR",
        help="families: drafters compared beside the shipped toy EAGLE-3 drafter (or --drafter); DIR0,DIR1,...:"
        " one drafter per seed (independently trained), drafter i on held-out draw i",
    )
    p.add_argument(
        "--pairs",
        nargs="*",
        default=[],
        metavar="ARM/BASE",
        help="families: arms to pair seed by seed (tau ratio with a 95%% t-interval), beside the automatic pairs",
    )
    p.add_argument(
        "--no-naive-resample",
        action="store_true",
        help="families: leave out the arm that re-drafts a D²SD drafter's VP rows with its first drafter",
    )
    p.add_argument(
        "--arms", nargs="+", default=None, help="opd-vs-sft arms (default: the baselines, opd, control, ref.)"
    )
    p.add_argument("--rollout-temperature", type=float, default=0.0, help="opd-vs-sft: Draft-OPD rollouts")
    p.add_argument("--pool-temperature", type=float, default=0.5, help="the offline pool's sampling temperature")
    p.add_argument("--learner", nargs="*", default=[], help="opd-vs-sft: learner overrides FIELD=VALUE (all OPD arms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="engines, rollout, families: the report's path")
    p.add_argument(
        "--out",
        help="opd-vs-sft, sft-plateau: a directory for report.json, plots and an MLflow store; families: a plot",
    )

    _prepare_data_args(sub)

    p = sub.add_parser("ui", help="serve the MLflow UI for a run directory (or a tracking URI) on 127.0.0.1")
    p.add_argument("store", help="run directory holding mlflow.db, a path to an mlflow.db, or a backend store URI")
    p.add_argument("--port", type=int, default=5000)

    p = sub.add_parser(
        "rejections", help="which draft tokens, offsets, contexts and domains get rejected, from a run's replay buffer"
    )
    p.add_argument("run_dir", help="a Draft-OPD run directory (the buffer of its newest checkpoint is read)")
    p.add_argument("--top", type=int, default=20, help="rows of the ranked tables (tokens, pairs, contexts) printed")
    p.add_argument("--context", type=int, default=3, help="tokens before the rejection point that make a context")
    p.add_argument("--json", default=None, help="write the whole report (every row) here")
    p.add_argument("--log-mlflow", action="store_true", help="log the tables to the run's MLflow run, as tables")

    p = sub.add_parser(
        "cluster", help="a recipe's cluster launchers: KubeRay RayCluster/RayJob, a SLURM script, ray job submit"
    )
    add_cluster_arguments(p)
    return parser


def _prepare_data_args(sub) -> None:
    p = sub.add_parser(
        "prepare-data",
        help="a prompt pool from local ShareGPT/UltraChat/GSM8K/MATH/AoPS/CodeAlpaca copies, mixed, deduplicated, "
        "split, with the target's regenerated responses, in shards with a manifest (resumable)",
    )
    p.add_argument("--out", required=True, help="output folder (rerunning with the same flags resumes it)")
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="KIND[=PATH][:WEIGHT]",
        help="sharegpt, ultrachat, chat, gsm8k, math, aops, codealpaca; PATH a file or folder (omitted: the HF "
        "datasets cache); WEIGHT its share of the mix (default 1); repeat per source",
    )
    p.add_argument("--mix", default=None, help="YAML mix file: sources: [{name, kind, path, weight}, ...]")
    p.add_argument("--target", default="toy", help="target model directory, or 'toy' (default)")
    p.add_argument("--num-prompts", type=int, default=0, help="training prompts, split by weight (0: every row)")
    p.add_argument("--num-heldout", type=int, default=0, help="held-out prompts, split by weight, disjoint")
    p.add_argument("--no-thinking", action="store_true", help="render prompts with thinking off")
    p.add_argument("--backend", choices=["native", "vllm"], default="native")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="native: prompts decoded together")
    p.add_argument("--shard-size", type=int, default=1000, help="rows per shard")
    p.add_argument("--shard-format", choices=["jsonl", "parquet"], default="jsonl")
    p.add_argument("--max-malformed-fraction", type=float, default=0.05, help="per source; above it is an error")
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="skip longer rendered prompts (0: no limit)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--vllm-python", default=None, help="vllm: a Python with vllm and draftopd (default: this one)")
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


def _engines(args, eos: list[int], num_engines: int):
    """The EngineSet of --backend: native loads the torch models here; vLLM loads them in its own engines."""
    from draftopd.drafters import load_drafter
    from draftopd.engine.backends import EngineSet
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
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reports, indent=2) + "\n")
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
    from draftopd.eval.diagnose import drift_profile, format_profiles, plot_profiles
    from draftopd.loading import eos_ids, load_target, load_tokenizer
    from draftopd.messages import SamplingConfig
    from draftopd.sft.trainer import SFTExample

    chats = toy_prompts("held_out", args.num_prompts) if args.prompts == "toy" else read_prompt_file(args.prompts)
    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, args.aux_layer_ids)
    drafters = {Path(d).name: load_drafter(d, target) for d in args.drafter}
    prompts = encode_chats(tokenizer, chats[: args.num_prompts])
    engine = SpeculativeEngine(target, None, eos_ids(tokenizer, args.target))
    trajs = engine.generate(prompts, SamplingConfig(args.max_new_tokens))
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs]
    torch.manual_seed(0)
    profiles = {name: drift_profile(target, d, examples, args.depth) for name, d in drafters.items()}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profiles, indent=2) + "\n")
    plot_profiles(profiles, out.with_suffix(".png"))
    print(format_profiles(profiles))
    print(f"profiles: {out}; plot: {out.with_suffix('.png')}")


def cmd_export(args) -> None:
    from draftopd.drafters import export_drafter

    if not (Path(args.drafter) / "config.json").is_file():
        raise FileNotFoundError(f"drafter {args.drafter}: no config.json")
    out = export_drafter(args.drafter, args.format, args.out, args.verifier, args.num_draft_tokens)
    print(f"{args.format} checkpoint: {out}")


def cmd_inspect(args) -> None:
    from draftopd.drafters import inspect_checkpoint
    from draftopd.loading import load_target

    target = load_target(args.target) if args.target else None
    print("\n".join(inspect_checkpoint(args.ckpt, target)))


def cmd_train(args) -> None:
    from draftopd.config import ConfigError, load_config
    from draftopd.plan import check_before_train
    from draftopd.sft.pipeline import run_sft

    run_dir = Path(args.recipe)
    if run_dir.is_dir():  # a run directory: resume it with the config it was started with
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} is a directory but not a run directory (it has no config.yaml)")
        resume = [f"run.out_dir={run_dir.resolve().parent}", f"run.name={run_dir.name}", "run.resume=true"]
        cfg = load_config(run_dir / "config.yaml", [*resume, *args.overrides])
    else:
        cfg = load_config(args.recipe, args.overrides)
    check_before_train(cfg, args.recipe)  # a layout that cannot fit its GPUs stops here, before any actor starts
    if cfg.opd.enabled:
        from draftopd.opd.driver import run_opd

        run_opd(cfg, sys.argv)
    else:
        run_sft(cfg, sys.argv)


def cmd_plan(args) -> None:
    from draftopd.plan import plan_command

    plan_command(args.recipe, args.overrides, args.json)


def cmd_make_toy_target(args) -> None:
    from draftopd.toy.target import ToyTargetSpec, make_toy_target

    report = make_toy_target(args.out, ToyTargetSpec(minutes=args.minutes, seed=args.seed))
    print(json.dumps(report, indent=2))


def cmd_make_toy_draft_lm(args) -> None:
    from draftopd.toy.draft_lm import ToyDraftLMSpec, make_toy_draft_lm

    report = make_toy_draft_lm(args.out, args.target, ToyDraftLMSpec(minutes=args.minutes, seed=args.seed))
    print(json.dumps(report, indent=2))


def cmd_bench(args) -> None:
    if args.which == "families":
        return _bench_families(args)
    if args.which in ("engines", "rollout"):
        if not args.json:
            raise SystemExit(f"bench {args.which} needs --json PATH")
        args.batch_size = args.batch_size or 8
        args.num_train_prompts = args.num_train_prompts or 64
        args.num_eval_prompts = args.num_eval_prompts or 16
        return (_bench_engines if args.which == "engines" else _bench_rollout)(args)
    if not args.out:
        raise SystemExit(f"bench {args.which} needs --out DIR")
    return (_bench_opd_vs_sft if args.which == "opd-vs-sft" else _bench_sft_plateau)(args)


def _toy_sets(tokenizer, n: int, seed: int) -> dict:
    from draftopd.data.prompts import encode_chats, toy_prompts

    return {
        name: encode_chats(tokenizer, toy_prompts("held_out", n, seed, domain))
        for name, domain in (("toy", None), ("toy-arithmetic", "arithmetic"), ("toy-code", "code"))
    }


def _learner_overrides(items: list[str]) -> dict:
    import dataclasses

    from draftopd.config import LearnerConfig

    fields = {f.name: f.type for f in dataclasses.fields(LearnerConfig)}
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in fields or not value:
            raise SystemExit(f"--learner {item!r}: expected FIELD=VALUE with a learner field ({', '.join(fields)})")
        kind = {"float": float, "int": int, "bool": lambda v: v.lower() in ("1", "true", "yes")}.get(fields[name], str)
        out[name] = kind(value)
    return out


def _bench_opd_vs_sft(args) -> None:
    import torch

    from draftopd.bench.opd_vs_sft import DEFAULT_ARMS, BenchSettings, curve_plot, run_bench, table
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.drafters import load_drafter
    from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_drafter_path

    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, args.aux_layer_ids)
    drafter_dir = resolve_drafter_path(args.drafter or "toy-plateau")
    load_drafter(drafter_dir, target)  # fail early on a bad drafter
    s = BenchSettings(
        steps=args.steps or 40,
        batch_size=args.batch_size or 8,
        lr=args.lr or 3e-4,
        num_draft_tokens=args.num_draft_tokens,
        depth=args.depth or args.num_draft_tokens,
        decay=args.decay,
        eval_ks=tuple(args.eval_ks),
        eval_every=args.eval_every or 10,
        seeds=tuple(args.seeds),
        arms=tuple(args.arms or DEFAULT_ARMS),
        rollout_temperature=args.rollout_temperature,
        pool_temperature=args.pool_temperature,
        max_new_tokens=args.max_new_tokens or 96,
        learner=_learner_overrides(args.learner),
    )
    torch.manual_seed(args.seed)
    train = encode_chats(tokenizer, toy_prompts("train", args.num_train_prompts or 64, seed=args.seed + 1))
    held = _toy_sets(tokenizer, args.num_eval_prompts or 32, args.seed)
    eos = eos_ids(tokenizer, args.target)
    report = run_bench(target, eos, lambda: load_drafter(drafter_dir, target), train, held, s)
    report["start_drafter"] = drafter_dir
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    curve_plot(report, out / "tau_vs_learner_tokens.png")
    _bench_mlflow(
        out, "opd-vs-sft", report["settings"], _opd_vs_sft_metrics(report), ["report.json", "tau_vs_learner_tokens.png"]
    )
    print(table(report))
    print(f"report, plot and MLflow store in {out}")


def _opd_vs_sft_metrics(report: dict) -> list[tuple[str, float, int]]:
    """(name, value, step) rows: per arm the mean tau per set and K, per seed (step = seed), the curve (step =
    learner tokens) and the headline's paired ratios."""
    rows = []
    for arm, r in report["arms"].items():
        for key, (mean, lo, hi) in r["tau"].items():
            rows += [(f"tau/{arm}/{key}", mean, 0), (f"tau_ci95_low/{arm}/{key}", lo, 0)]
            rows.append((f"tau_ci95_high/{arm}/{key}", hi, 0))
        for seed, info in r["seeds"].items():
            rows += [(f"seed_tau/{arm}/{key}", v, int(seed)) for key, v in info["tau"].items()]
            rows += [(f"curve/{arm}/seed{seed}", c["tau"], c["learner_tokens"]) for c in info["curve"]]
        for base, by_key in r["vs"].items():
            rows.append((f"ratio/{arm}/over/{base}", by_key[report["headline"]]["ratio"], 0))
    return rows


def _bench_mlflow(out: Path, name: str, settings: dict, rows: list, artifacts: list[str]) -> None:
    from draftopd.tracking import Tracker

    tracker = Tracker(out, "draftopd-bench", name)
    tracker.start()
    tracker.log_params(settings)
    for metric, value, step in rows:
        tracker.log_metrics({metric: value}, step=step)
    for a in artifacts:
        tracker.log_artifact(out / a)
    tracker.end("FINISHED")


def _bench_sft_plateau(args) -> None:
    from draftopd.bench.sft_plateau import PlateauSettings, plateau_plot, run_plateau
    from draftopd.config import DrafterConfig
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.drafters import load_drafter, new_drafter, save_drafter
    from draftopd.engine.speculative import SpeculativeEngine
    from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_drafter_path
    from draftopd.messages import SamplingConfig
    from draftopd.sft.trainer import SFTExample
    from draftopd.sft.vocab import build_draft_vocab

    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, args.aux_layer_ids)
    eos = eos_ids(tokenizer, args.target)
    s = PlateauSettings(
        batch_size=args.batch_size or 16,
        lr=args.lr or 1e-3,
        eval_every=args.eval_every or 25,
        max_steps=args.steps or 1500,
        depth=args.depth or 7,
        decay=args.decay,
        num_anchors=args.num_anchors,
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens or 96,
        seed=args.seed,
    )
    train = encode_chats(tokenizer, toy_prompts("train", args.num_train_prompts or 800, seed=args.seed + 1))
    sampling = SamplingConfig(s.max_new_tokens, args.pool_temperature, 0, args.seed)
    pool = SpeculativeEngine(target, None, eos).generate(train, sampling)
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in pool]
    if args.drafter:
        drafter = load_drafter(resolve_drafter_path(args.drafter), target)
    else:
        cfg = DrafterConfig()
        vocab = build_draft_vocab([t.output_ids for t in pool], cfg.draft_vocab_size, len(tokenizer), eos)
        drafter = new_drafter(cfg, target, vocab)
    held = _toy_sets(tokenizer, args.num_eval_prompts or 32, args.seed)["toy"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run_plateau(drafter, target, eos, examples, held, s, lambda d: save_drafter(d, out / "drafter"))
    from draftopd.bench.opd_vs_sft import held_out

    shipped = load_drafter(resolve_drafter_path("toy"), target)
    reference = {
        "shipped toy drafter": held_out(shipped, target, eos, held, s.num_draft_tokens, s.seed, s.max_new_tokens)["tau"]
    }
    report.update(
        settings=s.__dict__, pool_size=len(examples), pool_temperature=args.pool_temperature, reference=reference
    )
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plateau_plot(report, out / "sft_plateau.png", reference)
    rows = [("plateau/tau", c["tau"], c["learner_tokens"]) for c in report["curve"]]
    _bench_mlflow(out, "sft-plateau", report["settings"], rows, ["report.json", "sft_plateau.png"])
    b = report["best"]
    state = "plateaued" if report["plateaued"] else "still improving at the step limit"
    print(
        f"SFT {state}: best held-out tau {b['tau']:.3f} at step {b['step']} ({b['learner_tokens']} learner tokens); "
        f"stopped at step {report['stopped_at_step']} ({report['epochs']:.1f} epochs of {len(examples)} responses)"
    )
    print(f"best drafter in {out / 'drafter'}; report, plot and MLflow store in {out}")


def _bench_rollout(args) -> None:
    from draftopd.bench.rollout import format_rollout, run_rollout_bench
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.drafters import load_drafter
    from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_drafter_path, resolve_target_path

    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, args.aux_layer_ids)
    drafter_dir = resolve_drafter_path(args.drafter or "toy")
    prompts = encode_chats(tokenizer, toy_prompts("train", args.num_train_prompts, seed=args.seed + 1))
    report = run_rollout_bench(
        target,
        load_drafter(drafter_dir, target),
        drafter_dir,
        str(resolve_target_path(args.target)),
        eos_ids(tokenizer, args.target),
        prompts,
        args.num_draft_tokens,
        args.max_new_tokens or 128,
        args.batch_size,
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(format_rollout(report))


def _bench_engines(args) -> None:
    from draftopd.bench.engines import format_engines, run_engines_bench
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.drafters import load_drafter
    from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_drafter_path, resolve_target_path

    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, args.aux_layer_ids)
    drafter_dir = resolve_drafter_path(args.drafter or "toy")
    drafter = load_drafter(drafter_dir, target)
    prompts = encode_chats(tokenizer, toy_prompts("held_out", args.num_eval_prompts, args.seed))
    eos = eos_ids(tokenizer, args.target)
    paths = (str(resolve_target_path(args.target)), str(Path(drafter_dir).resolve()))
    report = run_engines_bench(
        target,
        drafter,
        eos,
        prompts,
        args.max_new_tokens or 128,
        args.num_draft_tokens,
        args.prompt_lookup_tokens,
        args.vllm_python,
        paths,
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(format_engines(report))


def _bench_families(args) -> None:
    from draftopd.bench.families import Arm, bar_plot, d2sd_arms, num_drafts, pard_arms, run_families, table
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.drafters import load_drafter
    from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_drafter_path

    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, args.aux_layer_ids)
    first = "toy-eagle3" if not args.drafter else Path(args.drafter).name
    named = {first: [resolve_drafter_path(args.drafter or "toy")]}
    for item in args.drafters:
        name, _, paths = item.partition("=")
        if not name or not paths or name in named:
            raise SystemExit(f"--drafters {item!r}: expected NAME=DIR[,DIR...] with a name not used before")
        named[name] = [resolve_drafter_path(p) for p in paths.split(",")]
        if len(named[name]) not in (1, len(args.seeds)):
            raise SystemExit(f"--drafters {item!r}: one directory, or one per seed ({len(args.seeds)})")
    arms = []
    for name, paths in named.items():
        drafters = [load_drafter(p, target).eval() for p in paths]
        if len({d.kind for d in drafters}) > 1:
            raise SystemExit(f"--drafters {name}: the directories hold drafters of different families")
        arms.append(Arm(name, drafters, ",".join(map(str, paths)), num_drafts(drafters[0], args.num_draft_tokens)))
        if drafters[0].kind == "d2sd":
            arms += d2sd_arms(arms[-1], naive=not args.no_naive_resample)
        if drafters[0].kind == "pard":
            arms += pard_arms(arms[-1])
    pairs = []
    for item in args.pairs:
        a, sep, b = item.partition("/")
        if not sep or not a or not b:
            raise SystemExit(f"--pairs {item!r}: expected ARM/BASE")
        pairs.append((a, b))
    n = args.num_eval_prompts or 32
    # the "toy" set of _toy_sets (held-out prompts of every domain), without building the per-domain ones
    prompts = {seed: encode_chats(tokenizer, toy_prompts("held_out", n, seed)) for seed in args.seeds}
    try:
        report = run_families(target, eos_ids(tokenizer, args.target), arms, prompts, args.max_new_tokens or 96, pairs)
    except ValueError as exc:
        raise SystemExit(f"bench families: {exc}") from None
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        bar_plot(report, Path(args.out) / "families.png")
    print(table(report))


def cmd_ui(args) -> int:
    from draftopd.tracking import serve_ui

    return serve_ui(args.store, args.port)


def cmd_rejections(args) -> None:
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
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.json}")
    if args.log_mlflow:
        tracker = Tracker(args.run_dir, cfg.tracking.experiment, tracking_uri=cfg.tracking.tracking_uri or None)
        tracker.attach(driver_state["mlflow_run_id"])
        paths = log_report(report, tracker, f"rejections/{ckpt.name}")
        print(f"MLflow run {tracker.run_id}: {', '.join(paths)}")


def cmd_cluster(args) -> None:
    from draftopd.cluster import run

    run(args)


COMMANDS = {
    "train": cmd_train,
    "plan": cmd_plan,
    "generate": cmd_generate,
    "diagnose": cmd_diagnose,
    "export": cmd_export,
    "inspect": cmd_inspect,
    "eval": cmd_eval,
    "make-toy-target": cmd_make_toy_target,
    "make-toy-draft-lm": cmd_make_toy_draft_lm,
    "ui": cmd_ui,
    "rejections": cmd_rejections,
    "bench": cmd_bench,
    "cluster": cmd_cluster,
    "prepare-data": cmd_prepare_data,
}


def _quiet_model_loading() -> None:
    """Our own progress bars cover long work; the per-file bars of model loading are noise (and would split an
    error message over several lines)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_model_loading()
    try:
        rc = COMMANDS[args.command](args)
    except USER_ERRORS as exc:
        print(f"draftopd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if type(exc).__name__ != "TrainingError":  # only the driver's deliberate stops are shown this way
            raise
        print(f"draftopd {args.command}: stopped: {exc} (continue with run.resume=true)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"draftopd {args.command}: interrupted", file=sys.stderr)
        return 130
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
