"""BotOS's rate limiters, decided in admitgate's Rust core: the builders behind
:func:`admitgate.praisonai.rate_limit_policy` and the ``build_auth_rate_limiter`` that
:func:`admitgate.praisonai.install` puts in praisonai-bot's place.

Both return an :class:`admitgate._admitgate.WindowLockout`: praisonai's rule (a window anchored
at a key's first request, then a lockout) kept exactly, locally or fleet-wide on Redis. See
``docs/praisonai-rate-limits.md`` for the rule, the fixes and the fleet's guarantees.
"""

from __future__ import annotations

import math
import re
import threading
import urllib.parse
from typing import Any, Literal

from ._admitgate import FleetLimit, WindowLockout

__all__ = ["build_auth_rate_limiter", "rate_limit_policy"]

# The reference AuthRateLimiter's defaults (praisonai_bot/gateway/rate_limiter.py).
_AUTH_DEFAULTS = {
    "max_attempts": 5,
    "window_seconds": 60.0,
    "lockout_seconds": 300.0,
    "max_keys": 10_000,
}
# A policy's key cap: the reference SlidingWindowRateLimitPolicy has none (its memory grows
# with every identity it ever saw); admitgate holds at most this many live keys.
POLICY_MAX_KEYS = 1 << 20
# How long a fleet decision may hold a running event loop before the fallback answers.
DEFAULT_MAX_BLOCK_S = 0.003

_fleets: dict[str, FleetLimit] = {}
_fleets_lock = threading.Lock()


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _seconds(name: str, value: Any, *, zero_ok: bool) -> float:
    bound = ">= 0" if zero_ok else "> 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds {bound}, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


def _fleet(redis: str | FleetLimit, name: str) -> FleetLimit:
    """The connection for ``redis``: a FleetLimit given as is, or one per URL, shared by every
    limiter built on that URL in this process."""
    if isinstance(redis, FleetLimit):
        return redis
    if not isinstance(redis, str):
        raise ValueError(
            f"redis_url must be a Redis URL str or an admitgate.FleetLimit, got a {type(redis).__name__}"
        )
    with _fleets_lock:
        fleet = _fleets.get(redis)
        if fleet is None:
            fleet = _fleets[redis] = FleetLimit(redis, f"admitgate:window-lockout:{name}", 1)
        return fleet


def _decision_class() -> Any:
    try:
        from praisonaiagents.gateway.protocols import (  # type: ignore[import-untyped]
            RateLimitDecision,
        )
    except ImportError as exc:
        raise ImportError(
            "admitgate.praisonai.rate_limit_policy answers praisonaiagents' RateLimitDecision: "
            f"pip install 'admitgate[praisonai]' (importing praisonaiagents failed: {exc})",
            name="praisonaiagents",
        ) from exc
    return RateLimitDecision


def rate_limit_policy(
    max_requests: int,
    window_seconds: float = 60.0,
    lockout_seconds: float = 0.0,
    redis_url: str | FleetLimit | None = None,
    *,
    name: str = "botos",
    on_backend_error: Literal["local", "reject", "allow"] = "local",
    max_keys: int = POLICY_MAX_KEYS,
    max_block_s: float = DEFAULT_MAX_BLOCK_S,
) -> WindowLockout:
    """praisonaiagents' ``RateLimitPolicyProtocol``, deciding as its
    ``SlidingWindowRateLimitPolicy`` does, in Rust.

    ``check(*, identity, scope, now)`` answers praisonaiagents' ``RateLimitDecision``: per
    ``(scope, identity)``, a window starts at the key's first request; the request that makes
    it ``max_requests + 1`` is refused, and then the key is locked out for
    ``lockout_seconds`` (or, with no lockout, refused until its window ends). Up to
    ``2 × max_requests`` pass within ``window_seconds`` across a window's end:
    :class:`admitgate.RateLimit` is the stricter choice. ``max_requests=0`` turns limiting off.

    With ``redis_url`` (a URL, or an :class:`admitgate.FleetLimit` whose connection it shares)
    the decision is fleet-wide, in one Lua call, and its time is Redis ``TIME``: the
    caller's ``now`` is then read only by the ``"local"`` fallback. ``name`` namespaces the
    keys; ``on_backend_error`` (``"local"``, ``"reject"`` or ``"allow"``) is what a decision
    does when Redis is down or has not answered within ``max_block_s`` while an event loop
    runs on the calling thread (and, until that late call answers, without waiting at all:
    ``stats()["suspect_decisions"]``). At most ``max_keys`` live keys are held locally (a new
    key past them is refused).
    """
    max_requests = _count("max_requests", max_requests)
    window = _seconds("window_seconds", window_seconds, zero_ok=False)
    lockout = _seconds("lockout_seconds", lockout_seconds, zero_ok=True)
    fleet = None if redis_url is None else _fleet(redis_url, name)
    return WindowLockout(
        max_requests,
        window,
        lockout,
        max_keys=_positive("max_keys", max_keys),
        decision=_decision_class(),
        fleet=fleet,
        name=name,
        on_backend_error=on_backend_error,
        max_block_s=_seconds("max_block_s", max_block_s, zero_ok=True),
    )


