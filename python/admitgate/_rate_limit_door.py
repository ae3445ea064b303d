"""Budgets at the in-process front doors: what the HTTP middleware and the gRPC interceptor
add for a gate built with ``rate_limit=``, as the broker's ``--rate-key`` and usage report do.

- :class:`RateKey`: ``rate_key="header:x-api-key|header:authorization|tenant"`` (``metadata:``
  for gRPC): whose budget a request spends, the first source it carries, passed to
  ``gate.admit(identity=...)`` as bytes prefixed with the source's index (a tenant and an API
  key of the same text are two identities). A request with none of them spends one anonymous
  budget, so leaving the header out escapes nothing. The gate hashes the identity before it
  keeps it; no front door logs, exports or answers it.
- :func:`refusal_fields`: the ``RateLimit-Policy`` / ``RateLimit`` fields of a
  ``rate_limited`` 429, as ``draft-ietf-httpapi-ratelimit-headers-11`` (May 2026) writes them
  (sections 3 and 4), and as the broker sends them: the policies of the
  :class:`admitgate.RateLimit` that refused, and the one that did with ``r=0`` and ``t`` the
  whole seconds of ``Retry-After``. No partition key (it would echo the identity).
- :data:`USAGE_KEY` and :func:`parse_usage`: the agent's token report
  (``admitgate-usage-tokens``, a response header or trailer, gRPC trailing metadata), settled
  against the turn (``turn.report_usage``) and never passed to the client; a malformed value
  is ignored (the estimate stays) and still removed.

It imports no front door, nor grpc or the A2A SDK.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, Final

USAGE_KEY: Final = "admitgate-usage-tokens"
"""The response header (HTTP/1.1), trailer (HTTP/2) or trailing metadata key (gRPC) an agent
reports a turn's token use in: whole tokens, 1 to 15 ASCII digits."""

USAGE_HEADER: Final = USAGE_KEY.encode()

ANONYMOUS: Final = b"\xff"
"""The identity of a request that carries none of its ``rate_key`` sources."""

_MAX_SOURCES = 8
_MAX_USAGE_DIGITS = 15
_NAME = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")
_UNITS = {
    "s": 1,
    "sec": 1,
    "second": 1,
    "min": 60,
    "minute": 60,
    "h": 3600,
    "hour": 3600,
    "day": 86400,
    "d": 86400,
}
_UNIT_NAMES = {1: "s", 60: "min", 3600: "h", 86400: "day"}


class RateKey:
    """A parsed ``rate_key``: the sources tried in order.

    ``prefix`` is the source keyword of a header: ``"header"`` for HTTP, ``"metadata"`` for
    gRPC (each door accepts both spellings); ``tenant`` reads the request's ``session_id``.
    """

    __slots__ = ("sources", "text")

    def __init__(self, text: object, *, argument: str = "rate_key") -> None:
        if not isinstance(text, str):
            raise TypeError(f"{argument} must be a str or None, got {text!r}")
        sources: list[str | None] = []
        for part in text.split("|"):
            part = part.strip()
            if part == "tenant":
                sources.append(None)
                continue
            kind, colon, name = part.partition(":")
            name = name.strip()
            if not colon or kind not in ("header", "metadata"):
                raise ValueError(
                    f"{argument}={text!r}: each source must be header:NAME, metadata:NAME or "
                    f"tenant, got {part!r}"
                )
            if not _NAME.fullmatch(name) or name.endswith("-bin"):
                raise ValueError(
                    f"{argument}={text!r}: {name!r} is not a lowercase header name (nor a -bin "
                    "metadata key)"
                )
            sources.append(name)
        if len(sources) > _MAX_SOURCES:
            raise ValueError(f"{argument}={text!r}: at most {_MAX_SOURCES} sources")
        self.sources: tuple[str | None, ...] = tuple(sources)
        self.text = text

    @property
    def uses_tenant(self) -> bool:
        """Whether a source is the tenant (the door's ``session_id``)."""
        return None in self.sources

    def identity(self, lookup: dict[str, bytes], tenant: str) -> bytes:
        """The identity of a request whose headers (or metadata) are ``lookup`` (lowercase
        name to first value) and whose tenant is ``tenant``."""
        for index, source in enumerate(self.sources):
            value = (
                tenant.encode("utf-8", "surrogatepass") if source is None else lookup.get(source)
            )
            if value:
                return bytes((index,)) + value
        return ANONYMOUS

    def identity_of_headers(self, headers: Iterable[tuple[bytes, bytes]], tenant: str) -> bytes:
        """:meth:`identity` from ASGI ``headers`` (first value of each name)."""
        wanted = {s for s in self.sources if s is not None}
        found: dict[str, bytes] = {}
        for name, value in headers:
            key = name.decode("latin-1").lower()
            if key in wanted and key not in found:
                found[key] = value
        return self.identity(found, tenant)

    def identity_of_metadata(self, metadata: Iterable[Any], tenant: str) -> bytes:
        """:meth:`identity` from gRPC invocation metadata (first value of each key)."""
        wanted = {s for s in self.sources if s is not None}
        found: dict[str, bytes] = {}
        for entry in metadata or ():
            key, value = entry[0], entry[1]
            if key in wanted and key not in found:
                found[key] = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return self.identity(found, tenant)


