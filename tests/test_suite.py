"""The suite runs as a user may run it: with pytest's cache provider off (`-p no:cacheprovider`, a read-only
checkout), no fixture or test may lean on `config.cache` or the `cache` fixture. A fixture that needs a place of
its own (a package installed for one peer) takes a temporary directory (`tmp_path_factory`). Read with `ast`,
so that a use inside any function is found."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def cache_uses(source: str, name: str = "<test>") -> list[str]:
    """`file:line` of every `X.config.cache`, `pytestconfig.cache` and function taking the `cache` fixture."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Attribute) and node.attr == "cache":
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "config") or (
                isinstance(owner, ast.Name) and owner.id == "pytestconfig"
            ):
                found.append(f"{name}:{node.lineno}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(a.arg == "cache" for a in node.args.args):
                found.append(f"{name}:{node.lineno}")
    return sorted(found, key=lambda u: int(u.rsplit(":", 1)[1]))


def test_no_test_or_fixture_needs_pytests_cache():
    uses = [u for f in sorted(TESTS.rglob("*.py")) for u in cache_uses(f.read_text(), str(f.relative_to(TESTS)))]
    assert not uses, f"these need pytest's cache provider (use tmp_path_factory): {uses}"


def test_the_check_finds_each_way_to_reach_the_cache():
    source = (
        "def a(request):\n    return request.config.cache.mkdir('x')\n"
        "def b(pytestconfig):\n    return pytestconfig.cache.get('k', None)\n"
        "def test_c(cache):\n    pass\n"
        "def d(tmp_path_factory):\n    return tmp_path_factory.mktemp('x')\n"
    )
    assert cache_uses(source) == ["<test>:2", "<test>:4", "<test>:5"]
