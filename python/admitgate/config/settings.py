"""The result of checking a gateway config: the effective settings with their sources, the
warnings, the invalid values (:class:`ConfigError`), and the report ``check-config`` prints.

:class:`GateSettings` is what :func:`admitgate.config.load` returns; it builds the gate its
settings describe and renders itself as text (:meth:`GateSettings.format_text`) or JSON
(:meth:`GateSettings.to_dict`). The small formatting helpers here are shared by the loader,
the warning rules and the command line, so a value is spelt the same way everywhere.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._admitgate import AdmissionGate
from .._builders import build_admission_gate, build_memory_pressure_policy
from .._priorities import PriorityClass
from .memory import MemoryLimits

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


#: admitgate's own keys: priority classes and fair queuing (docs/priorities.md). praisonai-bot
#: ignores them; they are reported (after the settings above) only when the file sets them.
ORDER_NAMES = ("priorities", "default_priority", "fairness")
ORDER_NOTE = "admitgate's own key; praisonai-bot ignores it"

#: The most characters of a value (or of a YAML error) a message shows.
SHOWN_CHARS = 80


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text``, or its start and how long it was when longer than ``limit``."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def hide_user_info(text: str) -> str:
    """``text`` with what may be a URL's user-info replaced by ``***``: after a leading
    ``scheme://``, everything up to the last ``@`` (a password may hold ``/``, ``?``, ``#`` or
    ``@``, as admitgate's fleet limit redacts it), or everything when there is no ``@`` (a URL
    that does not parse may hold its password anywhere); without a scheme, everything before
    the last ``@``."""
    at = text.rfind("@")
    scheme_end = text.find("://")
    if 0 < scheme_end and text[:scheme_end].isalnum():
        keep = scheme_end + 3
        return f"{text[:keep]}***{text[at:]}" if at > scheme_end else f"{text[:keep]}***"
    return f"***{text[at:]}" if at >= 0 else text


class _ShortRepr(reprlib.Repr):
    """``reprlib.Repr`` that hides user-info in strings, at any depth."""

    def repr_str(self, x: str, level: int) -> str:
        return super().repr_str(hide_user_info(x), level)


# Lists and mappings are shown a few levels and items deep: a file's value may be an alias
# bomb, whose full repr would never end.
_SHORT_REPR = _ShortRepr()
_SHORT_REPR.maxlevel = 3
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = _SHORT_REPR.maxset = 4
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = SHOWN_CHARS
_SHORT_REPR.maxlong = 40


def show_value(value: Any) -> str:
    """A value as YAML would write it: ``null``, ``true``, ``'text'`` (quoted), ``3.5``.

    Bounded whatever the value: a long string is cut (with its length), a huge integer
    is described by its size, a list or mapping is shown a few items and levels deep. A
    string's user-info (a URL's password) is hidden (:func:`hide_user_info`).
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return clip(repr(hide_user_info(value)))
    if isinstance(value, int) and value.bit_length() > 128:
        # str() of a huge int is slow, and refused past 4300 digits.
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (int, float)):
        return str(value)
    return clip(_SHORT_REPR.repr(value))


def show_number(value: float) -> str:
    """A number without a needless ``.0`` or exponent: ``1024``, ``921.6``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def location(path: str, line: int | None) -> str:
    """``gateway.yaml:7``, or just the path when the line is unknown."""
    return f"{path}:{line}" if line is not None else path


@dataclass(frozen=True)
class Setting:
    """One effective setting: its value, where it came from, and the line it is on."""

    name: str
    value: int | float | str | list[dict[str, Any]] | None
    source: Source
    line: int | None = None
    note: str = ""

    def origin(self) -> str:
        """Where the value came from, for people: ``gateway: line 7``, ``preset``..."""
        where = {"top-level": "top level", "gateway": "gateway:"}.get(self.source, self.source)
        if self.line is not None:
            where += f" line {self.line}"
        return f"{where} ({self.note})" if self.note else where


def _shown(setting: Setting) -> str:
    """A value as the report's table shows it: ``unset``, ``15 s``, ``1024 MiB``..."""
    value = setting.value
    if value is None:
        return "unset"
    if isinstance(value, float) and setting.name == "drain_timeout":
        return f"{show_number(value)} s"
    if isinstance(value, float) and setting.name == "max_rss_mb":
        return f"{show_number(value)} MiB" if value else "0 (off)"
    if isinstance(value, list):  # priorities: "interactive (0.5..1), batch (0.2..1)"
        return ", ".join(
            f"{c['name']} ({show_number(c['min_share'])}..{show_number(c['max_share'])})"
            for c in value
        )
    return str(value)


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
        name = {"gateway": f"gateway.{self.key}", "override": f"override {self.key}"}.get(
            self.source, self.key
        )
        return f"{location(path, self.line)}: {name} = {show_value(self.value)}: {self.reason}"


