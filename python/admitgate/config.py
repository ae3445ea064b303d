"""Check a gateway config: the admission settings praisonai-bot would apply, and what is risky.

    import admitgate.config

    settings = admitgate.config.load("gateway.yaml", max_concurrent_runs=16)
    for warning in settings.warnings:
        print(warning.code, warning.message)
    gate = settings.build_gate()   # admitgate.build_admission_gate(**settings.gate_kwargs())

The command line is ``python -m admitgate check-config gateway.yaml`` (see :func:`main`).

How praisonai-bot 0.1.16 reads the file
---------------------------------------
``BotOS.from_config(path)`` (``bots/botos.py``) reads seven admission settings. For each,
a key at the top level of the file wins over the same key under ``gateway:`` whenever it is
present, even with a ``null`` value. Counts go through ``int(value or 0)``, ``max_rss_mb``
through ``float(value or 0)`` and ``overflow_policy`` through ``value or "reject"``;
unset, they are 0, 0.0 and ``"reject"`` (not the 128 that the documentation gives as
``GatewayConfig``'s default ``queue_depth``). ``BotOS.__init__`` then applies the
``reliability`` preset (``bots/_reliability.py``), which only fills what is unset: unless the
preset is ``"off"`` or ``"default"``, a ceiling of 0 becomes ``4 × os.cpu_count()`` clamped to
4..32, a ``queue_depth`` of 0 becomes 32 and an ``overflow_policy`` of exactly ``"reject"``
becomes ``"queue"``. ``drain_timeout`` left unset becomes 15 s (``production``), 5 s (unset
preset or ``default``; BotOS does not know its bind address, so it takes the loopback
branch) or 0 (``off``). The per-scope limit and ``max_rss_mb`` bypass the preset.

``praisonai gateway start --config`` (``WebSocketGateway.start_with_config``) differs: it
reads these settings only under ``gateway:``, never reads ``max_rss_mb``, and its schema
refuses ``gateway.max_concurrent_runs_per_scope`` and ``gateway.max_rss_mb``. Its flags
replace the file's values before the preset is applied; overrides passed to :func:`load`
do the same.

Values are validated as admitgate's gate validates them (``ValueError`` naming the
argument), which is stricter than praisonai-bot: booleans, fractional counts, blank counts,
negative values, NaN and an unknown ``overflow_policy`` raise :class:`ConfigError` naming
the file, the line, the key and the value (and, where praisonai-bot would silently coerce
the value, what it would use).

Importing this module imports only the standard library and admitgate; PyYAML (the
``admitgate[config]`` extra) is imported by the first :func:`load`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ._admitgate import AdmissionGate, ConcurrencyLimitPolicy, RssSampler
from ._builders import build_admission_gate, build_memory_pressure_policy

__all__ = [
    "ConfigError",
    "ConfigProblem",
    "ConfigWarning",
    "GateSettings",
    "MemoryLimits",
    "Setting",
    "load",
    "preset_ceiling",
    "read_memory_limits",
]

Source = Literal["default", "top-level", "gateway", "preset", "override"]
"""Where an effective value came from: praisonai-bot's default, the file's top level, its
``gateway:`` block, the ``reliability`` preset, or an override (a command-line flag)."""

#: The settings, in the order they are reported.
SETTING_NAMES = (
    "max_concurrent_runs",
    "queue_depth",
    "overflow_policy",
    "max_concurrent_runs_per_scope",
    "max_rss_mb",
    "reliability",
    "drain_timeout",
)
_COUNTS = ("max_concurrent_runs", "queue_depth", "max_concurrent_runs_per_scope")
_PROFILES = ("production", "default", "off")
_PRESET_QUEUE_DEPTH = 32
_PRESET_DRAIN_S: dict[str | None, float] = {
    "production": 15.0,
    None: 5.0,
    "default": 5.0,
    "off": 0.0,
}
# Other keys praisonai-bot reads at these levels, never reported as typos of ours.
_KNOWN_KEYS = frozenset(
    {"reload_drain_timeout", "per_turn_timeout", "max_connections", "max_queued_frames"}
)
_YAML_STR_TAG = "tag:yaml.org,2002:str"
# cgroup v1 reports "no limit" as a page-rounded 2**63-1.
_CGROUP_V1_UNLIMITED = 1 << 62


def preset_ceiling(cpu_count: int | None = None) -> int:
    """The ceiling praisonai-bot's ``reliability`` preset fills in: 4 turns per CPU, 4..32.

    ``cpu_count`` defaults to ``os.cpu_count()``, which is what praisonai-bot uses (it counts
    the machine's CPUs, not a container's CPU quota).
    """
    cpus = os.cpu_count() if cpu_count is None else cpu_count
    return max(4, min(32, (cpus or 2) * 4))


# ------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class Setting:
    """One effective setting: its value, where it came from, and the line it is on."""

    name: str
    value: int | float | str | None
    source: Source
    line: int | None = None
    note: str = ""

    def origin(self) -> str:
        """Where the value came from, for people: ``gateway: line 7``, ``preset``..."""
        where = {"top-level": "top level", "gateway": "gateway:"}.get(self.source, self.source)
        if self.line is not None:
            where += f" line {self.line}"
        return f"{where} ({self.note})" if self.note else where


@dataclass(frozen=True)
class ConfigWarning:
    """A risky or surprising combination; ``code`` is stable, ``message`` explains it."""

    code: str
    message: str
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class ConfigProblem:
    """One invalid value: the key, the value, where it was written and why it is refused."""

    key: str
    value: Any
    source: Source
    line: int | None
    reason: str

    def describe(self, path: str) -> str:
        """``gateway.yaml:7: gateway.max_concurrent_runs = 3.5: <reason>``."""
        where = f"{path}:{self.line}" if self.line is not None else path
        name = {"gateway": f"gateway.{self.key}", "override": f"override {self.key}"}.get(
            self.source, self.key
        )
        return f"{where}: {name} = {_show(self.value)}: {self.reason}"


class ConfigError(ValueError):
    """The file is not a valid gateway config; ``problems`` lists every invalid value.

    ``path`` is the file; ``key`` and ``value`` are those of the first problem (``None``
    when the file as a whole is invalid, e.g. not YAML or not a mapping).
    """

    def __init__(self, path: str, message: str, problems: Sequence[ConfigProblem] = ()):
        super().__init__(message)
        self.path = path
        self.problems = tuple(problems)
        self.key = self.problems[0].key if self.problems else None
        self.value = self.problems[0].value if self.problems else None


@dataclass(frozen=True)
class MemoryLimits:
    """The memory this machine offers: total RAM and the tightest cgroup limit (MiB).

    ``None`` means unknown (RAM) or no limit (cgroup). ``cgroup_file`` is the file the
    limit was read from.
    """

    ram_mb: float | None
    cgroup_limit_mb: float | None
    cgroup_file: str | None = None

    @property
    def limit_mb(self) -> float | None:
        """The tighter of RAM and the cgroup limit, or ``None`` when neither is known."""
        known = [v for v in (self.ram_mb, self.cgroup_limit_mb) if v is not None]
        return min(known) if known else None

    def describe(self) -> str:
        """``RAM 24106 MiB, cgroup limit 2048 MiB (/sys/fs/cgroup/memory.max)``."""
        ram = f"RAM {self.ram_mb:.0f} MiB" if self.ram_mb is not None else "RAM unknown"
        if self.cgroup_limit_mb is None:
            return f"{ram}, no cgroup memory limit"
        return f"{ram}, cgroup limit {self.cgroup_limit_mb:.0f} MiB ({self.cgroup_file})"


@dataclass(frozen=True)
class GateSettings:
    """The admission settings a gateway config resolves to, as praisonai-bot 0.1.16 applies
    them, with where each came from, the warnings, and the gate they build.

    Build the gate with :meth:`build_gate` (``None`` when admission is off, as
    ``build_admission_gate`` returns) or ``admitgate.build_admission_gate(**gate_kwargs())``.
    """

    path: str
    settings: Mapping[str, Setting]
    warnings: tuple[ConfigWarning, ...]
    memory: MemoryLimits
    cpu_count: int | None = None

    def _value(self, name: str) -> Any:
        return self.settings[name].value

    @property
    def max_concurrent_runs(self) -> int:
        """Ceiling on concurrent turns; 0: no ceiling."""
        return int(self._value("max_concurrent_runs"))

    @property
    def queue_depth(self) -> int:
        """Turns that may wait for a slot (per tenant lane with a per-scope limit)."""
        return int(self._value("queue_depth"))

    @property
    def overflow_policy(self) -> str:
        """``reject``, ``queue`` or ``shed_oldest``."""
        return str(self._value("overflow_policy"))

    @property
    def max_concurrent_runs_per_scope(self) -> int:
        """Per-tenant (``session_id``) ceiling; 0: off."""
        return int(self._value("max_concurrent_runs_per_scope"))

    @property
    def max_rss_mb(self) -> float:
        """Hard RSS ceiling in MiB (turns are rejected at or above it); 0.0: off."""
        return float(self._value("max_rss_mb"))

    @property
    def soft_rss_mb(self) -> float:
        """Soft RSS threshold, ``0.9 × max_rss_mb``: above it new turns wait; 0.0: off."""
        policy = build_memory_pressure_policy(self.max_rss_mb)  # the gate's own derivation
        return 0.0 if policy is None else float(policy.soft_rss_mb)

    @property
    def reliability(self) -> str | None:
        """The ``reliability`` profile, ``None`` when unset (praisonai-bot's safe default)."""
        value = self._value("reliability")
        return None if value is None else str(value)

    @property
    def drain_timeout(self) -> float:
        """Seconds BotOS waits for running turns on shutdown; 0.0: none. Not a gate setting."""
        return float(self._value("drain_timeout"))

    @property
    def gate_enabled(self) -> bool:
        """Whether a gate is built at all (a ceiling or a memory limit is set)."""
        return self.max_concurrent_runs > 0 or self.max_rss_mb > 0

    def gate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`admitgate.build_admission_gate`.

        Includes ``resource_policy=build_memory_pressure_policy(max_rss_mb)`` when
        ``max_rss_mb`` is set. ``drain_timeout`` is not a gate argument.
        """
        kwargs: dict[str, Any] = {
            "max_concurrent_runs": self.max_concurrent_runs,
            "queue_depth": self.queue_depth,
            "overflow_policy": self.overflow_policy,
            "max_concurrent_runs_per_scope": self.max_concurrent_runs_per_scope,
        }
        if self.max_rss_mb > 0:
            kwargs["resource_policy"] = build_memory_pressure_policy(self.max_rss_mb)
        return kwargs

    def build_gate(self) -> AdmissionGate | None:
        """``build_admission_gate(**self.gate_kwargs())``: the gate, or ``None`` when off."""
        return build_admission_gate(**self.gate_kwargs())

    def meaning(self) -> list[str]:
        """What the settings do, one sentence per line."""
        return _explain(self)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (what ``check-config --json`` prints)."""
        return {
            "path": self.path,
            "valid": True,
            "settings": {
                s.name: {"value": s.value, "source": s.source, "line": s.line, "note": s.note}
                for s in self.settings.values()
            },
            "soft_rss_mb": self.soft_rss_mb,
            "gate_enabled": self.gate_enabled,
            "meaning": self.meaning(),
            "warnings": [
                {"code": w.code, "message": w.message, "keys": list(w.keys)} for w in self.warnings
            ],
            "machine": {
                "cpu_count": self.cpu_count,
                "ram_mb": self.memory.ram_mb,
                "cgroup_limit_mb": self.memory.cgroup_limit_mb,
                "cgroup_file": self.memory.cgroup_file,
            },
        }

    def format_text(self) -> str:
        """The human report ``check-config`` prints: settings, meaning, warnings."""
        width = max(len(n) for n in SETTING_NAMES)
        shown = {name: _show_setting(s) for name, s in self.settings.items()}
        value_width = max(len(v) for v in shown.values())
        lines = [
            f"{self.path}: admission settings as praisonai-bot 0.1.16 applies them "
            "(BotOS.from_config)",
            "",
        ]
        for s in self.settings.values():
            lines.append(f"  {s.name:<{width}}  {shown[s.name]:<{value_width}}  {s.origin()}")
        lines += ["", "What this means:"]
        lines += [f"  - {m}" for m in self.meaning()]
        lines.append("")
        if self.warnings:
            lines.append(f"Warnings ({len(self.warnings)}):")
            lines += [f"  [{w.code}] {w.message}" for w in self.warnings]
        else:
            lines.append("Warnings: none")
        return "\n".join(lines)


# ------------------------------------------------------------------------------ loading


@dataclass(frozen=True)
class _Found:
    """A setting's value as written, before validation."""

    value: Any
    source: Source
    line: int | None = None
    text: str | None = None  # the YAML scalar as written (``off`` for ``False``)


@dataclass
class _Document:
    data: dict[str, Any]
    gateway: dict[str, Any]
    # key -> (line, scalar text) for the top level and for the gateway: block
    top_lines: dict[str, tuple[int, str | None]]
    gateway_lines: dict[str, tuple[int, str | None]]
    duplicates: list[tuple[str, str, int, int]]  # (block, key, first line, last line)


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
    yaml: Any, node: Any, block: str, duplicates: list[tuple[str, str, int, int]]
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


def _read_document(path: str) -> _Document:
    yaml = _import_yaml()
    with open(path, "rb") as fh:
        content = fh.read()
    loader = yaml.SafeLoader(content)
    duplicates: list[tuple[str, str, int, int]] = []
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
        where = f"{path}:{mark.line + 1}" if mark is not None else path
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
        where = f"{path}:{line}" if line is not None else path
        raise ConfigError(
            path,
            f"{where}: gateway: must be a mapping of settings, not a {_kind(gateway)}",
            [ConfigProblem("gateway", gateway, "top-level", line, "must be a mapping")],
        )
    return _Document(data, gateway, top_lines, gateway_lines, duplicates)


def _find(doc: _Document, name: str) -> _Found | None:
    """The value BotOS reads for ``name``: top level if present (even null), else gateway:."""
    if name in doc.data:
        line, text = doc.top_lines.get(name, (None, None))
        return _Found(doc.data[name], "top-level", line, text)
    if name in doc.gateway:
        line, text = doc.gateway_lines.get(name, (None, None))
        return _Found(doc.gateway[name], "gateway", line, text)
    return None


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _show_setting(setting: Setting) -> str:
    value = setting.value
    if value is None:
        return "unset"
    if isinstance(value, float) and setting.name == "drain_timeout":
        return f"{_num(value)} s"
    if isinstance(value, float) and setting.name == "max_rss_mb":
        return f"{_num(value)} MiB" if value else "0 (off)"
    return str(value)


def _as_written(found: _Found) -> str:
    if found.text is not None and isinstance(found.value, bool):
        return (
            f" (written {found.text}: YAML reads unquoted yes/no/on/off/true/false as "
            "booleans; quote it to mean the word)"
        )
    return ""


def _at(line: int | None) -> str:
    return "" if line is None else f" (line {line})"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, list) else type(value).__name__


