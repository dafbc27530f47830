"""`draftopd bench NAME`: one subcommand per benchmark, each with its own flags and its own defaults.

opd-vs-sft: Draft-OPD vs more SFT as a paired, seeded experiment with a control arm; sft-plateau: SFT until
held-out tau stops improving; engines: the native engine vs Hugging Face generate (plain and prompt-lookup
assisted); rollout: rollout tokens/s of the vLLM backend with its recording hook vs stock vLLM and the native
engine; families: drafter families side by side (tau, tau per drafter pass, parameters, FLOPs, tokens/s);
serve-adapt: `draftopd serve`'s live tau on shifted traffic, learning on vs off; serve-load: `draftopd serve` under
concurrent clients, learning on vs off (latency, tokens/s, memory).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftopd.cli.common import HelpFormatter, add_command, at_least_one
from draftopd.reports import write_json


def register(sub) -> None:
    p = add_command(
        sub, "bench", None, "benchmarks: opd-vs-sft, sft-plateau, engines, rollout, families, serve-adapt, serve-load"
    )
    benches = p.add_subparsers(dest="which", required=True, metavar="BENCH")
    _opd_vs_sft_args(
        _bench(benches, "opd-vs-sft", _bench_opd_vs_sft, "Draft-OPD vs more SFT: paired seeds, a control arm")
    )
    _sft_plateau_args(_bench(benches, "sft-plateau", _bench_sft_plateau, "SFT until held-out tau stops improving"))
    _engines_args(
        _bench(benches, "engines", _bench_engines, "the native engine vs Hugging Face generate (plain, prompt lookup)")
    )
    _rollout_args(
        _bench(benches, "rollout", _bench_rollout, "rollout tokens/s: the vLLM backend's hook vs stock vLLM, native")
    )
    _families_args(_bench(benches, "families", _bench_families, "drafter families side by side: tau, FLOPs, tokens/s"))
    _serve_adapt_args(
        _bench(benches, "serve-adapt", _bench_serve_adapt, "serve on shifted traffic: live tau, learning on/off")
    )
    _serve_load_args(
        _bench(benches, "serve-load", _bench_serve_load, "draftopd serve under concurrent clients, learning on/off")
    )


def _bench(benches, name: str, handler, summary: str) -> argparse.ArgumentParser:
    p = benches.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)
    p.set_defaults(handler=handler)
    return p


def _report_flags(p: argparse.ArgumentParser, name: str, out_holds: str) -> None:
    """`--out` and `--json`, the same on every bench: the report goes to `--json`, by default OUT/report.json."""
    p.add_argument("--out", default=f"runs/bench-{name}", metavar="DIR", help=f"a directory for {out_holds}")
    p.add_argument("--json", default=None, metavar="PATH", help="the report's path (default: OUT/report.json)")


def _report_path(args) -> Path:
    """Where the bench writes its report: `--json`, or OUT/report.json."""
    return Path(args.json) if args.json else Path(args.out) / "report.json"


def _common(p: argparse.ArgumentParser, drafter: str, max_new_tokens: int) -> None:
    """The flags every bench reads: the models, K, the token budget."""
    p.add_argument("--target", default="toy", help="target model directory, or 'toy'")
    p.add_argument("--drafter", default=drafter, help="starting drafter: a directory, `toy` or `toy-plateau`")
    p.add_argument("--aux-layer-ids", type=int, nargs="*", default=[1, 2, 3], help="target layers the drafter reads")
    p.add_argument("--num-draft-tokens", type=at_least_one, default=4, help="K, drafts per step")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="token budget per prompt")


def _opd_vs_sft_args(p: argparse.ArgumentParser) -> None:
    _common(p, "toy-plateau", 96)
    _report_flags(p, "opd-vs-sft", "the report, the plot and an MLflow store")
    p.add_argument("--arms", nargs="+", default=None, help="arms (default: the baselines, opd, control, ref.)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="paired seeds")
    p.add_argument("--seed", type=int, default=0, help="prompt draws and torch seed")
    p.add_argument("--num-train-prompts", type=int, default=64, help="training prompts")
    p.add_argument("--num-eval-prompts", type=int, default=32, help="held-out prompts per set")
    p.add_argument(
        "--eval-sets",
        nargs="*",
        default=[],
        metavar="NAME[=PATH]",
        help="named held-out sets beside the toy ones, first turns only (e.g. humaneval: the package's 164 problems)",
    )
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per arm")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step")
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate")
    p.add_argument("--eval-ks", type=int, nargs="+", default=[4, 7], help="K of the final held-out taus")
    p.add_argument(
        "--depth", type=int, default=None, help="training depth, drafts scored per row (default: --num-draft-tokens)"
    )
    p.add_argument("--decay", type=float, default=0.8, help="loss weight of depth d is decay**d")
    p.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    p.add_argument("--rollout-temperature", type=float, default=0.0, help="Draft-OPD rollouts")
    p.add_argument(
        "--eval-temperature",
        type=float,
        default=None,
        help="held-out tau at this temperature, the serving one (default: --rollout-temperature)",
    )
    p.add_argument(
        "--eval-samples", type=int, default=2, help="sampling seeds held-out tau averages over when temperature > 0"
    )
    p.add_argument("--pool-temperature", type=float, default=0.5, help="the offline pool's sampling temperature")
    p.add_argument("--learner", nargs="*", default=[], help="learner overrides FIELD=VALUE (all OPD arms)")


def _sft_plateau_args(p: argparse.ArgumentParser) -> None:
    _common(p, None, 96)
    p.set_defaults(drafter=None)  # none: a fresh EAGLE-3 drafter
    _report_flags(p, "sft-plateau", "the report, the plot, an MLflow store and the best drafter")
    p.add_argument("--seed", type=int, default=0, help="prompt draws and sampling seed")
    p.add_argument("--num-train-prompts", type=int, default=800, help="training prompts")
    p.add_argument("--num-eval-prompts", type=int, default=32, help="held-out prompts")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps, at most")
    p.add_argument("--batch-size", type=int, default=16, help="rows per step")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--depth", type=int, default=7, help="training depth, drafts scored per row")
    p.add_argument("--decay", type=float, default=0.8, help="loss weight of depth d is decay**d")
    p.add_argument(
        "--num-anchors",
        type=int,
        default=0,
        help="rows scored per sequence, drawn afresh each step (DFlash's random anchors); 0: every row",
    )
    p.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    p.add_argument("--pool-temperature", type=float, default=0.5, help="the offline pool's sampling temperature")


def _engines_args(p: argparse.ArgumentParser) -> None:
    _common(p, "toy", 128)
    _report_flags(p, "engines", "the report")
    p.add_argument("--seed", type=int, default=0, help="held-out prompt draw")
    p.add_argument("--num-eval-prompts", type=int, default=16, help="held-out prompts")
    p.add_argument("--prompt-lookup-tokens", type=int, default=4, help="drafts of prompt lookup")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="a Python with vllm (and draftopd) installed; adds stock vLLM arms, alone and with EAGLE-3",
    )


def _rollout_args(p: argparse.ArgumentParser) -> None:
    _common(p, "toy", 128)
    _report_flags(p, "rollout", "the report")
    p.add_argument("--seed", type=int, default=0, help="rollout prompt draw")
    p.add_argument("--num-train-prompts", type=int, default=64, help="rollout prompts")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")


def _families_args(p: argparse.ArgumentParser) -> None:
    _common(p, None, 96)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="held-out draws")
    p.add_argument("--num-eval-prompts", type=int, default=32, help="held-out prompts per draw")
    p.add_argument(
        "--drafters",
        nargs="*",
        default=[],
        metavar="NAME=DIR",
        help="drafters compared beside the shipped toy EAGLE-3 drafter (or --drafter); DIR0,DIR1,...:"
        " one drafter per seed (independently trained), drafter i on held-out draw i",
    )
    p.add_argument(
        "--pairs",
        nargs="*",
        default=[],
        metavar="ARM/BASE",
        help="arms to pair seed by seed (tau ratio with a 95%% t-interval), beside the automatic pairs",
    )
    p.add_argument(
        "--no-naive-resample",
        action="store_true",
        help="leave out the arm that re-drafts a D²SD drafter's VP rows with its first drafter",
    )
    _report_flags(p, "families", "the report and the plot")


def _serve_common(p: argparse.ArgumentParser, name: str) -> None:
    """The flags both serving benches read: the server's models and K, the traffic, the learner."""
    from draftopd.bench.serve_process import BENCH_LEARNER
    from draftopd.bench.serve_traffic import SHIFTS

    p.add_argument("--target", default="toy", help="target model directory, or 'toy'")
    p.add_argument(
        "--drafter",
        default="toy",
        help="the drafter served first: a directory, a shipped toy name, or a family (eagle3, dflash, pard: its SFT"
        " drafter on the toy target, trained into OUT/drafters the first time)",
    )
    p.add_argument("--num-draft-tokens", type=at_least_one, default=None, help="K (default: the family's, else 4)")
    p.add_argument("--max-new-tokens", type=at_least_one, default=96, help="max_tokens of every request")
    p.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="vLLM replicas of the fleet (`serve --replicas`; its learner on a core of its own); 0: the one-process"
        " server",
    )
    p.add_argument("--shift", choices=SHIFTS, default="thinking-off", help="what the traffic changes")
    p.add_argument("--concurrency", type=at_least_one, default=None, help="clients sending at once")
    p.add_argument(
        "--learner",
        nargs="*",
        default=list(BENCH_LEARNER),
        metavar="FIELD=VALUE",
        help="`serve --learner` overrides (learning on); the default gives the learner the cores' pace on toy traffic",
    )
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAG", help="more `serve` flags, both arms")
    _report_flags(p, name, "the report, the servers' run directories and logs")


