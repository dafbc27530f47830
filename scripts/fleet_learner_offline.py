"""The fleet's learner offline on a shift's traffic: does a learner setting make candidates the guard would promote?

    python scripts/fleet_learner_offline.py --drafter RUN/drafters/pard-sft/checkpoints/final --shift long-context \
        --steps 40 --judge-every 20 --set lr=5e-4 --set lr=1e-4

Decodes `--requests` chats of the shift (the bench's traffic for `--seed`) with the native engine, greedy, the
drafter drafting K per step, and keeps each response as the fleet keeps it: a stock record (prompt and output ids
and the per-step accepted counts vLLM reports). Then, for each `--set` (LearnerSettings overrides, `,`-separated
FIELD=VALUE; `loss.FIELD=VALUE` for the loss), a fresh FleetLearner (opd's DraftLearner, one thread) takes the
records as the fleet does (every 5th held out), steps `--steps` times, and the guard judges its snapshot against
the starting drafter every `--judge-every` steps. Prints one JSON line per judgment: tau of candidate and
incumbent on the held-out requests, the paired lower bound, how many requests got worse, and the loss.
Run it alone: the figures are learner seconds on these cores.
"""

import argparse
import json
import time


def parse_set(text: str) -> tuple[dict, dict]:
    told, loss = {}, {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        value = json.loads(value) if value[:1] in "[{" or value in ("true", "false") else value
        if isinstance(value, str):
            try:
                value = int(value) if value.lstrip("-").isdigit() else float(value)
            except ValueError:
                pass
        (loss if key.startswith("loss.") else told)[key.removeprefix("loss.")] = value
    return told, loss


def stock_records(target, drafter, eos, prompts, k, max_tokens):
    from draftopd.engine.speculative import SpeculativeEngine
    from draftopd.messages import SamplingConfig, Trajectory
    from draftopd.vllm_backend.steps import stock_steps

    engine, out = SpeculativeEngine(target, drafter, eos), []
    for i in range(0, len(prompts), 16):
        for t in engine.generate(prompts[i : i + 16], SamplingConfig(max_tokens, 0.0, k, 0)):
            accepted = [st.num_accepted for st in t.steps]
            rec = Trajectory(prompt_ids=t.prompt_ids, output_ids=t.output_ids, num_draft_tokens=k, policy_version=0)
            rec.steps = stock_steps(rec, {"per_step_accepted": accepted, "per_step_drafted": [k] * len(accepted)})
            out.append(rec)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="a drafter directory (config.json + model.safetensors)")
    p.add_argument("--shift", default="long-context", choices=["thinking-off", "long-context"])
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-draft-tokens", type=int, default=0, help="K (0: the bench's K for the family)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--judge-every", type=int, default=20)
    p.add_argument("--set", action="append", default=[], help="LearnerSettings overrides of one arm ('' : none)")
    a = p.parse_args()

    import torch

    from draftopd.bench.family_drafters import family_k
    from draftopd.bench.serve_traffic import shifted_chats, thinking
    from draftopd.data.prompts import encode_chats
    from draftopd.drafters import family, load_drafter, read_raw
    from draftopd.loading import eos_ids, load_target, load_tokenizer, resolve_target_path
    from draftopd.opd.learner import LearnerSpec
    from draftopd.schema import DrafterConfig
    from draftopd.serve.fleet_learner import FleetLearner
    from draftopd.serve.learner import LearnerSettings

    torch.set_num_threads(1)
    kind, raw = read_raw(a.drafter)
    fam = family(kind)
    k = a.num_draft_tokens or family_k(kind)
    target_dir = str(resolve_target_path("toy").resolve())
    tok = load_tokenizer(target_dir)
    eos = eos_ids(tok, target_dir)
    layers = list(fam.target_layers(raw) or [])
    target = load_target(target_dir, layers)
    chats = shifted_chats(a.requests, a.seed, a.shift, None, tok)
    prompts = encode_chats(tok, chats, thinking(a.shift))
    t0 = time.monotonic()
    recs = stock_records(target, load_drafter(a.drafter, target), eos, prompts, k, a.max_tokens)
    taus = [len(r.output_ids[1:]) / max(len(r.steps), 1) for r in recs]
    print(
        json.dumps(
            {
                "records": len(recs),
                "live_tau": round(sum(taus) / len(taus), 3),
                "k": k,
                "decode_s": round(time.monotonic() - t0, 1),
            }
        ),
        flush=True,
    )
    for arm in a.set or [""]:
        told, loss = parse_set(arm)
        s = LearnerSettings(num_draft_tokens=k, **told)
        s.loss = {"rej_coef": 0.0, **loss}  # stock records: the accepted stream, as the fleet trains
        spec = LearnerSpec(target_dir, layers, "float32", DrafterConfig(kind=kind), a.drafter)
        spec.lr, spec.num_threads, spec.seed = s.lr, 1, s.seed
        learner = FleetLearner(spec, s, eos)
        learner.setup()
        learner.add(recs)
        losses = [float("nan")]
        for step in range(0, a.steps + 1):
            if step:
                losses.append(learner._step().get("loss", float("nan")))
            if step % a.judge_every:
                continue
            held = list(learner.held)[-s.holdout_n :]
            v = learner._judge(learner._snapshot(), held)
            worse = sum(c < i for c, i in zip(v.taus_candidate, v.taus_incumbent))
            row = {
                "arm": arm,
                "step": step,
                "tau_candidate": v.tau_candidate,
                "tau_incumbent": v.tau_incumbent,
                "ratio": v.ratio,
                "lower": v.lower,
                "worse": worse,
                "n": v.n,
                "promote": v.promote,
                "loss_mean_last": sum(losses[-a.judge_every :]) / a.judge_every,
                "step_s": round(learner.step_seconds / max(learner.steps, 1), 2),
            }
            print(json.dumps({k2: round(x, 3) if isinstance(x, float) else x for k2, x in row.items()}), flush=True)


if __name__ == "__main__":
    main()