def _num(value: float) -> str:
    """A number without a needless ``.0`` or exponent: ``1024``, ``921.6``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _reference_count(value: Any) -> int | None:
    """What praisonai-bot's ``int(value or 0)`` makes of a value admitgate refuses."""
    if not isinstance(value, (bool, float, str)):
        return None
    try:
        coerced = int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return None
    return coerced if coerced >= 0 else None


class _Validator:
    """Validates found values with admitgate's own validation, collecting every problem."""

    def __init__(self) -> None:
        self.problems: list[ConfigProblem] = []

    def refuse(self, name: str, found: _Found, reason: str) -> None:
        if isinstance(found.value, str) and "${" in found.value and found.source != "override":
            reason += (
                " (BotOS.from_config does not substitute ${...} in admission settings; "
                "praisonai gateway start does)"
            )
        self.problems.append(
            ConfigProblem(name, found.value, found.source, found.line, reason + _as_written(found))
        )

    def count(self, name: str, found: _Found | None) -> int:
        if found is None or found.value is None:
            return 0  # praisonai-bot: int(None or 0)
        try:
            return int(getattr(ConcurrencyLimitPolicy(**{name: found.value}), name))
        except (ValueError, TypeError) as exc:
            reason = str(exc)
            coerced = _reference_count(found.value)
            if coerced is not None:
                reason += f" (praisonai-bot 0.1.16 would silently use {coerced})"
            self.refuse(name, found, reason)
            return 0

    def overflow(self, found: _Found | None) -> tuple[str, Any]:
        """The normalised policy and the value praisonai-bot's preset compares to "reject"."""
        if found is None:
            return "reject", "reject"
        written = found.value or "reject"  # praisonai-bot: value or "reject"
        try:
            if isinstance(found.value, bool):
                raise ValueError(f"overflow_policy must be a string, got {found.value!r}")
            return ConcurrencyLimitPolicy(overflow_policy=written).overflow_policy, written
        except (ValueError, TypeError) as exc:
            self.refuse("overflow_policy", found, str(exc))
            return "reject", written

    def rss(self, found: _Found | None) -> float:
        if found is None or found.value is None:
            return 0.0
        try:
            policy = build_memory_pressure_policy(found.value)
        except (ValueError, TypeError) as exc:
            reason = str(exc)
            value = found.value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if value < 0:
                    reason += " (praisonai-bot 0.1.16 would silently turn memory protection off)"
                elif math.isnan(value):
                    reason += (
                        " (praisonai-bot 0.1.16 would accept it and never shed: every "
                        "comparison with NaN is false)"
                    )
            self.refuse("max_rss_mb", found, reason)
            return 0.0
        return 0.0 if policy is None else float(policy.hard_rss_mb)

    def profile(self, found: _Found | None) -> str | None:
        if found is None or found.value is None:
            return None
        value = found.value
        if not isinstance(value, str):
            self.refuse("reliability", found, "reliability must be a profile name string")
            return None
        name = value.strip().lower()
        if name in ("", "none"):
            return None
        if name not in _PROFILES:
            self.refuse("reliability", found, f"reliability must be one of {', '.join(_PROFILES)}")
            return None
        return name

    def drain(self, found: _Found | None) -> float | None:
        if found is None or found.value is None:
            return None
        value = found.value
        try:
            if isinstance(value, bool):
                raise ValueError
            seconds = float(value)
        except (TypeError, ValueError):
            self.refuse("drain_timeout", found, "drain_timeout must be a number of seconds")
            return None
        if not math.isfinite(seconds) or seconds < 0:
            self.refuse("drain_timeout", found, "drain_timeout must be finite and >= 0")
            return None
        return seconds


