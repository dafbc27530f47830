"""Recipes resolve against the schema; typos and wrong types are errors that say where."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftopd.config import ConfigError, load_config, to_dict

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.yaml"))


def test_the_shipped_toy_recipes_are_among_those_checked():
    """The parametrized test below would pass with no recipe at all; the ones the README runs must be in it."""
    assert {"toy-sft.yaml", "toy-opd.yaml", "toy-opd-vllm.yaml"} <= {p.name for p in RECIPES}


def _leaves(node, prefix=()):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _merged(under: dict, over: dict) -> dict:
    out = dict(under)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _written(recipe: Path) -> dict:
    """The values a recipe file sets, over those its `base` chain sets: what the loaded config must hold."""
    data = OmegaConf.to_container(OmegaConf.load(recipe), resolve=True) or {}
    base = data.pop("base", None)
    return _merged(_written(recipe.parent / base), data) if base else data


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_with_its_own_values(recipe):
    """Each value the recipe file (or its base) sets is the value of the loaded config (not a default, not another
    recipe's)."""
    cfg = load_config(recipe)
    assert cfg.sft.ttt_depth >= 1 and cfg.drafter.draft_vocab_size > 0
    loaded = to_dict(cfg)
    written = _written(recipe)
    checked = 0
    for path, value in _leaves({k: v for k, v in written.items() if k in loaded}):  # sections, not composition
        node = loaded
        for key in path:
            node = node[key]
        assert node == value, (".".join(path), node, value)
        checked += 1
    assert checked, f"{recipe.name} sets no config value"


def test_overrides_apply_with_types():
    cfg = load_config(None, ["sft.epochs=5", "drafter.norm_output=true", "eval.num_draft_tokens=[2,3]"])
    assert cfg.sft.epochs == 5 and cfg.drafter.norm_output is True and cfg.eval.num_draft_tokens == [2, 3]


@pytest.mark.parametrize(
    "override, message",
    [
        ("sft.epoch=5", "unknown config key 'sft.epoch'; did you mean 'sft.epochs'?"),
        ("sftt.epochs=1", "unknown config key 'sftt'; did you mean 'sft'?"),
        ("drafter.norm_outptu=true", "did you mean 'drafter.norm_output'?"),
    ],
)
def test_unknown_keys_name_the_closest(override, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace(".", r"\.")):
        load_config(None, [override])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="sft.epochs"):
        load_config(None, ["sft.epochs=many"])


def test_recipe_typo_is_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  lr: 0.001\n  ttt_dept: 3\n")
    with pytest.raises(ConfigError, match="sft.ttt_depth"):
        load_config(bad)


def test_missing_recipe_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_a_recipe_overrides_its_base_chain(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base/gpu.yaml").write_text("sft: {epochs: 3, lr: 0.5}\nrollout: {num_workers: 2}\n")
    (tmp_path / "mid.yaml").write_text("base: base/gpu.yaml\nsft: {epochs: 4}\n")  # relative to the recipe
    (tmp_path / "top.yaml").write_text("base: mid.yaml\nrun: {name: top}\nsft: {lr: 0.25}\n")
    cfg = load_config(tmp_path / "top.yaml")
    assert (cfg.sft.epochs, cfg.sft.lr, cfg.rollout.num_workers, cfg.run.name) == (4, 0.25, 2, "top")
    assert load_config(tmp_path / "top.yaml", ["sft.epochs=5"]).sft.epochs == 5  # overrides come last
    assert load_config(tmp_path / "mid.yaml").sft.lr == 0.5


@pytest.mark.parametrize(
    "files, message",
    [
        ({"r.yaml": "base: nope.yaml\n"}, "r.yaml: its base nope.yaml is not a file"),
        (
            {"r.yaml": "base: b.yaml\n", "b.yaml": "sft: {ttt_dept: 3}\n"},
            "b.yaml: unknown config key 'sft.ttt_dept'; did you mean 'sft.ttt_depth'?",
        ),
        ({"r.yaml": "base: b.yaml\n", "b.yaml": "base: r.yaml\n"}, "b.yaml: its base r.yaml is the recipe itself"),
        ({"r.yaml": "base: r.yaml\n"}, "r.yaml: its base r.yaml is the recipe itself"),
    ],
)
def test_a_bad_base_is_a_one_line_error(files, message, tmp_path):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "r.yaml")
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key", ["sync.backend", "learner.accepted_divergence", "learner.accepted_rows"])
def test_closed_choices_are_checked(key):
    with pytest.raises(ConfigError, match=f"{key}='bogus' is not one of"):
        load_config(None, [f"{key}=bogus"])


def test_a_learner_rank_takes_no_gpu_or_one_whole_gpu():
    assert load_config(None, ["learner.num_gpus_per_learner=1"]).learner.num_gpus_per_learner == 1
    with pytest.raises(ConfigError, match=r"must be 0 .* or 1"):
        load_config(None, ["learner.num_gpus_per_learner=0.5"])


def test_a_block_too_small_for_the_asked_drafts_is_refused_before_any_work():
    """A smaller DFlash block by override, with the recipe's K left as it was: refused at load, not after SFT."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "toy-dflash-sft.yaml"
    with pytest.raises(ConfigError, match=r"eval.num_draft_tokens asks for 15 .* drafter.block_size=8 holds at most 7"):
        load_config(recipe, ["drafter.block_size=8"])
    assert load_config(recipe, ["drafter.block_size=8", "eval.num_draft_tokens=[7]"]).drafter.block_size == 8
    opd = Path(__file__).resolve().parents[1] / "recipes" / "toy-dflash-opd.yaml"
    with pytest.raises(ConfigError, match=r"rollout.num_draft_tokens asks for 9 .* drafter.block_size=8"):
        load_config(
            opd, ["drafter.init=''", "drafter.block_size=8", "eval.num_draft_tokens=[7]", "rollout.num_draft_tokens=9"]
        )
    # From a checkpoint (the recipe's drafter.init), the block is the checkpoint's, read when it loads.
    assert load_config(opd, ["drafter.block_size=8"]).drafter.init


def test_sync_timeout_is_a_setting_that_reaches_the_collective_sync():
    from draftopd.opd.runtime import InProcessRuntime
    from draftopd.opd.weight_sync import make_weight_sync

    with pytest.raises(ConfigError, match=r"sync\.timeout_s=0\.0 must be positive"):
        load_config(None, ["sync.timeout_s=0"])
    cfg = load_config(None, ["sync.backend=gloo", "sync.timeout_s=12.5"])
    sync = make_weight_sync(cfg.sync.backend, InProcessRuntime(), cfg.rollout.backend, cfg.sync.timeout_s)
    assert sync.timeout_s == 12.5 and sync.transport == "gloo"
