"""The binding's modules form no cycle: ``src/python/a.rs`` uses ``b`` when it names
``super::b`` or ``crate::python::b`` (code or doc link), and a parent module (``fleet.rs``) uses
its children (``fleet/*.rs``). ``python tests/test_module_graph.py`` prints the graph."""

from __future__ import annotations

import re
import sys
from pathlib import Path

BINDING = Path(__file__).resolve().parent.parent / "src" / "python"
USE = re.compile(r"\b((?:super::)+|crate::python::)([a-z_]+(?:::[a-z_]+)?)")
CHILD = re.compile(r"^\s*(?:pub )?mod ([a-z_]+);", re.M)


def module_graph(root: Path = BINDING) -> dict[str, set[str]]:
    """``{module: modules it uses}``, modules named by path (``fleet/turn``)."""
    sources = {
        "/".join(f.relative_to(root).with_suffix("").parts): f.read_text()
        for f in sorted(root.rglob("*.rs"))
    }
    sources.pop("mod", None)
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, text in sources.items():
        parent = name.split("/")[:-1]
        for match in USE.finditer(text):
            prefix, path = match.groups()
            ups = prefix.count("super::")
            base = [] if prefix == "crate::python::" else parent[: len(parent) - (ups - 1)]
            segments = path.split("::")
            for depth in (2, 1):
                target = "/".join(base + segments[:depth])
                if target in sources and target != name:
                    graph[name].add(target)
                    break
        for child in CHILD.findall(text):
            if f"{name}/{child}" in sources:
                graph[name].add(f"{name}/{child}")
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for used in sorted(graph[node]):
            if used not in index:
                visit(used)
                low[node] = min(low[node], low[used])
            elif used in stack:
                low[node] = min(low[node], index[used])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_bindings_modules_form_no_cycle() -> None:
    graph = module_graph()
    assert len(graph) > 20, "the binding's sources were not found"
    assert cycles(graph) == []


if __name__ == "__main__":
    edges = module_graph()
    for module in sorted(edges):
        print(f"{module} -> {', '.join(sorted(edges[module])) or '-'}")
    print("cycles:", cycles(edges) or "none")
    sys.exit(1 if cycles(edges) else 0)
