"""The fleet learner's pace on a shift: learner steps per minute of step time and per wall minute, for a 2-replica
fleet serving the toy target with the shipped EAGLE-3 drafter, learning on.

    python scripts/fleet_learner_pace.py --shift long-context --context-tokens 256 --response-tokens 128

Sends --num-requests chats of the shift through the openai client (4 at a time), lets the learner work for
--learn-s more seconds, and prints one JSON line: steps, step seconds, steps per step-minute, steps per wall
minute since the learner's first step, records and live tau.
"""

import argparse
import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shift", default="thinking-off")
    p.add_argument("--context-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--learn-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="fleet-pace-run")
    a = p.parse_args()

    import openai
    import ray

    from draftopd.bench.serve_traffic import shifted_chats, thinking
    from draftopd.loading import load_tokenizer
    from draftopd.serve.fleet import Fleet, FleetSettings
    from draftopd.serve.settings import ServeSettings

    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    learner = {"context_tokens": a.context_tokens, "response_tokens": a.response_tokens, "min_traffic": 8}
    s = ServeSettings(api_key="pace", port=8790, served_model_name="toy", run_dir=a.run_dir, learner=learner)
    fleet = Fleet(s, FleetSettings(replicas=2, work_s=3.0))
    loop, started = asyncio.new_event_loop(), asyncio.Event()
    runner = threading.Thread(target=loop.run_until_complete, args=(fleet.run(started),), daemon=True)
    runner.start()
    while not started.is_set():
        time.sleep(0.5)
    tok = load_tokenizer("toy")
    chats = shifted_chats(a.num_requests, a.seed, a.shift, tokenizer=tok, split="train")
    client = openai.OpenAI(base_url="http://127.0.0.1:8790/v1", api_key="pace", max_retries=0, timeout=300)
    extra = {"chat_template_kwargs": {"enable_thinking": thinking(a.shift)}}

    def one(chat):
        client.chat.completions.create(model="toy", messages=chat, max_tokens=96, temperature=0.0, extra_body=extra)

    first = None
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, chats))
    end = time.monotonic() + a.learn_s
    while time.monotonic() < end:
        c = fleet.learner_counters
        if first is None and c.get("steps"):
            first = (time.monotonic(), c["steps"])
        time.sleep(1)
    c = fleet.learner_counters
    wall = time.monotonic() - first[0] if first else float("nan")
    out = {
        "shift": a.shift,
        "context_tokens": a.context_tokens,
        "response_tokens": a.response_tokens,
        "steps": c.get("steps"),
        "step_seconds": round(c.get("step_seconds", 0.0), 2),
        "steps_per_step_minute": round(60 * c["steps"] / c["step_seconds"], 1) if c.get("step_seconds") else None,
        "steps_per_wall_minute": round(60 * (c["steps"] - first[1]) / wall, 1) if first else None,
        "records": fleet.counts["records"],
        "live": fleet.live.summary()["live"],
        "tokens_per_row": c.get("last_step", {}).get("num_tokens"),
    }
    print(json.dumps(out), flush=True)
    loop.call_soon_threadsafe(fleet.stop)
    runner.join(120)  # the replicas stopped and their processes gone before Ray goes


if __name__ == "__main__":
    main()
