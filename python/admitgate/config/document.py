"""A gateway YAML file as written: its values, the line and text of each key, duplicate keys.

:func:`read_document` parses the file with PyYAML (imported here, on first use, so that
importing :mod:`admitgate.config` needs only the standard library) and refuses what
``BotOS.from_config`` refuses: a file that is not YAML, empty, not a mapping, or whose
``gateway:`` is not a mapping. :meth:`Document.find` applies BotOS's rule for where a
setting is read from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .settings import ConfigError, ConfigProblem, Source, location

Block = Literal["top", "gateway"]
"""Where a key is written: the file's top level or its ``gateway:`` block."""

_YAML_STR_TAG = "tag:yaml.org,2002:str"


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


def _kind(value: Any) -> str:
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
        content = fh.read()
    loader = yaml.SafeLoader(content)
    duplicates: list[tuple[Block, str, int, int]] = []
    try:
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
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = location(path, mark.line + 1 if mark is not None else None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(path, f"{where}: not valid YAML: {problem}") from exc
    finally:
        loader.dispose()
    # BotOS.from_config refuses the same files: ``if not raw or not isinstance(raw, dict)``.
    if not isinstance(data, dict):
        if data is None:
            raise ConfigError(path, f"{path}: the file is empty; praisonai-bot refuses it")
        raise ConfigError(path, f"{path}: must be a YAML mapping of settings, not a {_kind(data)}")
    if not data:
        raise ConfigError(path, f"{path}: the mapping is empty; praisonai-bot refuses it")
    gateway = data.get("gateway") or {}  # praisonai-bot reads a falsy gateway: as empty
    if not isinstance(gateway, dict):
        line = top_lines.get("gateway", (None, None))[0]
        raise ConfigError(
            path,
            f"{location(path, line)}: gateway: must be a mapping of settings, "
            f"not a {_kind(gateway)}",
            [ConfigProblem("gateway", gateway, "top-level", line, "must be a mapping")],
        )
    return Document(data, gateway, top_lines, gateway_lines, duplicates)
