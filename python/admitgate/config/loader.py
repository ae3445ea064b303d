"""The loader: read a gateway config and resolve its admission settings as praisonai-bot does.

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
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from .._admitgate import ConcurrencyLimitPolicy
from .._builders import build_admission_gate, build_memory_pressure_policy
from .._priorities import PriorityClass
from .document import Document, Found, kind_of, read_document
from .memory import read_memory_limits
from .rate_limit import read_rate_limit
from .settings import (
    ORDER_NAMES,
    ORDER_NOTE,
    SETTING_NAMES,
    SHOWN_CHARS,
    ConfigError,
    ConfigProblem,
    GateSettings,
    Setting,
)
from .warnings import find_warnings, misspelt_keys

_COUNTS = ("max_concurrent_runs", "queue_depth", "max_concurrent_runs_per_scope")
_PROFILES = ("production", "default", "off")
_PRESET_QUEUE_DEPTH = 32
_PRESET_DRAIN_S: dict[str | None, float] = {
    "production": 15.0,
    None: 5.0,
    "default": 5.0,
    "off": 0.0,
}


def preset_ceiling(cpu_count: int | None = None) -> int:
    """The ceiling praisonai-bot's ``reliability`` preset fills in: 4 turns per CPU, 4..32.

    ``cpu_count`` defaults to ``os.cpu_count()``, which is what praisonai-bot uses (it counts
    the machine's CPUs, not a container's CPU quota).
    """
    cpus = os.cpu_count() if cpu_count is None else cpu_count
    return max(4, min(32, (cpus or 2) * 4))


def _as_written(found: Found) -> str:
    if found.text is not None and isinstance(found.value, bool):
        return (
            f" (written {found.text}: YAML reads unquoted yes/no/on/off/true/false as "
            "booleans; quote it to mean the word)"
        )
    return ""


def _reference_count(value: Any) -> int | None:
    """What praisonai-bot's ``int(value or 0)`` makes of a value admitgate refuses."""
    if not isinstance(value, (bool, float, str)):
        return None
    try:
        coerced = int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return None
    return coerced if coerced >= 0 else None


_EXPECTED = {
    "max_concurrent_runs": "an integer",
    "queue_depth": "an integer",
    "max_concurrent_runs_per_scope": "an integer",
    "overflow_policy": "a string",
    "max_rss_mb": "a number",
    "reliability": "a profile name string",
    "drain_timeout": "a number of seconds",
    "default_priority": "a priority class name string",
    "fairness": "'tenant' or 'none'",
}
_CLASS_KEYS = ("name", "min_share", "max_share")


class _Validator:
    """Validates found values with admitgate's own validation, collecting every problem."""

    def __init__(self) -> None:
        self.problems: list[ConfigProblem] = []

    def plain(self, name: str, found: Found) -> bool:
        """Whether the value is a scalar small enough for the gate's validation, whose
        messages show it whole; otherwise refuses it, with a message that shows it cut."""
        value = found.value
        if isinstance(value, str) and len(value) > SHOWN_CHARS:
            reason = f"{name} must be {_EXPECTED[name]}, not a string of {len(value)} characters"
        elif isinstance(value, str) and ("@" in value or "://" in value):
            # Never valid here, and maybe a URL with a password: the gate's message would
            # show it whole.
            reason = f"{name} must be {_EXPECTED[name]}, not a URL or an address"
        elif value is None or isinstance(value, (bool, int, float, str)):
            return True
        else:
            reason = f"{name} must be {_EXPECTED[name]}, not a {kind_of(value)}"
        self.refuse(name, found, reason)
        return False

    def refuse(self, name: str, found: Found, reason: str) -> None:
        if isinstance(found.value, str) and "${" in found.value and found.source != "override":
            reason += (
                " (BotOS.from_config does not substitute ${...} in admission settings; "
                "praisonai gateway start does)"
            )
        self.problems.append(
            ConfigProblem(name, found.value, found.source, found.line, reason + _as_written(found))
        )

    def count(self, name: str, found: Found | None) -> int:
        if found is None or found.value is None:
            return 0  # praisonai-bot: int(None or 0)
        if not self.plain(name, found):
            return 0
        try:
            return int(getattr(ConcurrencyLimitPolicy(**{name: found.value}), name))
        except (ValueError, TypeError) as exc:
            reason = str(exc)
            coerced = _reference_count(found.value)
            if coerced is not None:
                reason += f" (praisonai-bot 0.1.16 would silently use {coerced})"
            self.refuse(name, found, reason)
            return 0

    def overflow(self, found: Found | None) -> tuple[str, Any]:
        """The normalised policy and the value praisonai-bot's preset compares to "reject"."""
        if found is None:
            return "reject", "reject"
        if not self.plain("overflow_policy", found):
            return "reject", None
        written = found.value or "reject"  # praisonai-bot: value or "reject"
        try:
            if isinstance(found.value, bool):
                raise ValueError(f"overflow_policy must be a string, got {found.value!r}")
            return ConcurrencyLimitPolicy(overflow_policy=written).overflow_policy, written
        except (ValueError, TypeError) as exc:
            self.refuse("overflow_policy", found, str(exc))
            return "reject", written

    def rss(self, found: Found | None) -> float:
        if found is None or found.value is None or not self.plain("max_rss_mb", found):
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

    def profile(self, found: Found | None) -> str | None:
        if found is None or found.value is None or not self.plain("reliability", found):
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

    def order(self, found: Mapping[str, Found | None]) -> dict[str, Any]:
        """``priorities``, ``default_priority`` and ``fairness`` (admitgate's own keys, which
        praisonai-bot ignores), checked as the gate checks them; as written (JSON-ready)."""
        given = {
            name: f
            for name in ORDER_NAMES
            if (f := found.get(name)) is not None and f.value is not None
        }
        out: dict[str, Any] = {}
        listed = given.get("priorities")
        if listed is not None:
            if not isinstance(listed.value, list):
                self.refuse(
                    "priorities",
                    listed,
                    "priorities must be a list of classes (name, min_share, max_share), not "
                    f"a {kind_of(listed.value)}",
                )
                return {}
            classes = []
            for i, item in enumerate(listed.value):
                where = f"priorities[{i}]"
                if not isinstance(item, dict):
                    reason = f"{where} must be a mapping of {', '.join(_CLASS_KEYS)}"
                    self.refuse("priorities", listed, f"{reason}, not a {kind_of(item)}")
                    return {}
                unknown = sorted(str(k) for k in item if k not in _CLASS_KEYS)
                if unknown:
                    reason = f"{where} has unknown keys {unknown}; known: {', '.join(_CLASS_KEYS)}"
                    self.refuse("priorities", listed, reason)
                    return {}
                try:
                    classes.append(PriorityClass(**item))
                except (TypeError, ValueError) as exc:
                    self.refuse("priorities", listed, f"{where}: {exc}")
                    return {}
            out["priorities"] = [
                {"name": c.name, "min_share": c.min_share, "max_share": c.max_share}
                for c in classes
            ]
        for name in ("default_priority", "fairness"):
            if name in given and self.plain(name, given[name]):
                out[name] = given[name].value
        if out and not self.problems:
            try:
                build_admission_gate(max_concurrent_runs=1, **gate_order(out))
            except (TypeError, ValueError) as exc:
                first = next(iter(given))
                self.refuse(first, given[first], str(exc))
                return {}
        return out

    def drain(self, found: Found | None) -> float | None:
        if found is None or found.value is None or not self.plain("drain_timeout", found):
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
    doc = read_document(display)
    overrides = {
        "max_concurrent_runs": max_concurrent_runs,
        "queue_depth": queue_depth,
        "overflow_policy": overflow_policy,
        "max_concurrent_runs_per_scope": max_concurrent_runs_per_scope,
        "max_rss_mb": max_rss_mb,
        "reliability": reliability,
        "drain_timeout": drain_timeout,
    }
    found: dict[str, Found | None] = {}
    for name in SETTING_NAMES:
        override = overrides[name]
        found[name] = Found(override, "override") if override is not None else doc.find(name)
    for name in ORDER_NAMES:
        found[name] = doc.find(name)
    return _resolve(display, doc, found)