def load(
    path: str | os.PathLike[str],
    *,
    max_concurrent_runs: Any = None,
    queue_depth: Any = None,
    overflow_policy: Any = None,
    max_concurrent_runs_per_scope: Any = None,
    max_rss_mb: Any = None,
    reliability: Any = None,
    drain_timeout: Any = None,
) -> GateSettings:
    """Read a gateway YAML file and resolve its admission settings as praisonai-bot does.

    Keyword arguments are overrides (the command-line flags): any that is not ``None``
    replaces the file's value before the ``reliability`` preset fills what is still unset,
    as ``praisonai gateway start``'s flags do. Raises ``OSError`` when the file cannot be
    read, :class:`ConfigError` (a ``ValueError``) when it is not a valid config, and
    ``ImportError`` naming ``admitgate[config]`` when PyYAML is missing.
    """
    display = os.fspath(path)
    if not isinstance(display, str):
        raise TypeError(f"path must be a str or os.PathLike[str], got {path!r}")
    doc = _read_document(display)
    overrides = {
        "max_concurrent_runs": max_concurrent_runs,
        "queue_depth": queue_depth,
        "overflow_policy": overflow_policy,
        "max_concurrent_runs_per_scope": max_concurrent_runs_per_scope,
        "max_rss_mb": max_rss_mb,
        "reliability": reliability,
        "drain_timeout": drain_timeout,
    }
    found: dict[str, _Found | None] = {}
    for name in SETTING_NAMES:
        override = overrides[name]
        found[name] = _Found(override, "override") if override is not None else _find(doc, name)
    return _resolve(display, doc, found)