class ConfigError(ValueError):
    """The file is not a valid gateway config; ``problems`` lists every invalid value.

    ``path`` is the file; ``key`` and ``value`` are those of the first problem (``None``
    when the file as a whole is invalid, e.g. not YAML or not a mapping); ``warnings`` are
    those read from the file alone (``unknown-key``: a misspelt setting).
    """

    def __init__(
        self,
        path: str,
        message: str,
        problems: Sequence[ConfigProblem] = (),
        warnings: Sequence[ConfigWarning] = (),
    ):
        super().__init__(message)
        self.path = path
        self.problems = tuple(problems)
        #: The warnings the file alone shows (a misspelt key), which may explain a problem.
        self.warnings = tuple(warnings)
        self.key = self.problems[0].key if self.problems else None
        self.value = self.problems[0].value if self.problems else None


@dataclass(frozen=True)
class RateLimitSettings:
    """``gateway.rate_limit`` (read by ``config/rate_limit.py``) as :func:`admitgate.praisonai.rate_limit_policy` takes it."""

    max_requests: int
    window_seconds: float
    lockout_seconds: float
    line: int | None

    def policy_kwargs(self) -> dict[str, Any]:
        """``rate_limit_policy(**kwargs)``."""
        return {
            "max_requests": self.max_requests,
            "window_seconds": self.window_seconds,
            "lockout_seconds": self.lockout_seconds,
        }

    def meaning(self) -> str:
        """One line for people."""
        if self.max_requests == 0:
            return "gateway.rate_limit: max_requests is 0, so rate limiting is off."
        window = show_number(self.window_seconds)
        after = (
            f"then locked out for {show_number(self.lockout_seconds)} s"
            if self.lockout_seconds
            else "then refused until the window ends"
        )
        return (
            f"gateway.rate_limit: at most {self.max_requests} requests per scope and identity "
            f"in a {window} s window that starts at its first request, {after}; up to "
            f"{2 * self.max_requests} can pass within {window} s across a window's end "
            "(admitgate.RateLimit counts any interval exactly)."
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {**self.policy_kwargs(), "line": self.line, "meaning": self.meaning()}


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
    #: ``gateway.rate_limit`` (see ``config/rate_limit.py``), if the file has the block.
    rate_limit: RateLimitSettings | None = None

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
        for name in ORDER_NAMES:
            if name in self.settings:
                kwargs[name] = self.settings[name].value
        if "priorities" in kwargs:
            kwargs["priorities"] = [PriorityClass(**c) for c in kwargs["priorities"]]
        return kwargs

    def build_gate(self) -> AdmissionGate | None:
        """``build_admission_gate(**self.gate_kwargs())``: the gate, or ``None`` when off."""
        return build_admission_gate(**self.gate_kwargs())

    def meaning(self) -> list[str]:
        """What the settings do, one sentence per line."""
        ceiling, depth, overflow = self.max_concurrent_runs, self.queue_depth, self.overflow_policy
        per_scope, rss = self.max_concurrent_runs_per_scope, self.max_rss_mb
        out: list[str] = []
        if not self.gate_enabled:
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
        classes = self.settings.get("priorities")
        if classes is not None and isinstance(classes.value, list):
            names = ", ".join(str(c["name"]) for c in classes.value)
            out.append(
                f"Priority classes, most important first: {names}; a class below its "
                "guaranteed share (min_share) runs first, a full queue sheds the least "
                "important class first (docs/priorities.md)."
            )
        if rss > 0:
            share = ""
            limit = self.memory.limit_mb
            if limit is not None:
                share = f" ({rss / limit:.0%} of this machine's {limit:.0f} MiB)"
            out.append(
                f"Memory: from {show_number(self.soft_rss_mb)} MiB RSS (soft threshold = 0.9 × "
                f"max_rss_mb) new turns wait while others run; from {show_number(rss)} "
                f"MiB{share} they are rejected."
            )
        if self.drain_timeout > 0:
            out.append(
                "On shutdown BotOS stops taking turns and waits up to "
                f"{show_number(self.drain_timeout)} s for running ones (drain_timeout; not a "
                "gate setting)."
            )
        else:
            out.append("On shutdown BotOS cuts running turns at once (drain_timeout 0).")
        return out

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
            "rate_limit": self.rate_limit.to_dict() if self.rate_limit else None,
            "machine": {
                "cpu_count": self.cpu_count,
                "ram_mb": self.memory.ram_mb,
                "cgroup_limit_mb": self.memory.cgroup_limit_mb,
                "cgroup_file": self.memory.cgroup_file,
            },
        }

    def format_text(self) -> str:
        """The human report ``check-config`` prints: settings, meaning, warnings."""
        width = max(len(n) for n in self.settings)
        shown = {name: _shown(s) for name, s in self.settings.items()}
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
        if self.rate_limit is not None:
            lines.append(f"  - {self.rate_limit.meaning()}")
        lines.append("")
        if self.warnings:
            lines.append(f"Warnings ({len(self.warnings)}):")
            lines += [f"  [{w.code}] {w.message}" for w in self.warnings]
        else:
            lines.append("Warnings: none")
        return "\n".join(lines)
