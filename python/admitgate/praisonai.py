"""Run PraisonAI BotOS (``praisonai-bot``) on the admitgate gate with one call.

    import admitgate.praisonai
    admitgate.praisonai.install()

After :func:`install`, every admission gate that praisonai-bot builds is an
:class:`admitgate.AdmissionGate`, and every turn admitgate turns away is caught
wherever praisonai-bot catches its own ``AdmissionRejected`` (so a BotOS user
gets the normal busy reply). :func:`uninstall` puts the originals back.

Where praisonai-bot 0.1.16 touches the gate (found by searching the whole
installed package, function-local imports included):

Built
  * ``bots/_admission.py`` defines ``AdmissionGate``, ``AdmissionRejected``,
    ``build_admission_gate`` and ``build_memory_pressure_policy``; its
    ``build_admission_gate`` constructs the module-global ``AdmissionGate``.
  * ``bots/botos.py`` ``BotOS.__init__``: function-local
    ``from ._admission import build_admission_gate, build_memory_pressure_policy``
    builds ``BotOS._admission_gate`` (also for the ``reliability`` presets, whose
    numbers come from ``bots/_reliability.py`` ``resolve_reliability``, which
    builds nothing itself). ``_wire_admission_gate`` hands the gate to each
    ``Bot`` and session manager; ``admission_stats`` reads ``gate.stats()``.
  * ``gateway/server.py`` ``WebSocketGateway.start_with_config``: function-local
    ``from ..bots._admission import build_admission_gate`` (gateway.yaml).
  * ``cli/features/gateway.py`` ``GatewayHandler.start``: function-local
    ``from praisonai_bot.bots._admission import build_admission_gate``
    (no-config ``praisonai gateway start`` with CLI flags).
  * ``bots/bot.py`` and ``gateway/server.py`` ``_stamp_admission_gate`` only
    pass an already-built gate on; nothing to patch there.

Caught (all catch praisonai-bot's ``AdmissionRejected`` and reply with
``rej.message``)
  * ``bots/_session.py``: module-level ``from ._admission import
    AdmissionRejected`` (bound by value at import time);
    ``BotSessionManager.chat`` enters ``gate.admit(session_id=<storage key>)``.
  * ``gateway/server.py`` ``WebSocketGateway._run_session_queue`` and
    ``WebSocketGateway._run_hook``: function-local imports.
  * ``gateway/api_endpoints.py`` ``GatewayApiEndpoints._dispatch``:
    function-local import.

What install() changes
  * ``praisonai_bot.gateway.rate_limiter.build_auth_rate_limiter`` becomes
    admitgate's (:func:`build_auth_rate_limiter`): the gateway server's approval,
    WebSocket-upgrade, pairing and magic-link limiters (built by function-local
    imports in ``WebSocketGateway.start``) are decided in admitgate's core, and
    fleet-wide without blocking the event loop when ``push.redis`` is set.
  * ``praisonai_bot.bots._admission.build_admission_gate``,
    ``build_memory_pressure_policy`` and ``AdmissionGate`` become admitgate's.
    Function-local imports read these attributes at call time, so that covers
    BotOS, the gateway server and the CLI. A ``praisonai_bot`` module that
    bound one of them by value at import time (none does in 0.1.16) is patched
    too; one that binds them while installed gets the originals back on
    uninstall. Modules outside ``praisonai_bot`` are never touched.
  * ``AdmissionRejected`` is NOT replaced (gates built before install() still
    raise it). Instead admitgate's core is told to raise
    :class:`BotOSAdmissionRejected`, a subclass of both
    ``admitgate.AdmissionRejected`` and praisonai-bot's ``AdmissionRejected``,
    so every ``except`` clause above catches it, and so does code written
    against admitgate.

Priority classes (``install(priorities=[...], priority_of=...)``)
  * Every gate praisonai-bot builds while installed gets ``priorities`` (and
    ``default_priority``), unless it is built with classes of its own.
  * ``priority_of(session_id) -> str | None`` picks each turn's class from the
    ``session_id`` BotOS passes to ``gate.admit``: for a bot's turn
    (``BotSessionManager.chat``), the user's storage key (the platform user id, or
    the identity resolver's unified id, prefixed by a route's profile namespace;
    the chat or channel is not part of it, even under ``session_scope="per_chat"``);
    for a WebSocket or HTTP API turn of the gateway, its session's id; for a hook,
    its session key. ``None``, ``""`` or a name that is no class puts
    the turn in the default class, counted as ``missing`` / ``unknown`` (the
    metrics' ``<prefix>_priority_defaulted_total``); an exception from it
    propagates (BotOS answers the turn with its own error).

Gates built while installed stay admitgate gates after :func:`uninstall`, and
then raise plain ``admitgate.AdmissionRejected`` again, which praisonai-bot's
``except`` clauses do not catch: rebuild BotOS after uninstalling.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import admitgate

from ._botos_rate_limits import build_auth_rate_limiter, rate_limit_policy
from ._priority_door import PriorityDoor

# ``BotOSAdmissionRejected`` is also available (see ``__getattr__``); it is left
# out of ``__all__`` so that ``import *`` does not import praisonai-bot.
__all__ = [
    "SessionClassGate",
    "build_auth_rate_limiter",
    "install",
    "is_installed",
    "rate_limit_policy",
    "uninstall",
]

_DISTRIBUTION = "praisonai-bot"
_PACKAGE = "praisonai_bot"
_ADMISSION_MODULE = "praisonai_bot.bots._admission"
# The gateway's endpoint rate limiters: install() replaces this module's builder.
_RATE_LIMITER_MODULE = "praisonai_bot.gateway.rate_limiter"
_RATE_LIMITER_BUILDER = "build_auth_rate_limiter"

# Names of praisonai_bot.bots._admission that install() points at admitgate.
_PATCHED_NAMES = (
    "build_admission_gate",
    "build_memory_pressure_policy",
    "AdmissionGate",
)

_lock = threading.RLock()
# One combined rejection class per praisonai-bot AdmissionRejected class, so
# repeated install()/uninstall() cycles keep handing out the same class.
_rejection_classes: dict[type, type] = {}


class SessionClassGate(admitgate.AdmissionGate):
    """An :class:`admitgate.AdmissionGate` whose turns that name no ``priority`` get the class
    ``priority_of(session_id)`` names (what :func:`install` builds for praisonai-bot)."""

    _door: PriorityDoor | None = None

    def admit(self, *, session_id: object = "", priority: str | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        if priority is None and self._door is not None:
            priority = self._door.of(session_id)
        return super().admit(session_id=session_id, priority=priority, **kwargs)

    def admit_sync(  # type: ignore[override]
        self, *, session_id: object = "", priority: str | None = None, **kwargs: Any
    ) -> Any:
        if priority is None and self._door is not None:
            priority = self._door.of(session_id)
        return super().admit_sync(session_id=session_id, priority=priority, **kwargs)


class _Classes:
    """install()'s priority settings, checked once."""

    def __init__(
        self,
        priorities: Sequence[admitgate.PriorityClass] | None,
        default_priority: str | None,
        priority_of: Callable[[str], str | None] | None,
    ) -> None:
        if priority_of is not None and not callable(priority_of):
            raise TypeError(
                f"priority_of must be None or a callable(session_id) -> str | None, "
                f"got {priority_of!r}"
            )
        if priorities is None and (priority_of is not None or default_priority is not None):
            given = "priority_of" if priority_of is not None else "default_priority"
            raise ValueError(f"{given} needs priorities=[admitgate.PriorityClass(...), ...]")
        if priorities is not None:
            priorities = list(priorities)
            # Checked as a gate checks them, so a mistake fails here, not at BotOS start.
            admitgate.build_admission_gate(
                max_concurrent_runs=1, priorities=priorities, default_priority=default_priority
            )
        self.priorities = priorities
        self.default_priority = default_priority
        self.priority_of = priority_of

    def key(self) -> tuple[Any, ...]:
        return (
            None if self.priorities is None else tuple(self.priorities),
            self.default_priority,
            self.priority_of,
        )

    def builder(self) -> Callable[..., Any]:
        """``build_admission_gate`` as praisonai-bot calls it, with these classes."""
        if self.priorities is None:
            return admitgate.build_admission_gate
        classes = self

        def build_admission_gate(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("priorities") is None:
                kwargs["priorities"] = classes.priorities
                if kwargs.get("default_priority") is None:
                    kwargs["default_priority"] = classes.default_priority
            gate = admitgate.build_admission_gate(*args, _gate_class=SessionClassGate, **kwargs)
            if isinstance(gate, SessionClassGate) and classes.priority_of is not None:
                gate._door = PriorityDoor(gate, classes.priority_of, argument="priority_of")
            return gate

        build_admission_gate.__doc__ = admitgate.build_admission_gate.__doc__
        return build_admission_gate


class _Installation:
    """What install() changed, so uninstall() can put back exactly that."""

    def __init__(self, admission: Any, originals: dict[str, Any], replacements: dict[str, Any]):
        self.classes_key: tuple[Any, ...] = (None, None, None)
        self.admission = admission
        self.originals = originals
        self.replacements = replacements
        # (module, attribute name, original value) for every binding replaced.
        self.patched: list[tuple[Any, str, Any]] = []
        self.previous_rejection_class: type | None = None
        self.rejection_class: type | None = None


_installation: _Installation | None = None


def _import_admission_module() -> Any:
    try:
        module = importlib.import_module(_ADMISSION_MODULE)
    except ImportError as exc:
        raise ImportError(
            f"admitgate.praisonai needs the {_DISTRIBUTION!r} package "
            f"(pip install {_DISTRIBUTION}); importing {_ADMISSION_MODULE} failed: {exc}",
            name=_PACKAGE,
        ) from exc
    missing = [n for n in _PATCHED_NAMES + ("AdmissionRejected",) if not hasattr(module, n)]
    if missing:
        raise ImportError(
            f"this {_DISTRIBUTION} has no {', '.join(missing)} in {_ADMISSION_MODULE}; "
            f"admitgate.praisonai supports {_DISTRIBUTION} 0.1.16",
            name=_PACKAGE,
        )
    return module


def _import_rate_limiter_module() -> Any:
    """praisonai-bot's gateway rate-limiter module, or None if this praisonai-bot has none
    (then only the gate is installed)."""
    try:
        module = importlib.import_module(_RATE_LIMITER_MODULE)
    except ImportError:
        return None
    return module if callable(getattr(module, _RATE_LIMITER_BUILDER, None)) else None


def _native() -> Any:
    """The native module's hooks for choosing which class a rejection raises."""
    from admitgate import _admitgate

    return _admitgate


def _combined_rejection_class(reference_rejected: type) -> type:
    cls = _rejection_classes.get(reference_rejected)
    if cls is None:

        class BotOSAdmissionRejected(admitgate.AdmissionRejected, reference_rejected):  # type: ignore[misc,valid-type]
            """A turn admitgate turned away, catchable as either package's AdmissionRejected."""

        BotOSAdmissionRejected.__module__ = __name__
        BotOSAdmissionRejected.__qualname__ = "BotOSAdmissionRejected"
        cls = _rejection_classes[reference_rejected] = BotOSAdmissionRejected
    return cls


def __getattr__(name: str) -> Any:
    # ``BotOSAdmissionRejected`` needs praisonai-bot, so it is made on first use
    # (this also lets pickle find the class by name).
    if name == "BotOSAdmissionRejected":
        return _combined_rejection_class(_import_admission_module().AdmissionRejected)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _praisonai_modules() -> list[Any]:
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None and (name == _PACKAGE or name.startswith(_PACKAGE + "."))
    ]


