"""data/: an acyclic import graph, and the Hugging Face datasets cache read by repository, config and split."""

import ast
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from draftopd.data.eval_sets import load_set
from draftopd.data.io import CachedSplit, DataError, EvalSetError, PrepareError, cache_folder, found_rows
from draftopd.data.sources import SourceSpec, locate, read_source

DATA = Path(__file__).parents[1] / "draftopd" / "data"


def write_hf_cache(cache_dir: Path, repo: str, config: str, splits: dict[str, list[dict]]) -> Path:
    """`repo`'s config as `load_dataset(repo, config)` leaves it in a datasets cache, written by the `datasets`
    library itself (its JSON builder, from local files; nothing is downloaded). Returns the config's folder."""
    from datasets.packaged_modules.json.json import Json

    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for split, rows in splits.items():
            files[split] = os.path.join(tmp, f"{split}.jsonl")
            Path(files[split]).write_text("".join(json.dumps(r) + "\n" for r in rows))
        build = Path(tmp, "build")
        name = repo.split("/")[-1]
        builder = Json(
            cache_dir=str(build),
            dataset_name=name,
            config_name=config,
            config_id=config,
            hash="0123abcd",
            data_files=files,
        )
        builder.download_and_prepare()
        # A download keeps the repository's namespace in the folder name (`openai___gsm8k`); a local build cannot.
        dest = cache_dir / cache_folder(repo) / config
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(build / cache_folder(name) / config), dest)
    return dest


def _imports(path: Path) -> set[str]:
    """The `draftopd.data` modules a module imports, at the top or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "draftopd.data":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("draftopd.data."):
            out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("draftopd.data.")}
    return out - {path.stem}


def test_data_modules_import_no_cycle():
    graph = {p.stem: _imports(p) for p in DATA.glob("*.py")}

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        for nxt in sorted(graph.get(node, ())):
            if found := cycle_from(nxt, [*path, node]):
                return found
        return None

    for module in sorted(graph):
        cycle = cycle_from(module, [])
        assert cycle is None, " -> ".join(cycle)
    assert graph["io"] == set()  # the readers and errors everything else builds on


GSM8K = {
    "train": [{"question": f"train question {i}", "answer": "1"} for i in range(3)],
    "test": [{"question": f"test question {i}", "answer": "2"} for i in range(2)],
}


def test_cached_set_is_read_by_config_and_split(tmp_path, monkeypatch):
    write_hf_cache(tmp_path, "openai/gsm8k", "main", GSM8K)
    write_hf_cache(tmp_path, "openai/gsm8k", "socratic", {"test": [{"question": "a socratic one", "answer": "3"}]})
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    [test] = locate("gsm8k", "test")
    assert test == CachedSplit("openai/gsm8k", "main", "test", tmp_path)
    assert [row for _, row in found_rows(test)] == GSM8K["test"]
    assert "HF_DATASETS_OFFLINE" not in os.environ  # offline for the call only
    s = load_set("gsm8k")
    assert [c[0][0]["content"] for c in s.conversations] == ["test question 0", "test question 1"]
    assert s.source == f"openai/gsm8k (config main, split test) in the datasets cache {tmp_path}"
    train = read_source(SourceSpec("gsm8k", "gsm8k"), 0.0)
    assert [c[0]["content"] for c in train.chats] == [r["question"] for r in GSM8K["train"]]
    # the cache, or one repository folder of it, given as the path
    assert locate("gsm8k", "train", str(tmp_path)) == locate("gsm8k", "train", str(tmp_path / "openai___gsm8k"))
    # an Arrow file of the cache given by name is read as it is
    [arrow] = (tmp_path / "openai___gsm8k" / "main").rglob("gsm8k-test.arrow")
    assert len(load_set("gsm8k", str(arrow)).conversations) == 2


def test_missing_config_or_split_is_one_line_naming_what_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    assert locate("mbpp", "test") == []  # not cached at all: the caller says where to give a path
    write_hf_cache(tmp_path, "openai/gsm8k", "socratic", GSM8K)
    write_hf_cache(tmp_path, "openai/gsm8k", "other", GSM8K)
    with pytest.raises(EvalSetError) as err:
        load_set("gsm8k")
    assert str(err.value) == (
        f"gsm8k: openai/gsm8k in the datasets cache {tmp_path} has config(s) other, socratic, not 'main'"
    )
    write_hf_cache(tmp_path, "google-research-datasets/mbpp", "full", {"train": [{"text": "Write a sort."}]})
    with pytest.raises(EvalSetError) as err:
        load_set("mbpp")
    assert "\n" not in str(err.value) and str(err.value).endswith("has split(s) train, not 'test'")
    write_hf_cache(tmp_path, "EleutherAI/hendrycks_math", "algebra", {"train": [{"problem": "x + 1 = 2"}]})
    with pytest.raises(
        PrepareError, match=r"^source math: .* has config\(s\) algebra, not 'counting_and_probability'$"
    ):
        read_source(SourceSpec("math", "math"), 0.0)
    with pytest.raises(DataError, match="does not exist"):
        locate("gsm8k", "test", str(tmp_path / "nowhere"))
