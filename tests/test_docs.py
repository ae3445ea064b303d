"""The front door and the site hold together: the README stays short and links every page, every
page is in the site's navigation, and the `[all]` extra installs what the examples import."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the test command's .venv has it

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()


def test_the_readme_is_a_front_door_of_at_most_300_lines():
    assert len(README.splitlines()) <= 300


def test_every_page_is_reachable_from_the_readme_and_in_the_site_navigation():
    pages = {p.name for p in DOCS.glob("*.md")}
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)[#)]", README))
    # The changelog page shows CHANGELOG.md, which the README links directly.
    assert pages - linked <= {"changelog.md"}, sorted(pages - linked)
    assert "](CHANGELOG.md)" in README
    nav = set(re.findall(r":\s+([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == pages


def _extra(pyproject: dict, name: str) -> list[Requirement]:
    return [Requirement(r) for r in pyproject["project"]["optional-dependencies"][name]]


def _installed_closure(requirements: list[Requirement]) -> set[str]:
    """Names of the distributions `requirements` install, following their own requirements
    (with the extras asked for) through the installed metadata."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, frozenset(r.extras)) for r in requirements]
    while todo:
        requirement, extras = todo.pop()
        name = canonicalize_name(requirement.name)
        if name == "admitgate":  # the self-reference of [all]
            for extra in extras:
                todo += [(r, frozenset(r.extras)) for r in _extra(PYPROJECT, extra)]
            continue
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for line in importlib.metadata.requires(requirement.name) or []:
            sub = Requirement(line)
            wanted = [{"extra": e} for e in extras] or [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in wanted):
                todo.append((sub, frozenset(sub.extras)))
    return {name for name, _ in seen}


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_all_brings_every_other_extra():
    extras = set(PYPROJECT["project"]["optional-dependencies"]) - {"all"}
    (everything,) = _extra(PYPROJECT, "all")
    assert everything.name == "admitgate" and set(everything.extras) == extras


def test_the_all_extra_installs_every_module_the_examples_import():
    installed = _installed_closure(_extra(PYPROJECT, "all"))
    providers = importlib.metadata.packages_distributions()
    examples = {p.stem for p in (ROOT / "examples").glob("*.py")}
    missing = {}
    for example in (ROOT / "examples").glob("*.py"):
        for node in ast.walk(ast.parse(example.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for module in {n.split(".")[0] for n in names}:
                if module in sys.stdlib_module_names or module in examples | {"admitgate"}:
                    continue
                dists = {canonicalize_name(d) for d in providers.get(module, [])}
                if not dists & installed:
                    missing[f"{example.name}: {module}"] = sorted(dists)
    assert not missing, f"imported by examples, not brought by [all]: {missing}"