def _serve_adapt_args(p: argparse.ArgumentParser) -> None:
    from draftopd.schema import DataConfig

    _serve_common(p, "serve-adapt")
    p.set_defaults(concurrency=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="prompt draws, one pair of servers each")
    p.add_argument("--num-requests", type=at_least_one, default=480, help="requests per seed and arm")
    p.add_argument("--window", type=at_least_one, default=40, help="requests between two readings of live tau")
    p.add_argument("--domain", choices=["arithmetic", "code"], default=None, help="one toy domain only")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second at most (0: as fast as served)")
    p.add_argument(
        "--control-drafter",
        default="",
        help="the learning-off arm's drafter (as --drafter; default: the same). Day 0: --drafter init:eagle3 "
        "--control-drafter eagle3",
    )
    p.add_argument(
        "--baseline-drafter",
        default="",
        help="a third arm, learning off, serving this drafter: the isolated baseline (SFT on the target's own text "
        "for the traffic served, at the serving temperature); reports on/baseline and baseline/off",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="REPORT",
        default=None,
        help="serve nothing: pool the seeds of these report.json files (the same settings, other seeds) into one "
        "report, its interval and plot in --out",
    )
    data = DataConfig()  # the prompt file holds as many prompts as `train` reads by default
    p.add_argument(
        "--write-prompts",
        default=None,
        metavar="PATH",
        help=f"serve nothing: write the shift's prompts ({data.num_train_prompts} of the toy corpus's train split, "
        f"never served, and {data.num_eval_prompts} held-out; a split per line) for training the isolated baseline: "
        "`draftopd train RECIPE data.prompts=PATH data.eval_prompts=PATH data.response_temperature=0`, with "
        "data.enable_thinking=false on thinking-off",
    )


