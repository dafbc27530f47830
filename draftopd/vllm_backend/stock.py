"""Stock vLLM: the one place draftopd builds a `vllm.LLM`, decodes with it and cuts at end-of-sequence.

`build_llm`, `generate` and `completion_ids` (with `cut_at_eos`) serve every
vLLM path, the recording engine (engine.py) included; `engine_config` gives the
config such an engine would start with, for checks made before it starts. `run_job` runs a stock
job in a process of its own (`python -m draftopd.vllm_backend.stock JOB.json`),
with a given Python or this one: vLLM pins its own torch and transformers, so
it may live in another virtual environment; its `LLM` spawns engine processes on a GPU,
which needs the caller under `if __name__ == "__main__"`; and on CPU an engine
runs in its caller's process, seeding that process's random state and starting
torch.distributed there. The worker side imports
nothing from draftopd but this file, and vllm only inside functions.

A job (JSON):
    llm: an `LlmSettings` as a dict;
    eos: the end-of-sequence ids;
    batches: [{index, prompts, temperature, max_new_tokens, seed}], each one
        `generate` call, decoded in order;
    warmup: decode the first prompt once, untimed, before the batches;
    progress: show vLLM's progress bar.
The worker appends one JSON line per batch to the job's `out` file as it
finishes, `{index, outputs: [[token ids, finish reason]], seconds}`, then
`{done: true, spec: {drafts, accepted}}` with vLLM's speculative-decoding
counters over the batches (zeros unless `log_stats`). The parent hands each
line on as it appears, so a caller keeps what finished before a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MODULE = "draftopd.vllm_backend.stock"
INPROC_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # vLLM's: 0 runs a `vllm.LLM`'s engine core in its caller's process


@dataclass
class LlmSettings:
    """How a `vllm.LLM` is built; a job carries it as a dict."""

    target: str  # the target model's directory
    speculative_config: dict | None = None  # vLLM's (a drafter family's `speculative_config`); None: target alone
    dtype: str = "float32"
    seed: int = 0
    memory_fraction: float = 0.2  # gpu_memory_utilization; on CPU the share of host memory (0.92 rarely fits)
    max_model_len: int | None = None  # None: the model's own
    enforce_eager: bool = False  # no torch.compile: starts faster (minutes less on CPU), decodes slower
    enable_prefix_caching: bool = True
    log_stats: bool = False  # vLLM's metrics, the speculative-decoding counters among them


class VllmJobError(RuntimeError):
    """A vLLM job's process failed; `status` is its exit status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def llm_kwargs(s: LlmSettings, **extra) -> dict:
    """The keyword arguments of the `vllm.LLM` the settings describe (`EngineArgs` takes the same ones)."""
    return dict(
        model=str(s.target),
        dtype=s.dtype,
        seed=s.seed,
        speculative_config=s.speculative_config,
        gpu_memory_utilization=s.memory_fraction,
        max_model_len=s.max_model_len,
        enforce_eager=s.enforce_eager,
        enable_prefix_caching=s.enable_prefix_caching,
        disable_log_stats=not s.log_stats,
        **extra,
    )


def build_llm(s: LlmSettings, **extra):
    """A `vllm.LLM` from the settings; `extra` goes to `LLM` as is (a worker extension, per-request metrics).
    On vLLM's CPU platform its engine core and worker run in this process (`one_process_on_cpu`)."""
    from vllm import LLM

    with one_process_on_cpu():
        return LLM(**llm_kwargs(s, **extra))