def _resolve(path: str, doc: _Document, found: Mapping[str, _Found | None]) -> GateSettings:
    check = _Validator()
    counts = {name: check.count(name, found[name]) for name in _COUNTS}
    overflow, overflow_written = check.overflow(found["overflow_policy"])
    rss = check.rss(found["max_rss_mb"])
    profile = check.profile(found["reliability"])
    drain = check.drain(found["drain_timeout"])
    if check.problems:
        raise ConfigError(path, "\n".join(p.describe(path) for p in check.problems), check.problems)

    def setting(name: str, value: Any, note: str = "") -> Setting:
        f = found[name]
        if f is None:
            return Setting(name, value, "default", None, note)
        return Setting(name, value, f.source, f.line, note)

    settings = {
        "max_concurrent_runs": setting("max_concurrent_runs", counts["max_concurrent_runs"]),
        "queue_depth": setting("queue_depth", counts["queue_depth"]),
        "overflow_policy": setting("overflow_policy", overflow),
        "max_concurrent_runs_per_scope": setting(
            "max_concurrent_runs_per_scope", counts["max_concurrent_runs_per_scope"]
        ),
        "max_rss_mb": setting("max_rss_mb", rss),
        "reliability": setting(
            "reliability", profile, "" if profile else "praisonai-bot's safe default"
        ),
        "drain_timeout": setting("drain_timeout", drain),
    }

    # The reliability preset (praisonai-bot's resolve_reliability) fills what is unset.
    preset_name = profile or "safe default"
    cpus = os.cpu_count()
    if drain is None:
        settings["drain_timeout"] = Setting(
            "drain_timeout", _PRESET_DRAIN_S[profile], "preset", None, preset_name
        )
    if profile in (None, "production") and counts["max_concurrent_runs"] <= 0:
        settings["max_concurrent_runs"] = Setting(
            "max_concurrent_runs",
            preset_ceiling(cpus),
            "preset",
            None,
            f"{preset_name}: 4 × {cpus} CPUs, within 4..32",
        )
        if counts["queue_depth"] <= 0:
            settings["queue_depth"] = Setting(
                "queue_depth", _PRESET_QUEUE_DEPTH, "preset", None, preset_name
            )
        if overflow_written == "reject":
            settings["overflow_policy"] = Setting(
                "overflow_policy", "queue", "preset", None, preset_name
            )

    resolved = GateSettings(path, settings, (), read_memory_limits(), cpus)
    return dataclasses.replace(resolved, warnings=tuple(_warnings(resolved, doc, found)))