def _serve_load_args(p: argparse.ArgumentParser) -> None:
    _serve_common(p, "serve-load")
    p.set_defaults(concurrency=8)
    p.add_argument("--seed", type=int, default=0, help="prompt draw")
    p.add_argument("--duration-s", type=float, default=300.0, help="seconds of load per arm")
    p.add_argument("--num-prompts", type=at_least_one, default=64, help="distinct prompts, cycled")
    p.add_argument(
        "--learning-arms", nargs="+", choices=["on", "off"], default=["on", "off"], help="learning arms, in order"
    )


def _held_out_sets(tokenizer, items, n: int, seed: int) -> dict:
    """Held-out sets by name (`NAME` or `NAME=PATH`: the toy sets, or a named set such as humaneval), each set's
    first `n` conversations, first turn, as prompt ids."""
    from draftopd.data.eval_sets import load_set
    from draftopd.data.prompts import encode_chats

    out = {}
    for item in items:
        name, _, path = item.partition("=")
        found = load_set(name, path or None, n, seed)
        out[name] = encode_chats(tokenizer, [conv[0] for conv in found.conversations])
    return out


def _toy_sets(tokenizer, n: int, seed: int) -> dict:
    from draftopd.data.eval_sets import TOY_SETS

    return _held_out_sets(tokenizer, TOY_SETS, n, seed)


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
    from draftopd.data.eval_sets import TOY_SETS
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.drafters import load_drafter
    from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_drafter_path

    tokenizer = load_tokenizer(args.target)
    # the toy sets and --eval-sets, before the models: a bad set fails fast
    held = _held_out_sets(tokenizer, [*TOY_SETS, *args.eval_sets], args.num_eval_prompts, args.seed)
    target = load_target(args.target, args.aux_layer_ids)
    drafter_dir = resolve_drafter_path(args.drafter or "toy-plateau")
    load_drafter(drafter_dir, target)  # fail early on a bad drafter
    s = BenchSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        num_draft_tokens=args.num_draft_tokens,
        depth=args.depth or args.num_draft_tokens,
        decay=args.decay,
        eval_ks=tuple(args.eval_ks),
        eval_every=args.eval_every,
        seeds=tuple(args.seeds),
        arms=tuple(args.arms or DEFAULT_ARMS),
        rollout_temperature=args.rollout_temperature,
        eval_temperature=args.rollout_temperature if args.eval_temperature is None else args.eval_temperature,
        eval_samples=args.eval_samples,
        pool_temperature=args.pool_temperature,
        max_new_tokens=args.max_new_tokens,
        learner=_learner_overrides(args.learner),
    )
    torch.manual_seed(args.seed)
    train = encode_chats(tokenizer, toy_prompts("train", args.num_train_prompts, seed=args.seed + 1))
    eos = eos_ids(tokenizer, args.target)
    report = run_bench(target, eos, lambda: load_drafter(drafter_dir, target), train, held, s)
    report["start_drafter"] = drafter_dir
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(_report_path(args), report)
    curve_plot(report, out / "tau_vs_learner_tokens.png")
    artifacts = [_report_path(args), out / "tau_vs_learner_tokens.png"]
    _bench_mlflow(out, "opd-vs-sft", report["settings"], _opd_vs_sft_metrics(report), artifacts)
    print(table(report))
    print(f"report in {_report_path(args)}; plot and MLflow store in {out}")


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


