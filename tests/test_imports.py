"""Imports point down: no module of draftopd reaches itself through its imports, and the config schema
(`schema.py`) sits at the bottom (it imports only the leaf modules named here, none today), so a family, the
data layer or a loader can read config types without the schema reading them back. The recipe loader
(`config.py`), which checks a recipe against its family's rules, sits above the drafters and the data layer.

Every import of a draftopd module counts as an arrow, at module level or inside a function: a deferred
import hides a circle from Python, not from a reader. The graph is built with `ast` from the source alone,
so a circle is found even where the import order happens to work today. DRAFTOPD_IMPORTS_ROOT points the
check at another copy of the package (an older commit's tree, to see what it finds there)."""

import ast
import os
from pathlib import Path

ROOT = Path(os.environ.get("DRAFTOPD_IMPORTS_ROOT", Path(__file__).resolve().parents[1]))

# What the schema may import: leaves that import no draftopd module themselves (none is needed today).
SCHEMA_MAY_IMPORT: set[str] = set()


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against the importing module)."""
    if node.level == 0:
        return node.module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The draftopd modules one file imports: `from pkg import sub` is an arrow to pkg.sub when sub is a module
    and to pkg when it is a name defined there."""
    here = module_name(path, root)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, here, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif base in modules:
                    found.add(base)
    found.discard(here)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the draftopd modules it imports, over root/draftopd/**/*.py."""
    files = sorted((root / "draftopd").rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    return {module_name(f, root): imports_of(f, root, modules) for f in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path that closes."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, c) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest closed path through the component's first module (breadth-first inside the component)."""
    start = min(component)
    parents, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in a strongly connected component")


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph(ROOT))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_config_schema_imports_only_leaves_below_it():
    graph = import_graph(ROOT)
    assert "draftopd.schema" in graph, "the config schema is a module of its own"
    above = graph["draftopd.schema"] - SCHEMA_MAY_IMPORT
    assert not above, f"draftopd.schema imports modules above it: {sorted(above)}"
    for leaf in SCHEMA_MAY_IMPORT:
        assert not graph[leaf], f"{leaf} is meant to be a leaf but imports {sorted(graph[leaf])}"


def test_only_loaders_of_recipes_import_the_loader():
    """Below the recipe loader, modules read config types from the schema: a module the loader reaches
    (a family, the data layer, loading) importing `config` would close a circle through it."""
    graph = import_graph(ROOT)
    reached, todo = set(), [*graph["draftopd.config"]]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += graph[m]
    assert "draftopd.drafters" in reached and "draftopd.data.prompts" in reached  # the loader asks both
    assert not [m for m in reached if "draftopd.config" in graph[m]]


def test_the_graph_sees_circles_and_deferred_imports(tmp_path):
    """The check can fail: a two-module circle closed by an import inside a function is found, relative
    imports resolve, and `from pkg import name` points at the package."""
    pkg = tmp_path / "draftopd"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from draftopd.sub.b import g\n    return g\n")
    (pkg / "sub" / "b.py").write_text("from . import a\ng = 1\n")
    (pkg / "c.py").write_text("from draftopd.sub import f\n")
    graph = import_graph(tmp_path)
    assert graph["draftopd.c"] == {"draftopd.sub"}
    assert graph["draftopd.sub"] == {"draftopd.sub.a"}
    assert cycles(graph) == [["draftopd.sub.a", "draftopd.sub.b", "draftopd.sub.a"]]