# ------------------------------------------------------------------------------ findings


def _warnings(
    s: GateSettings, doc: _Document, found: Mapping[str, _Found | None]
) -> list[ConfigWarning]:
    out: list[ConfigWarning] = []
    ceiling, depth, overflow = s.max_concurrent_runs, s.queue_depth, s.overflow_policy
    per_scope, rss = s.max_concurrent_runs_per_scope, s.max_rss_mb
    src = {name: setting.source for name, setting in s.settings.items()}

    def warn(code: str, message: str, *keys: str) -> None:
        out.append(ConfigWarning(code, message, keys))

    # The file itself.
    for name in SETTING_NAMES:
        if name in doc.data and name in doc.gateway and doc.data[name] != doc.gateway[name]:
            top_line = _at(doc.top_lines.get(name, (None, None))[0])
            gw_line = _at(doc.gateway_lines.get(name, (None, None))[0])
            top, gw = _show(doc.data[name]), _show(doc.gateway[name])
            unset = " (unset, so the default applies)" if doc.data[name] is None else ""
            warn(
                "top-level-and-gateway-differ",
                f"{name} is {top} at the top level{top_line} and {gw} under gateway:"
                f"{gw_line}; BotOS.from_config uses the top-level {top}{unset}, "
                f"praisonai gateway start uses the gateway: {gw}. Keep one.",
                name,
            )
    for block, key, first, last in doc.duplicates:
        name = key if block == "top" else f"gateway.{key}"
        warn(
            "duplicate-key",
            f"{name} is written twice (lines {first} and {last}); YAML keeps the last one "
            "silently.",
            key,
        )
    for block, keys in (("top", doc.data), ("gateway", doc.gateway)):
        for key in keys:
            if not isinstance(key, str) or key in SETTING_NAMES or key in _KNOWN_KEYS:
                continue
            normal = key.strip().lower().replace("-", "_")
            match = normal if normal in SETTING_NAMES else None
            if match is None:
                close = difflib.get_close_matches(normal, SETTING_NAMES, n=1, cutoff=0.8)
                match = close[0] if close else None
            if match is not None:
                lines = doc.top_lines if block == "top" else doc.gateway_lines
                name = key if block == "top" else f"gateway.{key}"
                warn(
                    "unknown-key",
                    f"{name}{_at(lines.get(key, (None, None))[0])} is not a setting "
                    f"praisonai-bot reads, so it is ignored; did you mean {match}?",
                    match,
                )
    top_admission = [n for n in SETTING_NAMES if n in doc.data]
    if top_admission:
        warn(
            "gateway-start-ignores-top-level",
            f"praisonai gateway start --config reads admission settings only under gateway: "
            f"and ignores the top-level {', '.join(top_admission)} (BotOS.from_config reads "
            "them).",
            *top_admission,
        )
    refused = [n for n in ("max_concurrent_runs_per_scope", "max_rss_mb") if n in doc.gateway]
    if refused:
        warn(
            "gateway-start-refuses-file",
            "praisonai gateway start --config (praisonai-bot 0.1.16) refuses this file: its "
            f"gateway: schema does not allow {' or '.join(refused)} (BotOS.from_config reads "
            "them).",
            *refused,
        )

    # The preset.
    if src["max_concurrent_runs"] == "preset":
        written = found["max_concurrent_runs"]
        if written is not None:
            warn(
                "zero-does-not-disable",
                f"max_concurrent_runs {_show(written.value)} does not turn admission off: the "
                f"{s.reliability or 'safe default'} reliability preset sets {ceiling}. Set "
                'reliability: default (or "off") to run without a ceiling.',
                "max_concurrent_runs",
                "reliability",
            )
        warn(
            "ceiling-from-cpu-count",
            f"the ceiling {ceiling} comes from the reliability preset (4 per CPU, 4..32) and "
            f"was computed on this machine ({s.cpu_count} CPUs); praisonai-bot counts the "
            "host's CPUs, not a container's CPU quota, so set max_concurrent_runs for a "
            "ceiling that does not move between machines.",
            "max_concurrent_runs",
        )
    if src["overflow_policy"] == "preset" and found["overflow_policy"] is not None:
        warn(
            "preset-replaced-overflow",
            "overflow_policy reject was replaced by queue: with no max_concurrent_runs set, "
            "the reliability preset turns reject into queue. Set max_concurrent_runs to keep "
            "reject.",
            "overflow_policy",
        )

    # Combinations.
    if ceiling > 0:
        if per_scope >= ceiling:
            warn(
                "per-scope-not-below-ceiling",
                f"max_concurrent_runs_per_scope {per_scope} is not below the ceiling "
                f"{ceiling}, so one tenant can still take every slot; use a value below "
                f"{ceiling} (about ceiling / active tenants).",
                "max_concurrent_runs_per_scope",
                "max_concurrent_runs",
            )
        if overflow == "queue":
            detail = (
                "queue_depth 0 does not mean 'no waiting' here"
                if depth == 0
                else f"queue_depth {depth} has no effect"
            )
            warn(
                "unbounded-queue",
                f"overflow_policy queue waits without bound ({detail}): under a sustained "
                "burst the queue, its waiting time and the memory of its turns grow without "
                "limit. Use reject or shed_oldest with a queue_depth to bound it.",
                "overflow_policy",
                "queue_depth",
            )
        elif depth == 0:
            default = (
                " (praisonai-bot's default when max_concurrent_runs is set; the documented "
                "128 is GatewayConfig's, which BotOS does not use)"
                if src["queue_depth"] == "default"
                else ""
            )
            if overflow == "shed_oldest":
                warn(
                    "shed-without-queue",
                    f"overflow_policy shed_oldest with queue_depth 0{default}: nothing ever "
                    "waits, so there is no oldest waiter to shed and every turn over the "
                    "ceiling is rejected, as with reject. Set a queue_depth.",
                    "overflow_policy",
                    "queue_depth",
                )
            else:
                warn(
                    "reject-without-queue",
                    f"queue_depth is 0{default}: every turn that finds all {ceiling} slots "
                    "busy is rejected at once, none waits. Set a queue_depth to absorb bursts.",
                    "queue_depth",
                )
    else:
        idle = [
            name
            for name, unset in (
                ("queue_depth", depth == 0),
                ("overflow_policy", src["overflow_policy"] == "default"),
                ("max_concurrent_runs_per_scope", per_scope == 0),
            )
            if not unset
        ]
        if idle:
            warn(
                "limits-without-ceiling",
                f"max_concurrent_runs is 0 (no concurrency protection), so {', '.join(idle)} "
                f"{'has' if len(idle) == 1 else 'have'} no effect.",
                "max_concurrent_runs",
                *idle,
            )
        if rss > 0:
            warn(
                "memory-only-gate",
                f"with no ceiling there is no queue to wait in: above the soft threshold "
                f"({_num(s.soft_rss_mb)} MiB) turns still start at once, and only the hard limit "
                f"({_num(rss)} MiB) sheds. Set max_concurrent_runs for backpressure.",
                "max_rss_mb",
                "max_concurrent_runs",
            )

    # This machine.
    if rss > 0:
        limit = s.memory.limit_mb
        if limit is not None and rss >= limit:
            warn(
                "rss-above-memory",
                f"max_rss_mb {_num(rss)} is not below this machine's memory ({s.memory.describe()})"
                ": the OOM killer fires before the gate sheds anything. Use about 80% of "
                f"the limit ({0.8 * limit:.0f}).",
                "max_rss_mb",
            )
        current = RssSampler().read().rss_mb
        if current is not None and rss <= current:
            warn(
                "rss-below-process",
                f"max_rss_mb {_num(rss)} is below the {current:.0f} MiB this checker process "
                "already uses; a gateway process is larger, so every turn would be rejected.",
                "max_rss_mb",
            )
    return out


