"""The `vllm` backend of `draftopd prepare-data`: the target answers the pool's prompts in stock vLLM.

vLLM runs in its own process (`python -m draftopd.data.prepare_vllm JOB.json`):
its `LLM` spawns engine processes, which needs the caller under
`if __name__ == "__main__"`, it is not reliably torn down inside one process, and
it may live in another virtual environment (`--vllm-python`), since it pins its
own torch and transformers. The job holds the rendered prompt ids per shard; the
worker writes one JSON line per finished shard to the job's `out` file, and the
parent turns each line into a shard as it appears, so an interrupted run keeps
the shards it finished. Only this module's `main` imports vllm.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(job: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {k: job[k] for k in ("max_model_len", "enforce_eager") if job.get(k)}
    llm = LLM(
        model=job["target"],
        dtype=job["dtype"],
        seed=job["seed"],
        # on CPU: the share of host memory vLLM reserves for its KV cache (its default, 0.92, rarely fits)
        gpu_memory_utilization=job["memory_fraction"],
        **extra,
    )
    with open(job["out"], "a", encoding="utf-8") as out:
        for shard in job["shards"]:
            params = SamplingParams(
                temperature=job["temperature"],
                max_tokens=job["max_new_tokens"],
                stop_token_ids=job["eos"],
                seed=job["seed"] + shard["first_row"],
            )
            results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in shard["prompts"]], params)
            outputs = [_output(r.outputs[0], job["eos"]) for r in results]
            out.write(json.dumps({"index": shard["index"], "outputs": outputs}) + "\n")
            out.flush()


def _output(completion, eos: list[int]) -> list:
    """(token ids, finish reason), ids ending with the end-of-sequence token that stopped them, as the native
    engine returns them."""
    ids = list(completion.token_ids)
    reason = completion.finish_reason
    if reason == "stop" and isinstance(completion.stop_reason, int) and (not ids or ids[-1] != completion.stop_reason):
        ids.append(completion.stop_reason)
    ids = ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))]
    return [ids, "stop" if ids and ids[-1] in eos else "length"]


def generate_vllm(s, target_dir: str, shards: dict[int, list[list[int]]], eos: list[int], on_shard) -> None:
    """Run the worker on every pending shard; `on_shard(index, outputs)` as each shard's line arrives."""
    from draftopd.data.sources import PrepareError

    python = s.vllm_python or sys.executable
    with tempfile.TemporaryDirectory(prefix=".vllm-", dir=s.out) as tmp:
        job = {
            "target": target_dir,
            "dtype": s.dtype,
            "seed": s.seed,
            "memory_fraction": s.memory_fraction,
            "enforce_eager": s.vllm_eager,
            "temperature": s.temperature,
            "max_new_tokens": s.max_new_tokens,
            "eos": eos,
            "out": str(Path(tmp) / "outputs.jsonl"),
            "shards": [{"index": i, "first_row": i * s.shard_size, "prompts": p} for i, p in shards.items()],
        }
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        Path(job["out"]).touch()
        print(f"vLLM backend: {len(shards)} shards in {python} -m draftopd.data.prepare_vllm")
        proc = subprocess.Popen([python, "-m", "draftopd.data.prepare_vllm", str(job_path)])
        offset = 0
        while True:
            rc = proc.poll()
            offset = _take_lines(Path(job["out"]), offset, on_shard)
            if rc is not None:
                break
            time.sleep(1.0)
    if rc != 0:
        raise PrepareError(f"the vLLM backend exited with status {rc}; finished shards are kept, rerun to resume")


def _take_lines(path: Path, offset: int, on_shard) -> int:
    """Hand every complete new line of `path` (past byte `offset`) to `on_shard`; returns the new offset."""
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].decode("utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            on_shard(row["index"], [tuple(o) for o in row["outputs"]])
    return offset + end


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m draftopd.data.prepare_vllm JOB.json", file=sys.stderr)
        return 2
    run(json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