def _bench_mlflow(out: Path, name: str, settings: dict, rows: list, artifacts: list[Path]) -> None:
    from draftopd.tracking import Tracker

    tracker = Tracker(out, "draftopd-bench", name)
    tracker.start()
    tracker.log_params(settings)
    for metric, value, step in rows:
        tracker.log_metrics({metric: value}, step=step)
    for a in artifacts:
        tracker.log_artifact(a)
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
        batch_size=args.batch_size,
        lr=args.lr,
        eval_every=args.eval_every,
        max_steps=args.steps,
        depth=args.depth,
        decay=args.decay,
        num_anchors=args.num_anchors,
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    train = encode_chats(tokenizer, toy_prompts("train", args.num_train_prompts, seed=args.seed + 1))
    sampling = SamplingConfig(s.max_new_tokens, args.pool_temperature, 0, args.seed)
    pool = SpeculativeEngine(target, None, eos).generate(train, sampling)
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in pool]
    if args.drafter:
        drafter = load_drafter(resolve_drafter_path(args.drafter), target)
    else:
        cfg = DrafterConfig()
        vocab = build_draft_vocab([t.output_ids for t in pool], cfg.draft_vocab_size, len(tokenizer), eos)
        drafter = new_drafter(cfg, target, vocab)
    held = _toy_sets(tokenizer, args.num_eval_prompts, args.seed)["toy"]
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
    write_json(_report_path(args), report)
    plateau_plot(report, out / "sft_plateau.png", reference)
    rows = [("plateau/tau", c["tau"], c["learner_tokens"]) for c in report["curve"]]
    _bench_mlflow(out, "sft-plateau", report["settings"], rows, [_report_path(args), out / "sft_plateau.png"])
    b = report["best"]
    state = "plateaued" if report["plateaued"] else "still improving at the step limit"
    print(
        f"SFT {state}: best held-out tau {b['tau']:.3f} at step {b['step']} ({b['learner_tokens']} learner tokens); "
        f"stopped at step {report['stopped_at_step']} ({report['epochs']:.1f} epochs of {len(examples)} responses)"
    )
    print(f"best drafter in {out / 'drafter'}; report in {_report_path(args)}; plot and MLflow store in {out}")


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
        args.max_new_tokens,
        args.batch_size,
    )
    write_json(_report_path(args), report)
    print(format_rollout(report))
    print(f"report in {_report_path(args)}")


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
        args.max_new_tokens,
        args.num_draft_tokens,
        args.prompt_lookup_tokens,
        args.vllm_python,
        paths,
    )
    write_json(_report_path(args), report)
    print(format_engines(report))
    print(f"report in {_report_path(args)}")