def _explain(s: GateSettings) -> list[str]:
    ceiling, depth, overflow = s.max_concurrent_runs, s.queue_depth, s.overflow_policy
    per_scope, rss = s.max_concurrent_runs_per_scope, s.max_rss_mb
    out: list[str] = []
    if not s.gate_enabled:
        out.append("Admission control is off: every turn starts at once, whatever the load.")
    if ceiling > 0:
        out.append(f"At most {ceiling} turns run at once.")
        if overflow == "queue":
            out.append(
                "When every slot is busy, new turns wait in FIFO order without limit "
                "(overflow queue)."
            )
        elif depth == 0:
            out.append("When every slot is busy, a new turn is rejected at once (no queue).")
        elif overflow == "reject":
            out.append(
                f"When every slot is busy, up to {depth} turns wait in FIFO order; a turn "
                "that finds the queue full is rejected with a busy reply."
            )
        else:
            out.append(
                f"When every slot is busy, up to {depth} turns wait in FIFO order; when the "
                "queue is full the oldest waiter is shed and the newcomer waits."
            )
        if per_scope:
            lane = f" (up to {depth}, then {overflow} applies)" if overflow != "queue" else ""
            out.append(
                f"One tenant (session_id) runs at most {per_scope} turns at once; its other "
                f"turns wait in its own lane{lane} while other tenants' turns start."
            )
    if rss > 0:
        share = ""
        limit = s.memory.limit_mb
        if limit is not None:
            share = f" ({rss / limit:.0%} of this machine's {limit:.0f} MiB)"
        out.append(
            f"Memory: from {_num(s.soft_rss_mb)} MiB RSS (soft threshold = 0.9 × max_rss_mb) new "
            f"turns wait while others run; from {_num(rss)} MiB{share} they are rejected."
        )
    if s.drain_timeout > 0:
        out.append(
            f"On shutdown BotOS stops taking turns and waits up to {_num(s.drain_timeout)} s for "
            "running ones (drain_timeout; not a gate setting)."
        )
    else:
        out.append("On shutdown BotOS cuts running turns at once (drain_timeout 0).")
    return out


