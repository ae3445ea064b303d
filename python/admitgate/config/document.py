"""A gateway YAML file as written: its values, the line and text of each key, duplicate keys.

:func:`read_document` parses the file with PyYAML (imported here, on first use, so that
importing :mod:`admitgate.config` needs only the standard library) and refuses what
``BotOS.from_config`` refuses: a file that is not YAML, empty, not a mapping, or whose
``gateway:`` is not a mapping. :meth:`Document.find` applies BotOS's rule for where a
setting is read from.

The file may come from anyone, so reading it is bounded: at most :data:`MAX_FILE_BYTES`,
:data:`MAX_DEPTH` levels of nesting, :data:`MAX_NODES` values with aliases expanded, and
numbers of at most :data:`MAX_NUMBER_CHARS` characters; a file past one is refused with a
:class:`ConfigError` that names the bound (and the line), in well under a second.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from .settings import ConfigError, ConfigProblem, Source, clip, location

Block = Literal["top", "gateway"]
"""Where a key is written: the file's top level or its ``gateway:`` block."""

_YAML_STR_TAG = "tag:yaml.org,2002:str"

# Bounds on a file check-config reads (it may come from anyone): each keeps the pure-Python
# YAML reader well under a second and its memory small, and the error says which was hit.
# A gateway config is a few KiB; praisonai-bot's own yaml.safe_load would hang or crash on
# the files past the last three.
MAX_FILE_BYTES = 256 * 1024
"""Largest file read (bytes)."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings (PyYAML composes recursively, and its scanner is
quadratic in the flow nesting)."""
MAX_NODES = 5_000
"""Most values (scalars, lists, mappings) in the document, with every alias counted as the
whole value it names: an alias bomb ("billion laughs") is refused before it is expanded."""
MAX_NUMBER_CHARS = 100
"""Longest integer or float, written (int() refuses 4300 digits and a YAML 1.1 base-60
integer ``1:0:0:...`` grows without limit)."""


class _Refused(Exception):
    """The file is past one of the bounds above, at ``line`` (1-based; None: unknown)."""

    def __init__(self, problem: str, line: int | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.line = line


@dataclass(frozen=True)
class Found:
    """A setting's value as written (or overridden), before validation."""

    value: Any
    source: Source
    line: int | None = None
    text: str | None = None  # the YAML scalar as written (``off`` for ``False``)


@dataclass
class Document:
    """The file's top-level mapping and its ``gateway:`` block, with where each key is."""

    data: dict[str, Any]
    gateway: dict[str, Any]
    # key -> (line, scalar text) for the top level and for the gateway: block
    top_lines: dict[str, tuple[int, str | None]]
    gateway_lines: dict[str, tuple[int, str | None]]
    duplicates: list[tuple[Block, str, int, int]]  # (block, key, first line, last line)

    def line(self, block: Block, key: str) -> int | None:
        """The line ``key`` is written on in ``block``, or ``None`` when unknown."""
        lines = self.top_lines if block == "top" else self.gateway_lines
        return lines.get(key, (None, None))[0]

    def find(self, name: str) -> Found | None:
        """The value BotOS reads for ``name``: top level if present (even null), else gateway:."""
        if name in self.data:
            line, text = self.top_lines.get(name, (None, None))
            return Found(self.data[name], "top-level", line, text)
        if name in self.gateway:
            line, text = self.gateway_lines.get(name, (None, None))
            return Found(self.gateway[name], "gateway", line, text)
        return None


def _import_yaml() -> Any:
    try:
        import yaml  # type: ignore[import-untyped]  # no stubs needed: used as Any
    except ImportError as exc:
        raise ImportError(
            "admitgate.config needs PyYAML to read a gateway config: "
            "pip install 'admitgate[config]' (or pip install pyyaml)",
            name="yaml",
        ) from exc
    return yaml


def _line(mark: Any) -> int | None:
    return None if mark is None else int(mark.line) + 1


@functools.cache
def _bounded_loader(yaml: Any) -> Any:
    """``yaml.SafeLoader`` that counts what it composes and refuses the bounds above."""

    class BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]  # yaml is untyped
        def __init__(self, stream: bytes) -> None:
            super().__init__(stream)
            self._depth = 0
            self._composed = 0
            # id(node) -> values in it, aliases expanded; nodes stay alive in the tree.
            self._sizes: dict[int, int] = {}

        def fetch_flow_collection_start(self, token_class: Any) -> None:
            # Checked as the scanner reads a `[` or `{`: it looks ahead up to 1024 characters
            # for a key, at a cost that grows with the flow nesting, before anything composes.
            if self.flow_level >= MAX_DEPTH:
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels", int(self.line) + 1)
            super().fetch_flow_collection_start(token_class)

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self._depth >= MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels", _line(mark))
            self._depth += 1
            try:
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
            if id(node) in self._sizes:
                return node  # an alias: its size is counted again by the parent
            self._composed += 1
            size = 1
            if isinstance(node, yaml.SequenceNode):
                size += sum(self._sizes.get(id(child), 1) for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                size += sum(
                    self._sizes.get(id(key), 1) + self._sizes.get(id(value), 1)
                    for key, value in node.value
                )
            self._sizes[id(node)] = size
            if size > MAX_NODES or self._composed > MAX_NODES:
                raise _Refused(
                    f"more than {MAX_NODES} values (with each alias counted as the whole "
                    "value it names)",
                    _line(node.start_mark),
                )
            return node

        def construct_bounded_number(self, node: Any) -> Any:
            if len(node.value) > MAX_NUMBER_CHARS:
                raise _Refused(
                    f"a number written with {len(node.value)} characters (at most "
                    f"{MAX_NUMBER_CHARS})",
                    _line(node.start_mark),
                )
            if node.tag.endswith(":int"):
                return super().construct_yaml_int(node)
            return super().construct_yaml_float(node)

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_bounded_number)
    BoundedLoader.add_constructor("tag:yaml.org,2002:float", BoundedLoader.construct_bounded_number)
    return BoundedLoader