def _bench_families(args) -> None:
    from draftopd.bench.families import Arm, bar_plot, extra_arms, num_drafts, run_families, table
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
        arms += extra_arms(arms[-1], naive=not args.no_naive_resample)
    pairs = []
    for item in args.pairs:
        a, sep, b = item.partition("/")
        if not sep or not a or not b:
            raise SystemExit(f"--pairs {item!r}: expected ARM/BASE")
        pairs.append((a, b))
    n = args.num_eval_prompts
    # the "toy" set of _toy_sets (held-out prompts of every domain), without building the per-domain ones
    prompts = {seed: encode_chats(tokenizer, toy_prompts("held_out", n, seed)) for seed in args.seeds}
    try:
        report = run_families(target, eos_ids(tokenizer, args.target), arms, prompts, args.max_new_tokens, pairs)
    except ValueError as exc:
        raise SystemExit(f"bench families: {exc}") from None
    write_json(_report_path(args), report)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    bar_plot(report, Path(args.out) / "families.png")
    print(table(report))
    print(f"report in {_report_path(args)}, plot in {Path(args.out) / 'families.png'}")


def _serve_traffic(args, n: int):
    """(tokenizer, the target-alone reference, seed -> (chats, {index: prompt ids rendered here}))."""
    from draftopd.bench.serve_traffic import Reference, shifted_chats, thinking
    from draftopd.data.prompts import encode_chats
    from draftopd.loading import eos_ids, load_target, load_tokenizer

    tokenizer = load_tokenizer(args.target)
    reference = Reference(load_target(args.target), eos_ids(tokenizer, args.target), args.max_new_tokens)

    def traffic(seed: int):
        chats = shifted_chats(n, seed, args.shift, getattr(args, "domain", None), tokenizer)
        return chats, dict(enumerate(encode_chats(tokenizer, chats, thinking(args.shift))))

    return reference, traffic


def _serve_drafter(args, name: str | None = None) -> tuple[str, int]:
    """The serving benches' drafter and K: a family name resolves to its SFT drafter (trained once); init:FAMILY
    (day 0) takes the family's K."""
    from draftopd.bench.family_drafters import FAMILY_SFT, family_drafter, family_k

    name = name or args.drafter
    drafter = family_drafter(name, args.target, Path(args.out))[0] if name in FAMILY_SFT else name
    return drafter, args.num_draft_tokens or family_k(name)


