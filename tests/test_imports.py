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


def room(module: str) -> str:
    """The room a module stands in: its folder under draftopd (`draftopd.serve.server` -> `serve`), or the
    module itself for a top-level file (`draftopd.reports` -> `reports`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Room -> the rooms it imports, each with the module imports behind the arrow (`importer -> imported`)."""
    rooms: dict[str, dict[str, list[str]]] = {room(m): {} for m in graph}
    for here, imported in graph.items():
        for there in imported:
            if room(here) != room(there):
                rooms[room(here)].setdefault(room(there), []).append(f"{here} -> {there}")
    return rooms


# The arrows between rooms that still run back up, each with its reason (written where the import stands as
# well): without them the rooms stand in floors, every import pointing down. A new circle of rooms fails the
# test until an arrow of it is removed or written here with its reason; a listed arrow that is gone fails it
# until its line goes.
BACK_UP = {
    ("sft", "eval"): "the SFT phase ends on held-out tau measured as every command measures it "
    "(sft/pipeline.py -> eval/acceptance.py), while eval/diagnose.py reads SFT's batches for the TTT pass",
    ("eval", "serve"): "the rejection explorer reads a serving run's saved traffic with the buffer's own loader "
    "(eval/rejections.py -> serve/traffic.py), so that file has one reader",
}


def test_only_the_command_line_imports_the_command_line():
    """cli/ is the top floor: a room below it that needs one of its helpers needs that helper moved below both."""
    up = [
        arrow
        for here, there in room_graph(import_graph(ROOT)).items()
        if here != "cli"
        for arrow in there.get("cli", [])
    ]
    assert not up, "modules outside draftopd.cli import it:\n" + "\n".join(sorted(up))


def test_the_arrows_that_run_back_up_are_the_known_ones():
    rooms = room_graph(import_graph(ROOT))
    gone = [arrow for arrow in BACK_UP if arrow[1] not in rooms.get(arrow[0], {})]
    assert not gone, f"these arrows are gone; drop their lines from BACK_UP: {gone}"
    floors = {here: {t for t in there if (here, t) not in BACK_UP} for here, there in rooms.items()}
    found = cycles(floors)
    why = [" -> ".join(c) + ": " + "; ".join(a for x, y in zip(c, c[1:]) for a in rooms[x][y]) for c in found]
    assert not found, "rooms that import each other in a circle (move an import, or give it a reason here):\n" + (
        "\n".join(why)
    )


def test_the_room_check_sees_circles_of_rooms(tmp_path):
    """It can fail: a lower room importing a higher one that imports it is a circle, a one-way arrow is not."""
    pkg = tmp_path / "draftopd"
    for folder in ("low", "high", "side"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "a.py").write_text("from draftopd.low.b import g\n")
    (pkg / "low" / "b.py").write_text("g = 1\ndef f():\n    from draftopd.high.c import h\n")
    (pkg / "high" / "c.py").write_text("h = 2\n")
    (pkg / "side" / "d.py").write_text("from draftopd.low import b\n")
    rooms = room_graph(import_graph(tmp_path))
    assert rooms["low"] == {"high": ["draftopd.low.b -> draftopd.high.c"]}
    floors = {here: set(there) for here, there in rooms.items()}
    assert cycles(floors) == [["high", "low", "high"]]
    floors["low"].discard("high")
    assert cycles(floors) == []