def _key_lines(
    yaml: Any, node: Any, block: Block, duplicates: list[tuple[Block, str, int, int]]
) -> dict[str, tuple[int, str | None]]:
    """Line and scalar text of each string key of a mapping node, noting duplicates."""
    lines: dict[str, tuple[int, str | None]] = {}
    if not isinstance(node, yaml.MappingNode):
        return lines
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _YAML_STR_TAG:
            continue  # merge keys (<<) and non-string keys
        line = key_node.start_mark.line + 1
        if key_node.value in lines:
            duplicates.append((block, key_node.value, lines[key_node.value][0], line))
        text = value_node.value if isinstance(value_node, yaml.ScalarNode) else None
        lines[key_node.value] = (line, text)
    return lines


def kind_of(value: Any) -> str:
    """What a YAML value is, for messages: ``boolean``, ``number``, ``string``, ``list``..."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, list) else type(value).__name__


def read_document(path: str) -> Document:
    """Parse the gateway YAML file at ``path``, refusing what ``BotOS.from_config`` refuses.

    Raises ``OSError`` when the file cannot be read, :class:`ConfigError` when it is not a
    YAML mapping (or its ``gateway:`` is not one), ``ImportError`` when PyYAML is missing.
    """
    yaml = _import_yaml()
    with open(path, "rb") as fh:
        content = fh.read(MAX_FILE_BYTES + 1)
    if len(content) > MAX_FILE_BYTES:
        raise ConfigError(
            path, f"{path}: larger than {MAX_FILE_BYTES // 1024} KiB; a gateway config is smaller"
        )
    loader = None
    duplicates: list[tuple[Block, str, int, int]] = []
    try:
        # The reader checks the encoding and every character as it is made: inside the try.
        loader = _bounded_loader(yaml)(content)
        node = loader.get_single_node()
        top_lines = _key_lines(yaml, node, "top", duplicates)
        gateway_node = None
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.value == "gateway":
                    gateway_node = value_node
        gateway_lines = _key_lines(yaml, gateway_node, "gateway", duplicates)
        # Constructing resolves merge keys into the nodes, so it comes after the walk.
        data = loader.construct_document(node) if node is not None else None
    except _Refused as exc:
        raise ConfigError(path, f"{location(path, exc.line)}: refused: {exc.problem}") from None
    except yaml.YAMLError as exc:
        where = location(path, _line(getattr(exc, "problem_mark", None)))
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(path, f"{where}: not valid YAML: {clip(problem)}") from exc
    except RecursionError:
        # A backstop: MAX_DEPTH keeps PyYAML's recursion well inside the interpreter's.
        raise ConfigError(path, f"{path}: refused: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
    # BotOS.from_config refuses the same files: ``if not raw or not isinstance(raw, dict)``.
    if not isinstance(data, dict):
        if data is None:
            raise ConfigError(path, f"{path}: the file is empty; praisonai-bot refuses it")
        raise ConfigError(
            path, f"{path}: must be a YAML mapping of settings, not a {kind_of(data)}"
        )
    if not data:
        raise ConfigError(path, f"{path}: the mapping is empty; praisonai-bot refuses it")
    gateway = data.get("gateway") or {}  # praisonai-bot reads a falsy gateway: as empty
    if not isinstance(gateway, dict):
        line = top_lines.get("gateway", (None, None))[0]
        raise ConfigError(
            path,
            f"{location(path, line)}: gateway: must be a mapping of settings, "
            f"not a {kind_of(gateway)}",
            [ConfigProblem("gateway", gateway, "top-level", line, "must be a mapping")],
        )
    return Document(data, gateway, top_lines, gateway_lines, duplicates)