# ------------------------------------------------------------------------------ memory


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def _cgroup_bytes(path: Path) -> int | None:
    """A cgroup memory limit file's value in bytes; ``None`` for no limit or unreadable."""
    text = _read_text(path)
    if text is None:
        return None
    text = text.strip()
    if not text.isdigit():
        return None  # "max" (v2: no limit) or garbage
    value = int(text)
    return None if value >= _CGROUP_V1_UNLIMITED else value


def read_memory_limits(root: str | os.PathLike[str] = "/") -> MemoryLimits:
    """Total RAM (``/proc/meminfo``) and the tightest cgroup memory limit of this process.

    Reads ``memory.max`` (cgroup v2) and ``memory.limit_in_bytes`` (cgroup v1) of the
    process's own cgroup (from ``/proc/self/cgroup``) and of each ancestor, including
    ``/sys/fs/cgroup/memory.max`` and ``/sys/fs/cgroup/memory/memory.limit_in_bytes``.
    ``root`` prefixes every path. Missing files mean unknown or no limit; never raises.
    """
    base = Path(root)
    ram_mb = None
    for row in (_read_text(base / "proc/meminfo") or "").splitlines():
        parts = row.split()
        if len(parts) >= 2 and parts[0] == "MemTotal:" and parts[1].isdigit():
            ram_mb = int(parts[1]) / 1024
    if ram_mb is None and os.fspath(root) == "/" and hasattr(os, "sysconf"):
        try:
            ram_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (OSError, ValueError):
            ram_mb = None

    cgroup_root = base / "sys/fs/cgroup"
    v2_mount = cgroup_root if (cgroup_root / "cgroup.controllers").exists() else None
    if v2_mount is None and (cgroup_root / "unified/cgroup.controllers").exists():
        v2_mount = cgroup_root / "unified"
    candidates = [cgroup_root / "memory.max", cgroup_root / "memory/memory.limit_in_bytes"]
    for row in (_read_text(base / "proc/self/cgroup") or "").splitlines():
        parts = row.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, group = parts
        if controllers == "" and v2_mount is not None:
            mount, name = v2_mount, "memory.max"
        elif "memory" in controllers.split(","):
            mount, name = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        relative = Path(group.strip().lstrip("/"))
        for directory in [relative, *relative.parents]:
            candidates.append(mount / directory / name)

    limit: tuple[int, str] | None = None
    for candidate in dict.fromkeys(candidates):
        value = _cgroup_bytes(candidate)
        if value is not None and (limit is None or value < limit[0]):
            limit = (value, str(candidate))
    if limit is None:
        return MemoryLimits(ram_mb, None, None)
    return MemoryLimits(ram_mb, limit[0] / 2**20, limit[1])