def check_cost(cost: object) -> int:
    """``cost`` (the token estimate each gated request reserves) if it is an int >= 0."""
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 0:
        raise ValueError(f"cost must be an int >= 0 (tokens), got {cost!r}")
    return cost


def admit_budget_kwargs(rate_key: RateKey | None, cost: int, identity: Any) -> dict[str, Any]:
    """The ``gate.admit`` keywords of the budget: ``identity=`` (``identity()`` called only
    with a ``rate_key``) and ``cost=`` (only when not 0)."""
    kwargs: dict[str, Any] = {}
    if rate_key is not None:
        kwargs["identity"] = identity()
    if cost:
        kwargs["cost"] = cost
    return kwargs


def parse_usage(value: bytes | str) -> int | None:
    """The tokens a usage report carries, ``None`` if it is malformed."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if not 0 < len(text) <= _MAX_USAGE_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


# -- the refusal's RateLimit fields -----------------------------------------------------------


def _rate(shown: str) -> tuple[int, float]:
    """``(amount, window seconds)`` of a rate as ``RateLimit.requests`` shows it
    (``"60/min"``, ``"(5, 90)"``)."""
    shown = shown.strip()
    if shown.startswith("("):
        amount, _, seconds = shown.strip("()").partition(",")
        return int(amount), float(seconds)
    amount, _, unit = shown.partition("/")
    unit = unit.strip()
    known = _UNITS.get(unit)
    window = float(unit.rstrip("s")) if known is None else float(known)
    return int(amount.replace("_", "").strip()), window


def policies(limit: Any) -> list[tuple[str, int, int, bool]]:
    """``(name, quota, window seconds, counts tokens)`` per rate of ``limit`` (an
    :class:`admitgate.RateLimit`), its ``requests`` first, then its ``tokens``; named
    ``requests-per-min`` (prefixed with the limit's ``name`` unless it is ``"default"``)."""
    prefix = "" if limit.name == "default" else f"{limit.name}-"
    out: list[tuple[str, int, int, bool]] = []
    for meter, shown_rates in (("requests", limit.requests), ("tokens", limit.tokens)):
        for shown in shown_rates:
            amount, window = _rate(shown)
            seconds = max(1, math.ceil(window))
            unit = _UNIT_NAMES.get(seconds) if window == seconds else None
            base = f"{prefix}{meter}-per-{unit or f'{seconds}s'}"
            name, n = base, 1
            while any(name == p[0] for p in out):
                n += 1
                name = f"{base}-{n}"
            out.append((name, amount, seconds, meter == "tokens"))
    return out


def refusal_fields(exc: Any, retry_after: int | None) -> list[tuple[bytes, bytes]]:
    """The ``RateLimit-Policy`` and ``RateLimit`` headers of ``exc``, a ``rate_limited``
    refusal that names its limit; none for any other."""
    limit = getattr(exc, "rate_limit", None)
    index = getattr(exc, "rate_limit_index", None)
    if getattr(exc, "reason", None) != "rate_limited" or limit is None:
        return []
    try:
        items = policies(limit)
    except (ValueError, AttributeError):  # a rate this version cannot read: no fields
        return []
    policy = ", ".join(
        f'"{name}";q={q};w={w}' + (';qu="tokens"' if tokens else "") for name, q, w, tokens in items
    )
    fields = [(b"ratelimit-policy", policy.encode())]
    if isinstance(index, int) and 0 <= index < len(items):
        current = f'"{items[index][0]}";r=0'
        if retry_after is not None:
            current += f";t={retry_after}"
        fields.append((b"ratelimit", current.encode()))
    return fields
