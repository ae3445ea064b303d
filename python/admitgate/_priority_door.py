"""Where a front door reads a request's priority class: the ``priority=`` argument of
:class:`admitgate.asgi.AdmissionMiddleware` and :class:`admitgate.grpc.AdmissionInterceptor`.

``priority=`` is either ``"header:NAME"`` (an HTTP request header; for gRPC, the metadata key
of that name), ``"metadata:KEY"`` (the same, named as gRPC names it), or a callable given
what the front door's ``session_id`` callable gets (the ASGI scope, the gRPC call's
``HandlerCallDetails``) that returns a class name or ``None``.

What a client sends is a claim, never an error: a missing or empty value, or a name the gate
has no class for, puts the request in the gate's default class and is counted
(:func:`defaulted`, exported by :mod:`admitgate.metrics` as
``<prefix>_priority_defaulted_total{cause}``). A callable that returns something other than
a str or ``None`` is a bug in the app: ``TypeError``, as for ``session_id``.

It imports no front door, nor grpc.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Final

__all__ = ["PRIORITY_SOURCES", "PriorityDoor", "defaulted"]

PRIORITY_SOURCES: Final = ("header:", "metadata:")
"""The prefixes of a ``priority=`` spec a front door reads from the request."""

_KEY = re.compile(r"[a-z0-9_.\-]+")

_lock = threading.Lock()
# Per gate: [missing, unknown]. Weak, so a gate that goes leaves nothing behind.
_counts: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def defaulted(gate: Any) -> dict[str, int]:
    """How many requests front doors put in ``gate``'s default class because they named no
    class (``"missing"``) or one the gate does not have (``"unknown"``)."""
    with _lock:
        missing, unknown = _counts.get(gate, (0, 0))
    return {"missing": missing, "unknown": unknown}


def _count(gate: Any, index: int) -> None:
    with _lock:
        counts = _counts.get(gate)
        if counts is None:
            counts = _counts[gate] = [0, 0]
        counts[index] += 1


class PriorityDoor:
    """One front door's ``priority=``: reads a request's class for ``gate.admit(priority=)``.

    Built once per front door; ``ValueError`` for a spec that is not ``header:NAME`` or
    ``metadata:KEY`` (NAME/KEY lowercase letters, digits, ``-``, ``_``, ``.``; not ending in
    ``-bin``) or for a gate without classes, ``TypeError`` for anything else that is not a
    callable.
    """

    __slots__ = ("_gate", "_known", "_key", "_header", "_call", "argument")

    def __init__(self, gate: Any, priority: object, *, argument: str = "priority") -> None:
        self.argument = argument
        self._gate = gate
        classes = gate.stats().get("classes")
        if not classes:
            raise ValueError(
                f"{argument}={priority!r} needs a gate built with priorities=[...] (this gate "
                "has no classes)"
            )
        # A gate's class names are fixed once it is built (reconfigure changes shares only).
        self._known: frozenset[str] = frozenset(classes)
        self._key: str | None = None
        self._header = b""
        self._call: Callable[[Any], object] | None = None
        if isinstance(priority, str):
            key = next(
                (priority[len(p) :] for p in PRIORITY_SOURCES if priority.startswith(p)), None
            )
            if key is None or not _KEY.fullmatch(key) or key.endswith("-bin"):
                raise ValueError(
                    f"{argument} must be 'header:NAME', 'metadata:KEY' (a lowercase header "
                    f"name or gRPC metadata key, not ending in -bin) or a callable, got "
                    f"{priority!r}"
                )
            self._key = key
            self._header = key.encode()
        elif callable(priority):
            self._call = priority
        else:
            raise TypeError(
                f"{argument} must be None, 'header:NAME', 'metadata:KEY' or a callable "
                f"returning a class name, got {priority!r}"
            )

    def _checked(self, value: object) -> str | None:
        """The class ``value`` names, or ``None`` (the default class), counting why."""
        if value is None or value == "":
            _count(self._gate, 0)
            return None
        if not isinstance(value, str):
            raise TypeError(f"{self.argument} callable must return a str or None, got {value!r}")
        if value in self._known:  # the usual case: a known name as sent
            return value
        name = value.strip()
        if name in self._known:
            return name
        _count(self._gate, 0 if not name else 1)
        return None

    def of(self, value: Any) -> str | None:
        """The class the callable gives for ``value`` (a session id, for BotOS)."""
        assert self._call is not None
        return self._checked(self._call(value))

    def from_scope(self, scope: Any) -> str | None:
        """The class of the ASGI request ``scope`` (``None``: the default class)."""
        if self._call is not None:
            return self._checked(self._call(scope))
        key = self._header
        for name, value in scope.get("headers") or ():
            if name == key:
                try:
                    return self._checked(value.decode("ascii"))
                except UnicodeDecodeError:
                    _count(self._gate, 1)
                    return None
        return self._checked(None)

    def from_call(self, details: Any, metadata: Iterable[Any]) -> str | None:
        """The class of a gRPC call: ``details`` for a callable, its ``metadata`` for a key."""
        if self._call is not None:
            return self._checked(self._call(details))
        for entry in metadata:
            if entry[0] == self._key:
                value = entry[1]
                return self._checked(value if isinstance(value, str) else None)
        return self._checked(None)
