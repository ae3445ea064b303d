"""Clients that honour a refusal's retry hint: an ``httpx`` transport that retries 429 and 503.

The A2A SDK's client throws ``Retry-After`` away. Plug :class:`RetryingTransport` into the
``httpx.AsyncClient`` it uses and a refused request is sent again after the delay the server
asked for::

    import httpx
    from a2a.client import ClientConfig, create_client
    from admitgate.client import RetryingTransport

    http = httpx.AsyncClient(transport=RetryingTransport(), timeout=30)
    client = await create_client(url, client_config=ClientConfig(httpx_client=http))

A 429 or 503 is retried only when it says when (``Retry-After``, in ASCII digits of seconds
or as an HTTP date with a zone; a refusal without a usable hint, such as ``"²"``, ``"1e3"``,
``"-1"`` or a date out of range, is returned as is), when its body can be sent again (no body,
or bytes: not a streaming upload), and when sending the request again is safe:

- its method is idempotent (``GET``, ``HEAD``, ``OPTIONS``, ``PUT``, ``DELETE``, ``TRACE``);
- or the response is a refusal by :class:`admitgate.asgi.AdmissionMiddleware`, which never
  lets a refused request reach the agent, so even an A2A ``SendMessage`` is safe to repeat.
  It is recognised by its ``admitgate-reason`` header or, should a proxy drop that, by its
  body: a JSON-RPC error with code :data:`admitgate.asgi.JSONRPC_REJECTED_CODE` (-32029), or
  a REST error whose ``google.rpc.ErrorInfo`` has domain :data:`admitgate.asgi.ERROR_DOMAIN`
  (``"admitgate"``). Only small bodies (a ``Content-Length`` of at most 16 KiB) are read.

Three limits keep retries from becoming a storm: ``max_retries`` per request, a
``deadline_s`` after the first attempt past which no retry starts (a delay that would end
later is not waited for: the refusal is returned at once), and a retry budget shared by all
requests through the transport (``retry_budget`` retries per request on average, with a
reserve of ``budget_reserve`` for quiet periods), so a saturated server sees at most that
much extra traffic. The delay is the response's ``Retry-After``, stretched by a random factor
in ``[1, 1 + jitter]`` (never shortened).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from email.utils import parsedate_to_datetime
from typing import Any, Final

import anyio
import httpx

from ._frontdoor import ERROR_DOMAIN, ERROR_INFO_TYPE, JSONRPC_REJECTED_CODE, REASON_KEY

__all__ = ["RetryingTransport", "is_admission_refusal"]

logger = logging.getLogger("admitgate")

_RETRY_STATUSES: Final = frozenset({429, 503})
_IDEMPOTENT: Final = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
_MAX_INSPECTED_BODY: Final = 16 * 1024
# No valid Retry-After is longer (an HTTP date is 29 characters): a longer one is not parsed.
_MAX_RETRY_AFTER_CHARS: Final = 64


def _number(name: str, value: object, *, low: float, high: float = math.inf) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        bound = f"in [{low}, {high}]" if math.isfinite(high) else f">= {low}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


def _ascii_digits(text: str, max_digits: int) -> int | None:
    """``text`` as a whole number if it is 1 to ``max_digits`` ASCII digits, else None.

    ``str.isdigit`` alone accepts ``"²"`` and ``"٣"`` (which ``int`` and ``float`` refuse or
    read differently), and ``int`` refuses more than 4300 digits; both come from the server.
    """
    if not (0 < len(text) <= max_digits and text.isascii() and text.isdigit()):
        return None
    return int(text)


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds from the ``Retry-After`` header (delta-seconds or HTTP date), if usable.

    Anything else (unicode digits, signs, exponents, huge numbers, dates without a zone or
    out of range, a value longer than any valid one) is no hint: ``None``. Bounded work for
    any header: a longer value is refused before it is parsed.
    """
    value = response.headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if len(value) > _MAX_RETRY_AFTER_CHARS:
        return None
    seconds = _ascii_digits(value, _MAX_RETRY_AFTER_CHARS)
    if seconds is not None:
        return float(seconds)
    try:
        when = parsedate_to_datetime(value)
        delay = when.timestamp() - time.time() if when.tzinfo is not None else None
    except (TypeError, ValueError, OverflowError, IndexError):
        return None
    return None if delay is None or not math.isfinite(delay) else max(0.0, delay)


def is_admission_refusal(payload: Any) -> bool:
    """Whether a decoded response body is a refusal by :mod:`admitgate.asgi` (JSON-RPC error
    code -32029, or a REST error with an ``ErrorInfo`` of domain ``"admitgate"``)."""
    if not isinstance(payload, dict):
        return False
    error = payload.get("error")
    if not isinstance(error, dict):
        return False
    if payload.get("jsonrpc") == "2.0":
        code = error.get("code")
        return type(code) is int and code == JSONRPC_REJECTED_CODE
    details = error.get("details")
    if not isinstance(details, list):
        return False
    return any(
        isinstance(d, dict)
        and d.get("@type") == ERROR_INFO_TYPE
        and d.get("domain") == ERROR_DOMAIN
        for d in details
    )


class RetryingTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` async transport that retries refused requests after their ``Retry-After``.

    Args:
        wrapped: the transport that sends the requests; ``None``: a new
            ``httpx.AsyncHTTPTransport()``. Closed with this one.
        max_retries: retries per request after the first attempt (0 disables retrying).
        retry_budget: retries allowed per request on average, across all requests through
            this transport (``0.2``: at most 20% extra traffic once the reserve is spent);
            ``None``: no budget.
        budget_reserve: retries available at start and the most the budget accumulates, so
            an occasional refusal is retried however little traffic came before.
        deadline_s: no retry starts later than this many seconds after the first attempt.
        jitter: each delay is multiplied by a random factor in ``[1, 1 + jitter]``, so
            clients refused together do not come back together.

    Raises:
        TypeError: ``wrapped`` is not an ``httpx.AsyncBaseTransport``.
        ValueError: a number is out of range.
    """

    def __init__(
        self,
        wrapped: httpx.AsyncBaseTransport | None = None,
        *,
        max_retries: int = 3,
        retry_budget: float | None = 0.2,
        budget_reserve: int = 10,
        deadline_s: float = 30.0,
        jitter: float = 0.2,
    ) -> None:
        if wrapped is not None and not isinstance(wrapped, httpx.AsyncBaseTransport):
            raise TypeError(f"wrapped must be None or an httpx.AsyncBaseTransport, got {wrapped!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        if retry_budget is not None:
            retry_budget = _number("retry_budget", retry_budget, low=0.0)
        if (
            isinstance(budget_reserve, bool)
            or not isinstance(budget_reserve, int)
            or budget_reserve < 0
        ):
            raise ValueError(f"budget_reserve must be an integer >= 0, got {budget_reserve!r}")
        self._deadline = _number("deadline_s", deadline_s, low=0.0)
        self._jitter = _number("jitter", jitter, low=0.0, high=10.0)
        self._wrapped = wrapped if wrapped is not None else httpx.AsyncHTTPTransport()
        self._max_retries = max_retries
        self._ratio = retry_budget
        self._reserve = float(budget_reserve)
        self._tokens = float(budget_reserve)
        self._random = random.Random()
        self.retries = 0
        """Retries sent so far (all requests)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``, and again after each retryable refusal while the limits allow."""
        if self._ratio is not None:
            self._tokens = min(self._reserve, self._tokens + self._ratio)
        started = time.monotonic()
        attempt = 0
        while True:
            response = await self._wrapped.handle_async_request(request)
            if response.status_code not in _RETRY_STATUSES or attempt >= self._max_retries:
                return response
            if not isinstance(request.stream, httpx.ByteStream):
                return response  # a streaming upload cannot be sent again
            hint = _retry_after(response)
            if hint is None:
                return response
            if request.method not in _IDEMPOTENT and REASON_KEY not in response.headers:
                response, refusal = await self._inspect(request, response)
                if not refusal:
                    return response
            delay = hint * (1.0 + self._random.uniform(0.0, self._jitter))
            if time.monotonic() + delay - started > self._deadline:
                return response
            if self._ratio is not None:
                if self._tokens < 1.0:
                    return response
                self._tokens -= 1.0
            await response.aclose()
            attempt += 1
            self.retries += 1
            logger.debug(
                "%s %s refused with %d; retry %d in %.2f s",
                request.method,
                request.url,
                response.status_code,
                attempt,
                delay,
            )
            await anyio.sleep(delay)

    @staticmethod
    async def _inspect(
        request: httpx.Request, response: httpx.Response
    ) -> tuple[httpx.Response, bool]:
        """Read a small refusal body; returns a readable copy and whether admitgate sent it."""
        length = _ascii_digits(response.headers.get("content-length", ""), 9)
        if length is None or length > _MAX_INSPECTED_BODY:
            return response, False
        try:
            raw = b"".join([chunk async for chunk in response.aiter_raw()])
        finally:
            await response.aclose()
        copy = httpx.Response(
            response.status_code,
            headers=response.headers,
            content=raw,
            request=request,
            extensions=response.extensions,
        )
        try:
            payload = json.loads(copy.content)
        except (ValueError, RecursionError):  # 16 KiB of "[" is enough to reach the limit
            return copy, False
        return copy, is_admission_refusal(payload)

    async def aclose(self) -> None:
        """Close the wrapped transport."""
        await self._wrapped.aclose()