@contextmanager
def one_process_on_cpu():
    """On vLLM's CPU platform, what vLLM builds inside this block runs its model worker in the engine core's process
    (vLLM's one-process executor, as on a single GPU), and a `vllm.LLM` its engine core in the caller's process.

    vLLM's CPU platform otherwise spawns an engine core and a worker process, each importing vLLM again and the
    worker left one core of the machine (the other reserved for the core's loop): 41 s to start the toy target's
    EAGLE-3 engine on 2 cores against 12 s in one process, 2 s for a second one (measured). What the spawned worker
    adds is OpenMP thread binding for serving real models on many cores; draftopd's CPU engines are the CPU
    twins of its GPU ones. The environment is vLLM's own switch (`VLLM_ENABLE_V1_MULTIPROCESSING`), set for the
    block only; vLLM's CPU worker disables `torch.set_num_threads` in its process, which is then the caller's,
    so it is put back. On a GPU nothing changes."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    before, set_threads = os.environ.get(INPROC_ENV), torch.set_num_threads
    os.environ[INPROC_ENV] = "0"
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if before is None:
            os.environ.pop(INPROC_ENV, None)
        else:
            os.environ[INPROC_ENV] = before


def engine_config(s: LlmSettings, **extra):
    """The `VllmConfig` that `build_llm(s, **extra)` would start its engine with, built without starting one
    (seconds: configs only), so choices vLLM makes from it (its model runner) can be checked beforehand."""
    from vllm.engine.arg_utils import EngineArgs

    with one_process_on_cpu():  # as build_llm's: on CPU the one-process executor
        return EngineArgs(**llm_kwargs(s, **extra)).create_engine_config()


def generate(
    llm,
    prompts: list[list[int]],
    eos: list[int],
    temperature: float,
    max_new_tokens: int,
    seed: int | None = None,
    progress: bool = False,
) -> tuple[list[str], list]:
    """Decode token-id prompts in one vLLM batch. Returns vLLM's request ids (as its workers see them) and the
    `RequestOutput`s, both in prompt order."""
    from vllm import RequestOutput, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, stop_token_ids=list(eos), seed=seed)
    ids = llm.enqueue([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    outs = llm.wait_for_completion(RequestOutput, use_tqdm=progress)  # in the order enqueued
    if len(outs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(outs)} outputs for {len(ids)} requests")
    return ids, outs


def cut_at_eos(ids: list[int], eos: list[int]) -> list[int]:
    """Token ids up to and with the first end-of-sequence id (all of them when none is there)."""
    return list(ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))])


def completion_ids(completion, eos: list[int]) -> tuple[list[int], str]:
    """A vLLM completion as the native engine returns one: ids cut at end-of-sequence, and "stop" when one ended
    them, else "length". A stop id vLLM reports only as `stop_reason` is put back first."""
    ids = list(completion.token_ids)
    stop = completion.stop_reason
    if completion.finish_reason == "stop" and isinstance(stop, int) and (not ids or ids[-1] != stop):
        ids.append(stop)
    ids = cut_at_eos(ids, eos)
    return ids, "stop" if ids and ids[-1] in eos else "length"


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters: drafts (verification steps) and accepted draft tokens."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = {"drafts": 0, "accepted": 0}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] = getattr(m, "value", 0)
    return out


def run(job: dict, emit) -> None:
    """The worker: build the LLM, decode every batch, `emit` a line per batch and a last one with the counters."""
    settings = LlmSettings(**job["llm"])
    llm = build_llm(settings)
    eos, batches = job["eos"], job["batches"]

    def decode(b: dict, prompts: list) -> list:
        seed = b.get("seed")
        return generate(llm, prompts, eos, b["temperature"], b["max_new_tokens"], seed, job.get("progress", False))[1]

    if job.get("warmup") and batches:
        decode(batches[0], batches[0]["prompts"][:1])
    zeros = {"drafts": 0, "accepted": 0}
    before = spec_counters(llm) if settings.log_stats else zeros
    for b in batches:
        start = time.perf_counter()
        outs = decode(b, b["prompts"])
        seconds = time.perf_counter() - start
        emit({"index": b["index"], "outputs": [completion_ids(o.outputs[0], eos) for o in outs], "seconds": seconds})
    after = spec_counters(llm) if settings.log_stats else zeros
    emit({"done": True, "spec": {k: after[k] - before[k] for k in zeros}})


def run_job(
    job: dict,
    python: str | None = None,
    module: str = MODULE,
    on_line: Callable[[dict], None] | None = None,
    workdir: str | Path | None = None,
    show_log: bool = False,
) -> list[dict]:
    """Run `python -m module JOB.json` (this Python by default) and return the JSON lines it wrote, each also
    handed to `on_line` as it appears. vLLM's log goes to this process's output with `show_log`, else into the
    error raised when the process fails."""
    python = python or sys.executable
    lines = []
    with tempfile.TemporaryDirectory(prefix=".vllm-", dir=workdir) as tmp:
        out, job_path, log_path = Path(tmp) / "out.jsonl", Path(tmp) / "job.json", Path(tmp) / "log.txt"
        out.touch()
        job_path.write_text(json.dumps({**job, "out": str(out)}))
        with log_path.open("w") as log:
            sink = None if show_log else log
            proc = subprocess.Popen([python, "-m", module, str(job_path)], stdout=sink, stderr=sink)
            try:
                offset = 0
                while True:
                    rc = proc.poll()
                    offset = _take_lines(out, offset, lines, on_line)
                    if rc is not None:
                        break
                    time.sleep(0.2)
            finally:
                if proc.poll() is None:  # interrupted: stop the worker, which stops vLLM's engine process
                    proc.terminate()
                    proc.wait()
        if rc != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]  # empty with show_log
            raise VllmJobError(f"the vLLM process ({python} -m {module}) exited with status {rc} {tail}", rc)
    return lines


def _take_lines(path: Path, offset: int, lines: list, on_line) -> int:
    """Every complete new line of `path` past byte `offset` into `lines` (and `on_line`); returns the new offset."""
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for text in data[:end].decode("utf-8").splitlines():
        if text.strip():
            lines.append(json.loads(text))
            if on_line is not None:
                on_line(lines[-1])
    return offset + end


def worker_main(argv: list[str], work: Callable[[dict, Callable[[dict], None]], None]) -> int:
    """The `__main__` of a job's process: read JOB.json, call `work(job, emit)`; `emit` appends a JSON line to
    the job's `out` file at once."""
    if len(argv) != 1:
        print("usage: python -m MODULE JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    with open(job["out"], "a", encoding="utf-8") as f:

        def emit(row: dict) -> None:
            f.write(json.dumps(row) + "\n")
            f.flush()

        work(job, emit)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], run))