def _rebind(module: Any, replace: dict[int, tuple[Any, Any]]) -> list[tuple[str, Any]]:
    """Replace every global of ``module`` that is a key of ``replace`` (by id).

    Returns ``(name, old value)`` for each binding changed.
    """
    namespace = getattr(module, "__dict__", None)
    if not isinstance(namespace, dict):
        return []
    changed = []
    for name, value in list(namespace.items()):
        pair = replace.get(id(value))
        if pair is not None and pair[0] is value:
            namespace[name] = pair[1]
            changed.append((name, value))
    return changed


def install(
    *,
    priorities: Sequence[admitgate.PriorityClass] | None = None,
    default_priority: str | None = None,
    priority_of: Callable[[str], str | None] | None = None,
) -> None:
    """Make praisonai-bot build admitgate gates. Idempotent and thread-safe.

    ``priorities`` (most important first) gives every gate praisonai-bot builds these
    priority classes (see ``docs/priorities.md``), ``default_priority`` its default class,
    and ``priority_of(session_id)`` each turn's class from its BotOS session (see the module
    documentation for what the session id is). ``TypeError`` / ``ValueError`` for a bad one
    (``priority_of`` or ``default_priority`` without ``priorities``). Installing again with
    other settings replaces them (gates already built keep theirs).

    Imports praisonai-bot if it is not imported yet; raises ImportError naming
    the package when it is not installed.
    """
    global _installation
    with _lock:
        classes = _Classes(priorities, default_priority, priority_of)
        admission = _import_admission_module()
        if _installation is not None:
            if _installation.admission is admission and _installation.classes_key == classes.key():
                return
            # praisonai_bot.bots._admission was reloaded, or other classes: start again.
            uninstall()

        originals = {name: getattr(admission, name) for name in _PATCHED_NAMES}
        replacements = {name: getattr(admitgate, name) for name in _PATCHED_NAMES}
        replacements["build_admission_gate"] = classes.builder()
        state = _Installation(admission, originals, replacements)
        state.classes_key = classes.key()

        # Rejections first, so no admitgate gate built below can ever raise a
        # class that praisonai-bot's ``except`` clauses miss.
        native = _native()
        state.previous_rejection_class = native._rejection_class()
        state.rejection_class = _combined_rejection_class(admission.AdmissionRejected)
        native._set_rejection_class(state.rejection_class)

        swap = {id(originals[n]): (originals[n], replacements[n]) for n in _PATCHED_NAMES}
        rate_limiter = _import_rate_limiter_module()
        if rate_limiter is not None:
            original = getattr(rate_limiter, _RATE_LIMITER_BUILDER)
            originals[_RATE_LIMITER_BUILDER] = original
            replacements[_RATE_LIMITER_BUILDER] = build_auth_rate_limiter
            swap[id(original)] = (original, build_auth_rate_limiter)
        try:
            for module in [admission] + [m for m in _praisonai_modules() if m is not admission]:
                for name, old in _rebind(module, swap):
                    state.patched.append((module, name, old))
        except BaseException:
            _undo(state)
            raise
        _installation = state


def _undo(state: _Installation) -> None:
    for module, name, old in reversed(state.patched):
        namespace = module.__dict__
        current = namespace.get(name)
        # Leave alone a binding someone else has changed since.
        if any(current is r for r in state.replacements.values()):
            namespace[name] = old
    # Modules imported while installed bound admitgate's objects by value.
    back = {
        id(state.replacements[n]): (state.replacements[n], state.originals[n])
        for n in state.originals
    }
    for module in _praisonai_modules():
        _rebind(module, back)
    state.patched.clear()

    native = _native()
    if native._rejection_class() is state.rejection_class:
        previous = state.previous_rejection_class
        native._set_rejection_class(None if previous is admitgate.AdmissionRejected else previous)


def uninstall() -> None:
    """Restore praisonai-bot's own gate. A no-op when not installed."""
    global _installation
    with _lock:
        state = _installation
        if state is None:
            return
        _installation = None
        _undo(state)


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _installation is not None