# ------------------------------------------------------------------------------ command line

#: Exit codes of ``python -m admitgate check-config``.
EXIT_OK = 0
EXIT_WARNINGS = 1  # only with --strict
EXIT_INVALID = 2  # invalid config or invalid flag value (argparse usage errors exit 2 too)
EXIT_UNREADABLE = 3  # the file cannot be read, or PyYAML is missing


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m admitgate check-config",
        description=(
            "Print the admission settings praisonai-bot 0.1.16 applies from a gateway YAML "
            "file (value and source), what they mean, and warnings for risky combinations. "
            "Flags override the file. Exit codes: 0 valid, 1 warnings with --strict, "
            "2 invalid config, 3 file unreadable."
        ),
    )
    parser.add_argument("path", help="the gateway YAML file (gateway.yaml, praisonai.yaml)")
    for name, metavar in (
        ("max_concurrent_runs", "N"),
        ("queue_depth", "N"),
        ("overflow_policy", "P"),
        ("max_concurrent_runs_per_scope", "N"),
        ("max_rss_mb", "MIB"),
        ("reliability", "PROFILE"),
        ("drain_timeout", "SECONDS"),
    ):
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, metavar=metavar, help=f"override {name}"
        )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="CODE",
        help="leave out warnings with this code (repeatable), e.g. unbounded-queue",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m admitgate check-config``: returns the exit code (see ``EXIT_*``)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    overrides = {name: getattr(args, name) for name in SETTING_NAMES}

    def fail(code: int, kind: str, message: str, problems: Sequence[ConfigProblem] = ()) -> int:
        if args.json:
            report = {"path": args.path, "valid": False, "error": kind, "message": message}
            report["problems"] = [
                {
                    "key": p.key,
                    "value": _show(p.value),
                    "source": p.source,
                    "line": p.line,
                    "reason": p.reason,
                }
                for p in problems
            ]
            print(json.dumps(report, indent=2))
        else:
            print(f"check-config: {message}", file=sys.stderr)
        return code

    try:
        settings = load(args.path, **overrides)
    except ConfigError as exc:
        return fail(EXIT_INVALID, "invalid", str(exc), exc.problems)
    except OSError as exc:
        return fail(
            EXIT_UNREADABLE, "unreadable", f"cannot read {args.path}: {exc.strerror or exc}"
        )
    except ImportError as exc:
        return fail(EXIT_UNREADABLE, "missing-dependency", str(exc))

    if args.ignore:
        kept = tuple(w for w in settings.warnings if w.code not in set(args.ignore))
        settings = dataclasses.replace(settings, warnings=kept)
    strict_failure = args.strict and bool(settings.warnings)
    if args.json:
        print(json.dumps(settings.to_dict(), indent=2))
    else:
        print(settings.format_text())
        count = len(settings.warnings)
        verdict = "valid" if not count else f"valid, {count} warning{'s' if count > 1 else ''}"
        print(f"\n{verdict}" + (" (--strict: failing)" if strict_failure else ""))
    return EXIT_WARNINGS if strict_failure else EXIT_OK