def _redis_url(redis_config: Any) -> str:
    """The URL of praisonai-bot's ``gateway.push.redis`` settings (``url``, or ``host``,
    ``port``, ``db`` and ``password``), as its ``build_auth_rate_limiter`` connects."""
    url = getattr(redis_config, "url", None)
    if url:
        return str(url)
    host = getattr(redis_config, "host", "localhost") or "localhost"
    port = int(getattr(redis_config, "port", 6379) or 6379)
    db = int(getattr(redis_config, "db", 0) or 0)
    password = getattr(redis_config, "password", None)
    auth = f":{urllib.parse.quote(str(password), safe='')}@" if password else ""
    return f"redis://{auth}{host}:{port}/{db}"


def build_auth_rate_limiter(redis_config: Any = None, **kwargs: Any) -> WindowLockout:
    """praisonai-bot's ``build_auth_rate_limiter``, on admitgate: the limiter of the gateway's
    approval, WebSocket-upgrade, pairing and magic-link endpoints.

    Takes the reference's arguments (``max_attempts=5``, ``window_seconds=60``,
    ``lockout_seconds=300``, ``max_keys=10_000``) and answers its ``allow(endpoint,
    identity)``, ``time_until_allowed``, ``reset`` and ``prune``. With ``redis_config`` (the
    gateway's ``push.redis``: ``url``, or ``host``/``port``/``db``/``password``, and
    ``prefix``) it is fleet-wide on that Redis, and never blocks the event loop for more than
    a few milliseconds (see the docs); without, it is local, as the reference's.
    """
    unknown = sorted(set(kwargs) - set(_AUTH_DEFAULTS))
    if unknown:
        raise TypeError(
            f"build_auth_rate_limiter() got unexpected keyword arguments: {', '.join(unknown)}"
        )
    settings = {**_AUTH_DEFAULTS, **kwargs}
    fleet = None
    name = "praison-authrl"
    if redis_config is not None:
        prefix = str(getattr(redis_config, "prefix", "praison:") or "praison:")
        # A key namespace Redis Cluster hash tags allow: no braces, spaces or controls.
        name = re.sub(r"[{}\s\x00-\x1f\x7f]", "", prefix + "authrl")[-100:]
        fleet = _fleet(_redis_url(redis_config), name)
    # 0: the reference would allow one request per window, then lock the key out.
    max_attempts = _positive("max_attempts", settings["max_attempts"])
    return WindowLockout(
        max_attempts,
        _seconds("window_seconds", settings["window_seconds"], zero_ok=False),
        _seconds("lockout_seconds", settings["lockout_seconds"], zero_ok=True),
        max_keys=_positive("max_keys", settings["max_keys"]),
        fleet=fleet,
        name=name,
        on_backend_error="local",
        max_block_s=DEFAULT_MAX_BLOCK_S,
    )
