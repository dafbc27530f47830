"""`draftopd train` for SFT recipes: responses -> draft vocabulary -> TTT training -> held-out eval.

Reads as the steps it runs; the maths lives in sft/trainer.py and evaluate.py.
"""

from __future__ import annotations

import json
import sys

import torch
from tqdm import tqdm

from draftopd.data.pool import pool_trajectories
from draftopd.data.prompts import encode_chats, load_prompts
from draftopd.drafters import load_drafter, new_drafter, save_drafter
from draftopd.engine.speculative import SpeculativeEngine

# Up into eval/ (which reads SFT's batches in eval/diagnose.py): the SFT phase ends on held-out tau measured the
# one way every command measures it; eval/acceptance.py itself stands on the engine and the messages alone.
from draftopd.eval.acceptance import evaluate, format_table
from draftopd.loading import eos_ids, load_target, load_tokenizer
from draftopd.messages import SamplingConfig, Trajectory
from draftopd.rundir import RunDir
from draftopd.schema import Config
from draftopd.sft.trainer import SFTExample, SFTTrainer
from draftopd.sft.vocab import build_draft_vocab, coverage


def _fingerprint(cfg: Config, prompt_ids) -> str:
    """What the cached responses depend on: target, prompts and decoding settings."""
    import hashlib

    key = json.dumps(
        [
            cfg.target.path,
            cfg.target.dtype,
            prompt_ids,
            cfg.data.response_temperature,
            cfg.data.max_new_tokens,
            cfg.run.seed,
            cfg.data.generate_batch_size,
        ]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def make_responses(target, eos, prompt_ids, cfg: Config, cache_path) -> list[Trajectory]:
    """The target answers every training prompt; cached in the run directory so a rerun reuses them."""
    cache_path = cache_path.with_name(f"{cache_path.stem}-{_fingerprint(cfg, prompt_ids)}.jsonl")
    if cache_path.is_file():
        print(f"reusing target responses from {cache_path}")
        return [Trajectory.from_dict(json.loads(line)) for line in cache_path.read_text().splitlines()]
    engine = SpeculativeEngine(target, None, eos)
    sampling = SamplingConfig(cfg.data.max_new_tokens, cfg.data.response_temperature, 0, cfg.run.seed)
    trajs: list[Trajectory] = []
    bs = cfg.data.generate_batch_size
    with tqdm(total=len(prompt_ids), desc="target responses", unit="prompt") as bar:
        for i in range(0, len(prompt_ids), bs):
            sampling.seed = cfg.run.seed + i
            trajs.extend(engine.generate(prompt_ids[i : i + bs], sampling))
            bar.update(len(prompt_ids[i : i + bs]))
    tmp = cache_path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in trajs))
    tmp.replace(cache_path)
    return trajs


def build_drafter(cfg: Config, target, trajs: list[Trajectory], eos: list[int]):
    if cfg.drafter.init:
        return load_drafter(cfg.drafter.init, target, cfg.drafter.kind)
    responses = [t.output_ids for t in trajs]
    ids = build_draft_vocab(responses, cfg.drafter.draft_vocab_size, target.vocab_size, always=eos)
    print(f"draft vocabulary: {len(ids)} tokens, covering {coverage(responses, ids):.1%} of response tokens")
    return new_drafter(cfg.drafter, target, ids)


def evaluate_drafter(cfg: Config, target, drafter, tokenizer, eos, run: RunDir | None) -> list[dict]:
    chats = load_prompts(cfg.data.eval_prompts, "held_out", cfg.data.num_eval_prompts, cfg.run.seed)
    prompts = encode_chats(tokenizer, chats, cfg.data.enable_thinking)
    reports = []
    total = len(cfg.eval.temperatures) * (1 + len(cfg.eval.num_draft_tokens)) * len(prompts)  # one baseline per temp
    with tqdm(total=total, desc="held-out eval", unit="prompt") as bar:
        for temp in cfg.eval.temperatures:
            baseline = None
            for k in cfg.eval.num_draft_tokens:
                report, baseline = evaluate(
                    target,
                    drafter,
                    eos,
                    prompts,
                    k,
                    temp,
                    cfg.eval.max_new_tokens,
                    cfg.eval.batch_size,
                    cfg.run.seed,
                    baseline,
                    bar,
                )
                reports.append(report)
    if run is not None:
        run.write_json("eval.json", reports)
    return reports


def run_sft(cfg: Config, argv: list[str] | None = None) -> dict:
    argv = list(sys.argv if argv is None else argv)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    torch.manual_seed(cfg.run.seed)
    run = RunDir(cfg, argv)
    print(f"run directory: {run.path}")
    tokenizer = load_tokenizer(cfg.target.path)
    target = load_target(cfg.target.path, cfg.target.aux_layer_ids, cfg.target.dtype)
    eos = eos_ids(tokenizer, cfg.target.path)
    # A pool made by `draftopd prepare-data` for this target and template already holds the target's responses.
    trajs = pool_trajectories(cfg.data.prompts, cfg.target.path, cfg.data.enable_thinking, cfg.data.num_train_prompts)
    if trajs is None:
        chats = load_prompts(cfg.data.prompts, "train", cfg.data.num_train_prompts, cfg.run.seed)
        prompt_ids = encode_chats(tokenizer, chats, cfg.data.enable_thinking)
        trajs = make_responses(target, eos, prompt_ids, cfg, run.path / "responses.jsonl")
    drafter = build_drafter(cfg, target, trajs, eos)
    examples = [SFTExample(t.prompt_ids + t.output_ids, len(t.prompt_ids)) for t in trajs]
    trainer = SFTTrainer(drafter, target, examples, cfg.sft, cfg.run.seed, tokenizer.pad_token_id or 0)
    with tqdm(total=trainer.total_steps, desc="SFT (TTT)", unit="step") as bar:
        for m in trainer.run():
            run.log({"phase": "sft", **m})
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m.get('acc_0', 0):.2f}")
            if cfg.sft.checkpoint_every and m["step"] % cfg.sft.checkpoint_every == 0:
                save_drafter(drafter, run.checkpoint_dir(f"step-{m['step']}"))
    final = run.checkpoint_dir("final")
    save_drafter(drafter, final)
    print(f"drafter saved to {final}")
    reports = evaluate_drafter(cfg, target, drafter.eval(), tokenizer, eos, run)
    print(format_table(reports))
    head = reports[0]
    print(f"held-out tau = {head['tau']:.3f} (K={head['num_draft_tokens']}, temperature={head['temperature']})")
    return {"run_dir": str(run.path), "drafter": str(final), "eval": reports}
