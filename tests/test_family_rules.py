"""A family's rules live in its class: the config loader, the proposers and the benches ask the family
(`max_drafts`, `config_refusal`) instead of testing its name, so a new family touches its module, its FAMILIES
line, its tests and its recipes, not a tuple of names elsewhere."""

import ast
from pathlib import Path

import pytest

from draftopd.bench.families import num_drafts
from draftopd.config import ConfigError, load_config
from draftopd.drafters import FAMILIES
from draftopd.schema import Config
from draftopd.testing import tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[1] / "draftopd"

# Family names still compared outside drafters/, each for a reason of its own (file -> why).
ALLOWED = {
    "plan.py": "the planner's scope: it models EAGLE-3 drafters' memory and step times only",
    "eval/diagnose.py": "diagnose's scope: attention drift is read along EAGLE-3 chains only",
}


def family_name_comparisons(source: str, names) -> list[int]:
    """Lines that compare with a family name: `x == "dflash"`, `x != "eagle3"`, `x in ("dflash", "d2sd")`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        consts = [
            c
            for o in operands
            for c in (
                [o]
                if isinstance(o, ast.Constant)
                else getattr(o, "elts", [])
                if isinstance(o, ast.Tuple | ast.List | ast.Set)
                else []
            )
        ]
        if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
            lines.append(node.lineno)
    return lines


def test_no_family_name_is_compared_outside_drafters():
    offenders = {}
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith("drafters/") or rel in ALLOWED:
            continue
        found = family_name_comparisons(f.read_text(), set(FAMILIES))
        if found:
            offenders[rel] = found
    assert offenders == {}, f"family names compared outside drafters/ (ask the family class): {offenders}"
    for rel in ALLOWED:  # an allowance whose reason went away is dropped
        assert family_name_comparisons((ROOT / rel).read_text(), set(FAMILIES)), f"{rel} no longer needs ALLOWED"


def test_the_check_sees_tuples_and_comparisons():
    names = set(FAMILIES)
    assert family_name_comparisons('if d.kind in ("dflash", "d2sd") and not d.init:\n    pass\n', names) == [1]
    assert family_name_comparisons('x = kind != "eagle3"\n', names) == [1]
    assert family_name_comparisons('x = {"pard": 1}.get(kind)\nok = kind == "vllm"\n', names) == []


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_max_drafts_is_one_rule_for_the_loader_the_proposer_and_the_bench(kind):
    target = tiny_target()
    drafter = tiny_drafter(target, kind=kind)
    limit = FAMILIES[kind].max_drafts(drafter)
    if limit is None:  # any K: the loader takes it, the bench drafts the K asked
        load_config(overrides=[f"drafter.kind={kind}", "eval.num_draft_tokens=[40]"])
        assert num_drafts(drafter, 5) == 5
        return
    assert limit == drafter.block_size - 1 == 7  # the tiny block families hold blocks of 8
    assert num_drafts(drafter, 3) == limit  # the bench drafts the whole block
    with pytest.raises(ValueError, match=f"{limit + 1} drafts per step"):
        drafter.proposer().propose(limit + 1, None)  # refused before any state is read
    over = [f"drafter.kind={kind}", f"drafter.block_size={limit + 1}", f"eval.num_draft_tokens=[{limit + 1}]"]
    with pytest.raises(ConfigError, match=f"holds at most {limit}"):
        load_config(overrides=over)
    load_config(overrides=[*over[:2], f"eval.num_draft_tokens=[{limit}]"])


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_config_refusals_are_the_familys_own(kind):
    """Draft-OPD with vLLM rollouts: the family's own refusal, else its `live_push` rule (the one rule for which
    families take pushes), each in one line."""
    opd = ["opd.enabled=true", "rollout.backend=vllm", f"drafter.kind={kind}", "eval.num_draft_tokens=[3]"]
    opd.append("learner.rej_coef=0")
    reason = FAMILIES[kind].config_refusal(load_config(overrides=["eval.num_draft_tokens=[3]"]))
    assert reason == ""  # SFT with the default backend runs with every family
    cfg = Config()
    cfg.opd.enabled, cfg.rollout.backend, cfg.drafter.kind = True, "vllm", kind
    reason = FAMILIES[kind].config_refusal(cfg)
    if not reason and FAMILIES[kind].live_push:
        load_config(overrides=opd)
        return
    with pytest.raises(ConfigError) as err:
        load_config(overrides=opd)
    assert "\n" not in str(err.value)
    assert str(err.value) == reason or "takes no live weight pushes" in str(err.value)
