"""Seconds per fleet-learner step against the prompt's length, for a trained drafter on the toy target: the rows the
loss weighs (what `DraftLearner.opd_step` scores for a family that `scores_rows`) against the whole grid.

    python scripts/replay_step_cost.py --drafter RUN/drafters/dflash-sft/checkpoints/final --prompt-tokens 60 430

Builds the fleet's learner (opd's DraftLearner, world size 1, one torch thread) and feeds it stock records with
random tokens: --num-records responses of --response-tokens after a prompt of each length, 1-3 tokens a step as a
stock record has them. The prompt is cut to --context-tokens as the fleet's learner cuts it. Prints one JSON line
per (prompt length, grid): mean seconds of --steps learner steps after one warm-up step, and the tokens a step
carried. Time it alone: anything else on the cores changes the figures.
"""

import argparse
import json
import random
import time


def records(n: int, prompt: int, response: int, k: int, seed: int):
    from draftopd.messages import Trajectory
    from draftopd.vllm_backend.steps import stock_steps

    rng, out = random.Random(seed), []
    for _ in range(n):
        ids = [rng.randrange(100, 2000) for _ in range(response)]
        accepted, cursor = [], 1
        while cursor < len(ids):
            a = min(rng.randrange(0, 3), len(ids) - cursor - 1)
            accepted.append(a)
            cursor += a + 1
        prompt_ids = [rng.randrange(100, 2000) for _ in range(prompt)]
        t = Trajectory(prompt_ids=prompt_ids, output_ids=ids, num_draft_tokens=k, policy_version=0)
        t.steps = stock_steps(t, {"per_step_accepted": accepted, "per_step_drafted": [k] * len(accepted)})
        out.append(t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="a drafter directory (config.json + model.safetensors)")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[60, 430])
    p.add_argument("--context-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=90)
    p.add_argument("--num-records", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=0, help="K (0: 7 for DFlash, 4 otherwise)")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()

    import torch

    from draftopd.drafters import family, read_raw
    from draftopd.loading import resolve_target_path
    from draftopd.opd.learner import LearnerSpec
    from draftopd.schema import DrafterConfig
    from draftopd.serve.fleet_learner import FleetLearner
    from draftopd.serve.learner import LearnerSettings

    torch.set_num_threads(1)
    kind, raw = read_raw(a.drafter)
    fam = family(kind)
    k = a.num_draft_tokens or (7 if kind == "dflash" else 4)
    target_dir = str(resolve_target_path("toy").resolve())
    spec = LearnerSpec(target_dir, list(fam.target_layers(raw) or []), "float32", DrafterConfig(kind=kind), a.drafter)
    spec.num_threads = 1
    grids = ["weighed rows", "whole grid"] if getattr(fam, "scores_rows", False) else ["whole grid"]
    for prompt in a.prompt_tokens:
        for grid in grids:
            fam.scores_rows = grid == "weighed rows"  # the class attribute replay_forward reads
            s = LearnerSettings(context_tokens=a.context_tokens, min_traffic=8, num_draft_tokens=k)
            s.loss = {"rej_coef": 0.0}  # stock records: the accepted stream only, as the fleet trains
            learner = FleetLearner(spec, s, [0])
            learner.setup()
            learner.add(records(a.num_records, prompt, a.response_tokens, k, seed=prompt))
            learner._step()  # warm-up
            t0 = time.monotonic()
            for _ in range(a.steps):
                m = learner._step()
            sec = (time.monotonic() - t0) / a.steps
            row = {"kind": kind, "prompt_tokens": prompt, "context_tokens": a.context_tokens, "grid": grid}
            print(json.dumps({**row, "seconds_per_step": round(sec, 3), "tokens_per_step": m.get("num_tokens")}))


if __name__ == "__main__":
    main()
