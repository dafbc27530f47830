"""The README is the front page: its map of the package, its links and its commands point at things that exist."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _map_entries() -> list[str]:
    block = README.split("## Map of the package", 1)[1].split("```", 2)[1]
    entries, parent = [], ""
    for line in block.splitlines():
        if not line.strip():
            continue
        name = line.split()[0]
        if not line.startswith(" "):
            parent = name if name.endswith("/") else ""
            entries.append(name)
        else:
            entries.append(parent + name)
    return entries


def test_every_module_and_folder_the_package_map_names_exists():
    entries = _map_entries()
    assert len(entries) > 30  # the map was parsed, not skipped
    missing = [e for e in entries if not (REPO / e).exists()]
    assert not missing, f"README's map names what does not exist: {missing}"


def test_every_module_of_the_package_is_on_the_map():
    named = set(_map_entries())
    folders = {e for e in named if e.endswith("/")}
    modules = [
        p.relative_to(REPO).as_posix()
        for p in (REPO / "draftopd").rglob("*.py")
        if p.name != "__init__.py" and "assets" not in p.parts
    ]
    unlisted = [m for m in modules if m not in named and not any(m.startswith(f) for f in folders)]
    assert not unlisted, f"modules missing from README's map: {unlisted}"


def test_links_from_the_readme_and_docs_resolve():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) > 5
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_the_readme_stays_a_front_page():
    assert len(README.splitlines()) <= 300, "experiment reports and references belong in docs/"
