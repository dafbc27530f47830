"""`draftopd prepare-data`: a prompt pool with the target's own answers, in shards on disk.

Steps: read the sources (data/sources.py) -> drop duplicate prompts (hash of the
normalised text, first occurrence kept, across sources) -> draw the held-out
and the training prompts per source by the mixing weights -> render each with
the target's chat template -> the target regenerates every training response
(`native` engine or `vllm`) -> shards of `shard_size` rows and a manifest.

The mix: weights split `num_prompts` (and, drawn the same way and disjoint,
`num_heldout`) between sources, by largest remainders; a source with fewer
usable rows than its share gives all it has and the shortfall is reported, not
moved to other sources. `num_prompts=0` takes every remaining row.

A training row holds the prompt messages, `input_ids` (rendered prompt +
response), `loss_mask` (1 exactly on the regenerated response tokens, the
end-of-sequence token that ended it included; earlier turns of a multi-turn
source are context at 0), the response text and the source name. Held-out
prompts go to `heldout.jsonl`, without responses. Resuming: the manifest
carries a fingerprint of the plan (target, template, decoding settings,
prompts); a rerun with the same fingerprint keeps every shard whose sha256
matches the manifest and redoes the rest.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from draftopd.data.io import PrepareError
from draftopd.data.pool import HELDOUT, MANIFEST, sha256_file, shard_name, write_json, write_rows
from draftopd.data.sources import SourceRows, SourceSpec, read_source

BACKENDS = ("native", "vllm")
FORMATS = ("jsonl", "parquet")


@dataclass
class PrepareSettings:
    """Everything `prepare_data` needs; the CLI flags map one to one."""

    out: str
    sources: list[SourceSpec]
    target: str = "toy"
    num_prompts: int = 0  # training prompts; 0: all
    num_heldout: int = 0
    enable_thinking: bool = True
    backend: str = "native"
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 8
    shard_size: int = 1000
    shard_format: str = "jsonl"
    max_malformed_fraction: float = 0.05
    max_prompt_tokens: int = 0  # 0: no limit
    dtype: str = "float32"
    vllm_python: str | None = None  # a Python with vllm (default: this one)
    memory_fraction: float = 0.2  # vllm's gpu_memory_utilization (host memory share on CPU)
    vllm_eager: bool = False  # vllm's enforce_eager: no torch.compile (starts faster, decodes slower)


@dataclass
class Item:
    source: str
    messages: list[dict]
    prompt_ids: list[int]


@dataclass
class Plan:
    train: list[Item]
    heldout: list[Item]
    stats: dict[str, dict] = field(default_factory=dict)  # per source name


def normalized_hash(chat: list[dict]) -> str:
    """Same prompt up to case and whitespace, same hash."""
    text = "\x1e".join(f"{m['role']}\x1f{' '.join(m['content'].lower().split())}" for m in chat)
    return hashlib.sha256(text.encode()).hexdigest()


def dedup(read: list[SourceRows]) -> tuple[dict[str, list], dict[str, int]]:
    """Unique chats per source, in source order; a chat seen in an earlier source counts as a duplicate here."""
    seen, unique, dups = set(), {}, {}
    for src in read:
        unique[src.spec.name], dups[src.spec.name] = [], 0
        for chat in src.chats:
            h = normalized_hash(chat)
            if h in seen:
                dups[src.spec.name] += 1
            else:
                seen.add(h)
                unique[src.spec.name].append(chat)
    return unique, dups


def quotas(total: int, weights: list[float]) -> list[int]:
    """`total` split by `weights`, largest remainders first (ties: earlier source)."""
    raw = [total * w / sum(weights) for w in weights]
    q = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: (q[i] - raw[i], i))[: total - sum(q)]:
        q[i] += 1
    return q


def make_plan(read: list[SourceRows], s: PrepareSettings, tokenizer) -> Plan:
    """Held-out and training prompts per source (shuffled by seed), rendered; too-long prompts are skipped."""
    from tqdm import tqdm

    from draftopd.data.prompts import encode_chats

    unique, dups = dedup(read)
    weights = [src.spec.weight for src in read]
    held_q = quotas(s.num_heldout, weights)
    train_q = quotas(s.num_prompts, weights) if s.num_prompts else [None] * len(read)
    plan = Plan([], [])
    total = s.num_prompts + s.num_heldout if s.num_prompts else sum(len(c) for c in unique.values())
    with tqdm(total=total, desc="render prompts", unit="prompt") as bar:
        for src, hq, tq in zip(read, held_q, train_q):
            name = src.spec.name
            chats = list(unique[name])
            random.Random(f"{s.seed}-{name}").shuffle(chats)
            held, train, too_long = [], [], 0
            for chat in chats:
                if len(held) >= hq and tq is not None and len(train) >= tq:
                    break
                ids = encode_chats(tokenizer, [chat], s.enable_thinking)[0]
                if s.max_prompt_tokens and len(ids) > s.max_prompt_tokens:
                    too_long += 1
                    continue
                (held if len(held) < hq else train).append(Item(name, chat, ids))
                bar.update(1)
            plan.heldout += held
            plan.train += train
            plan.stats[name] = {
                "kind": src.spec.kind,
                "path": src.spec.path,
                "files": src.files,
                "weight": src.spec.weight,
                "rows": src.num_rows,
                "malformed": src.num_malformed,
                "first_malformed": src.first_malformed,
                "duplicates": dups[name],
                "too_long": too_long,
                "heldout": len(held),
                "train": len(train),
                "requested_heldout": hq,
                "requested_train": tq,
            }
    random.Random(s.seed).shuffle(plan.train)
    random.Random(s.seed + 1).shuffle(plan.heldout)
    return plan


def fingerprint(plan: Plan, s: PrepareSettings, target_dir: str) -> str:
    """What the shards' content depends on; a rerun must match it to reuse them."""
    key = {
        "target": target_dir,
        "thinking": s.enable_thinking,
        "backend": s.backend,
        "decoding": [s.max_new_tokens, s.temperature, s.seed, s.dtype],
        "shards": [s.shard_size, s.shard_format],
        "train": [[it.source, it.prompt_ids] for it in plan.train],
        "heldout": [[it.source, it.messages] for it in plan.heldout],
    }
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]