def _bench_serve_adapt(args) -> None:
    from draftopd.bench.serve_adapt import AdaptSettings, curve_plot, mlflow_rows, run_adapt, table

    if args.merge:
        return _merge_serve_adapt(args)
    if args.write_prompts:
        return _write_shift_prompts(args)
    drafter, k = _serve_drafter(args)
    control = _serve_drafter(args, args.control_drafter)[0] if args.control_drafter else ""
    baseline = _serve_drafter(args, args.baseline_drafter)[0] if args.baseline_drafter else ""
    s = AdaptSettings(
        target=args.target,
        drafter=drafter,
        seeds=tuple(args.seeds),
        num_requests=args.num_requests,
        window=args.window,
        concurrency=args.concurrency,
        rate=args.rate,
        max_tokens=args.max_new_tokens,
        num_draft_tokens=k,
        shift=args.shift,
        domain=args.domain,
        learner=args.learner,
        server_args=args.server_arg,
        replicas=args.replicas,
        control=control,
        baseline=baseline,
    )
    reference, traffic = _serve_traffic(args, s.num_requests)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run_adapt(traffic, reference, s, out)
    write_json(_report_path(args), report)
    curve_plot(report, out / "live_tau_vs_requests.png")
    _bench_mlflow(out, "serve-adapt", report["settings"], mlflow_rows(report), [out / "live_tau_vs_requests.png"])
    print(table(report))
    print(f"report in {_report_path(args)}; plot, MLflow store and the servers' run directories in {out}")


def _merge_serve_adapt(args) -> None:
    """`bench serve-adapt --merge`: the reports' seeds pooled into one report and plot; nothing served."""
    from draftopd.bench.serve_adapt import curve_plot, merge, table

    reports = []
    for path in args.merge:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"bench serve-adapt --merge: cannot read {path}: {e}") from None
    try:
        report = merge(reports)
    except ValueError as e:
        raise SystemExit(f"bench serve-adapt --merge: {e}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(_report_path(args), report)
    curve_plot(report, out / "live_tau_vs_requests.png")
    print(table(report))
    print(f"report in {_report_path(args)}; plot in {out}")


def _write_shift_prompts(args) -> None:
    """`bench serve-adapt --write-prompts PATH`: the shift's training and held-out prompts; nothing served."""
    from draftopd.bench.serve_traffic import thinking, write_shift_prompts
    from draftopd.loading import load_tokenizer
    from draftopd.schema import DataConfig

    path, data = Path(args.write_prompts), DataConfig()
    n_train, n_eval = data.num_train_prompts, data.num_eval_prompts
    write_shift_prompts(path, args.shift, load_tokenizer(args.target), n_train, n_eval)
    flag = "" if thinking(args.shift) else " data.enable_thinking=false"
    print(f"{n_train} train and {n_eval} held-out prompts of the {args.shift} shift in {path}")
    print(
        f"train the isolated baseline on them: draftopd train RECIPE data.prompts={path} data.eval_prompts={path}"
        f" data.response_temperature=0{flag}"
    )


def _bench_serve_load(args) -> None:
    from draftopd.bench.serve_load import LoadSettings, run_load, table, versions_plot

    drafter, k = _serve_drafter(args)
    s = LoadSettings(
        target=args.target,
        drafter=drafter,
        seed=args.seed,
        duration_s=args.duration_s,
        concurrency=args.concurrency,
        num_prompts=args.num_prompts,
        max_tokens=args.max_new_tokens,
        num_draft_tokens=k,
        shift=args.shift,
        learner=args.learner,
        server_args=args.server_arg,
        replicas=args.replicas,
        arms=tuple(args.learning_arms),
    )
    reference, traffic = _serve_traffic(args, s.num_prompts)
    chats, expected = traffic(s.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run_load(chats, expected, reference, s, out)
    write_json(_report_path(args), report)
    print(table(report))
    plotted = versions_plot(report, out / "versions_over_time.png")
    print(f"report in {_report_path(args)}" + (f"; replicas' versions plotted in {out}" if plotted else ""))
