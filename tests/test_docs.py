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


# -- every python block runs, or is a fragment that compiles (issue 22 item 21) ---------------

FRAGMENT_TITLE = "fragment"
"""A ```python block titled ``fragment...`` (``title="fragment: what it shows"``) is a part of a
program, not one: it must compile (top-level ``await``/``async with`` allowed), nothing more."""


def python_blocks() -> list[tuple[str, str, str]]:
    """(page, title, code) for each ```python block of the docs."""
    pattern = re.compile(r'^```python(?:[ \t]+title="([^"]*)")?[^\n]*\n(.*?)^```$', re.M | re.S)
    return [
        (page.name, title, code)
        for page in sorted(DOCS.glob("*.md"))
        for title, code in pattern.findall(page.read_text())
    ]


def test_there_are_python_blocks_to_check():
    assert len(python_blocks()) >= 15


@pytest.mark.parametrize(
    "page, title, code",
    [pytest.param(*b, id=f"{b[0]}: {b[1] or b[2][:30]}") for b in python_blocks()],
)
def test_every_python_block_is_a_whole_example_or_a_fragment_that_compiles(page, title, code):
    """A block is either the include of an example (``--8<-- "examples/NAME.py"`` alone, a
    complete program that tests/test_examples.py runs) or marked ``title="fragment..."`` and
    compiles. Output shown as code (``gate.stats()`` followed by its dict) is neither: show it
    as ``pycon`` or ``text``."""
    include = re.fullmatch(r'--8<-- "examples/([\w.]+\.py)"\n', code)
    if include:
        assert (ROOT / "examples" / include.group(1)).is_file(), (page, include.group(1))
        assert title == f"examples/{include.group(1)}", (page, title)
        return
    assert title.startswith(FRAGMENT_TITLE), (
        f"{page}: a python block that is neither an example's include nor titled "
        f'"{FRAGMENT_TITLE}: ...":\n{code}'
    )
    compile(code, f"{page} ({title})", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