def gate_order(written: Mapping[str, Any]) -> dict[str, Any]:
    """``build_admission_gate`` arguments from the order keys as written."""
    kwargs = dict(written)
    if "priorities" in kwargs:
        kwargs["priorities"] = [PriorityClass(**c) for c in kwargs["priorities"]]
    return kwargs


def _resolve(path: str, doc: Document, found: Mapping[str, Found | None]) -> GateSettings:
    check = _Validator()
    counts = {name: check.count(name, found[name]) for name in _COUNTS}
    overflow, overflow_written = check.overflow(found["overflow_policy"])
    rss = check.rss(found["max_rss_mb"])
    profile = check.profile(found["reliability"])
    drain = check.drain(found["drain_timeout"])
    order = check.order(found)
    rate_limit, rate_problems, rate_warnings = read_rate_limit(doc)
    check.problems += rate_problems
    if check.problems:
        raise ConfigError(
            path,
            "\n".join(p.describe(path) for p in check.problems),
            check.problems,
            misspelt_keys(doc) + rate_warnings,
        )

    def setting(name: str, value: Any, note: str = "") -> Setting:
        f = found[name]
        if f is None:
            return Setting(name, value, "default", None, note)
        return Setting(name, value, f.source, f.line, note)

    values: dict[str, Any] = {
        **counts,
        "overflow_policy": overflow,
        "max_rss_mb": rss,
        "reliability": profile,
        "drain_timeout": drain,
    }
    notes = {"reliability": "" if profile else "praisonai-bot's safe default"}
    settings = {name: setting(name, values[name], notes.get(name, "")) for name in SETTING_NAMES}
    for name, value in order.items():
        settings[name] = setting(name, value, ORDER_NOTE)

    # The reliability preset (praisonai-bot's resolve_reliability) fills what is unset.
    preset_name = profile or "safe default"
    cpus = os.cpu_count()

    def preset(name: str, value: int | float | str, note: str = preset_name) -> None:
        settings[name] = Setting(name, value, "preset", None, note)

    if drain is None:
        preset("drain_timeout", _PRESET_DRAIN_S[profile])
    if profile in (None, "production") and counts["max_concurrent_runs"] <= 0:
        note = f"{preset_name}: 4 × {cpus} CPUs, within 4..32"
        preset("max_concurrent_runs", preset_ceiling(cpus), note)
        if counts["queue_depth"] <= 0:
            preset("queue_depth", _PRESET_QUEUE_DEPTH)
        if overflow_written == "reject":
            preset("overflow_policy", "queue")

    resolved = GateSettings(path, settings, (), read_memory_limits(), cpus, rate_limit)
    warnings = find_warnings(resolved, doc, found) + rate_warnings
    return dataclasses.replace(resolved, warnings=tuple(warnings))