def _new_manifest(plan: Plan, s: PrepareSettings, target_dir: str, fp: str) -> dict:
    num_shards = -(-len(plan.train) // s.shard_size)
    return {
        "format_version": 1,
        "fingerprint": fp,
        "target": target_dir,
        "template": {"enable_thinking": s.enable_thinking},
        "generation": {
            "backend": s.backend,
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "seed": s.seed,
            "dtype": s.dtype,
        },
        "sources": plan.stats,
        "counts": {
            "rows": sum(v["rows"] for v in plan.stats.values()),
            "malformed": sum(v["malformed"] for v in plan.stats.values()),
            "duplicates": sum(v["duplicates"] for v in plan.stats.values()),
            "too_long": sum(v["too_long"] for v in plan.stats.values()),
            "train": len(plan.train),
            "heldout": len(plan.heldout),
        },
        "heldout": {"file": HELDOUT, "rows": len(plan.heldout)},
        "shard_size": s.shard_size,
        "shard_format": s.shard_format,
        "num_shards": num_shards,
        "shards": [],
        "complete": False,
    }


def _reusable_shards(out: Path, fp: str) -> list[dict]:
    """Shards of an earlier run with the same plan whose files still match their sha256."""
    path = out / MANIFEST
    if not path.is_file():
        return []
    old = json.loads(path.read_text(encoding="utf-8"))
    if old.get("fingerprint") != fp:
        raise PrepareError(
            f"{out} holds a pool made from other sources or settings (fingerprint {old.get('fingerprint')}, "
            f"now {fp}); use a new --out or delete that folder"
        )
    return [
        sh for sh in old["shards"] if (out / sh["file"]).is_file() and sha256_file(out / sh["file"]) == sh["sha256"]
    ]


def _shard_rows(items: list[Item], first: int, outputs: list[tuple[list[int], str]], tokenizer, eos) -> list[dict]:
    rows = []
    for k, (it, (out_ids, finish)) in enumerate(zip(items, outputs)):
        text_ids = out_ids[:-1] if out_ids and out_ids[-1] in eos else out_ids
        rows.append(
            {
                "index": first + k,
                "source": it.source,
                "messages": it.messages,
                "input_ids": it.prompt_ids + list(out_ids),
                "loss_mask": [0] * len(it.prompt_ids) + [1] * len(out_ids),
                "prompt_len": len(it.prompt_ids),
                "response": tokenizer.decode(text_ids, skip_special_tokens=False),
                "finish_reason": finish,
            }
        )
    return rows


def prepare_data(s: PrepareSettings) -> dict:
    """Build (or finish) the pool in `s.out`; returns the manifest and which shards this call generated."""
    from draftopd.loading import eos_ids, load_tokenizer, resolve_target_path

    _check_settings(s)
    read = [read_source(spec, s.max_malformed_fraction) for spec in s.sources]  # bad data fails before any model
    target_dir = str(resolve_target_path(s.target).resolve())
    tokenizer = load_tokenizer(s.target)
    eos = eos_ids(tokenizer, s.target)
    plan = make_plan(read, s, tokenizer)
    if not plan.train:
        raise PrepareError("no training prompts left after deduplication and the held-out split")
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(plan, s, target_dir)
    manifest = _new_manifest(plan, s, target_dir, fp)
    manifest["shards"] = _reusable_shards(out, fp)
    heldout_rows = [{"index": i, "source": it.source, "messages": it.messages} for i, it in enumerate(plan.heldout)]
    write_rows(out / HELDOUT, heldout_rows)
    manifest["heldout"]["sha256"] = sha256_file(out / HELDOUT)
    write_json(out / MANIFEST, manifest)
    done = {sh["index"] for sh in manifest["shards"]}
    pending = [i for i in range(manifest["num_shards"]) if i not in done]

    def finish_shard(index: int, outputs: list) -> None:
        first = index * s.shard_size
        items = plan.train[first : first + s.shard_size]
        path = out / shard_name(index, s.shard_format)
        write_rows(path, _shard_rows(items, first, outputs, tokenizer, eos))
        entry = {"index": index, "file": path.name, "rows": len(items), "first_row": first, "sha256": sha256_file(path)}
        manifest["shards"] = sorted([*manifest["shards"], entry], key=lambda sh: sh["index"])
        write_json(out / MANIFEST, manifest)

    if pending:
        shards = {i: [it.prompt_ids for it in plan.train[i * s.shard_size : (i + 1) * s.shard_size]] for i in pending}
        if s.backend == "native":
            generate_native(s, shards, eos, finish_shard)
        else:
            from draftopd.data.prepare_vllm import generate_vllm

            generate_vllm(s, target_dir, shards, eos, finish_shard)
    manifest["complete"] = len(manifest["shards"]) == manifest["num_shards"]
    write_json(out / MANIFEST, manifest)
    print(format_report(manifest, generated=len(pending)))
    return {"manifest": manifest, "generated_shards": pending}


def _check_settings(s: PrepareSettings) -> None:
    if not s.sources:
        raise PrepareError("no sources: give --source KIND[=PATH][:WEIGHT] or --mix FILE")
    names = [spec.name for spec in s.sources]
    if len(set(names)) != len(names):
        raise PrepareError(f"source names must be unique, got {names} (a mix file can name two of one kind)")
    if s.backend not in BACKENDS:
        raise PrepareError(f"unknown backend {s.backend!r}; choose from {BACKENDS}")
    if s.shard_format not in FORMATS:
        raise PrepareError(f"unknown shard format {s.shard_format!r}; choose from {FORMATS}")
    if s.shard_size < 1 or s.batch_size < 1 or s.max_new_tokens < 1 or s.num_prompts < 0 or s.num_heldout < 0:
        raise PrepareError("shard size, batch size and max new tokens must be positive, prompt counts not negative")


def generate_native(s: PrepareSettings, shards: dict[int, list[list[int]]], eos: list[int], on_shard) -> None:
    """The target alone in draftopd's engine, `batch_size` prompts at a time; seeds follow the row index."""
    from tqdm import tqdm

    from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
    from draftopd.loading import load_target

    engine = SpeculativeEngine(load_target(s.target, None, s.dtype), None, eos)
    with tqdm(total=sum(len(p) for p in shards.values()), desc="target responses", unit="prompt") as bar:
        for index, prompts in shards.items():
            outputs = []
            for b in range(0, len(prompts), s.batch_size):
                cfg = SamplingConfig(s.max_new_tokens, s.temperature, 0, s.seed + index * s.shard_size + b)
                trajs = engine.generate(prompts[b : b + s.batch_size], cfg)
                outputs += [(t.output_ids, t.finish_reason) for t in trajs]
                bar.update(len(trajs))
            on_shard(index, outputs)


def format_report(manifest: dict, generated: int) -> str:
    head = f"{'source':<14} {'rows':>8} {'malformed':>9} {'dups':>6} {'too long':>8} {'train':>7} {'held-out':>8}"
    lines = [head]
    for name, v in manifest["sources"].items():
        short = v["requested_train"] is not None and v["train"] < v["requested_train"]
        lines.append(
            f"{name:<14} {v['rows']:>8} {v['malformed']:>9} {v['duplicates']:>6} {v['too_long']:>8} "
            f"{v['train']:>7} {v['heldout']:>8}" + (f"  (short of {v['requested_train']})" if short else "")
        )
        if v["first_malformed"]:
            lines.append(f"  first malformed row: {v['first_malformed']}")
    done = len(manifest["shards"])
    lines.append(
        f"{manifest['counts']['train']} training prompts in {manifest['num_shards']} shards "
        f"({done} done, {generated} generated now), {manifest['counts']['heldout']} held out"
    )
    return "\n".join(lines)
