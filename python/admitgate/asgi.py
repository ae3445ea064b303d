"""An admission front door for ASGI servers that speak A2A over HTTP (JSON-RPC and REST).

:class:`AdmissionMiddleware` is pure ASGI middleware (no framework import), so it wraps
Starlette, FastAPI and apps built with the A2A SDK (``a2a-sdk`` 1.x, routes from
``a2a.server.routes``). It recognises the A2A requests that start or continue agent work and
lets each run only with a slot of an :class:`admitgate.AdmissionGate`; everything else (the
agent card, UIs, custom routes, ``lifespan``, WebSocket) passes through untouched::

    app = AdmissionMiddleware(starlette_app, gate)

What is A2A, under ``path_prefix``: exactly the endpoints the SDK's routes reach, decided as
Starlette's router matches them (:mod:`admitgate._a2a_routes` holds the SDK's route table, in
its order; ``tests/test_asgi_routes.py`` checks it against the real SDK routes in a real
Starlette router). So a tenant named ``tasks`` (``POST /tasks/message:send`` is that tenant's
``SendMessage``), or ``v1``, or ``message:send``, is classified as the SDK runs it, and so is a
path with one final newline (``/message:send%0A``: Starlette's ``$`` matches before it).

- **JSON-RPC** (transport ``"jsonrpc"``): ``POST`` to ``path_prefix + jsonrpc_path`` (and to
  the same path with or without a trailing ``/``, which Starlette redirects to it: an app
  whose ``rpc_url`` differs by that slash is still gated). The middleware reads the start of
  the body (at most ``max_peek_bytes``, plus the rest of the chunk that crosses it) to learn
  ``method`` and ``id``, then replays exactly those bytes, followed by the rest of the
  stream, to the app. A body that does not end within the prefix is not buffered whole: the
  middleware stops looking, treats the request as gated work and streams the rest through
  (unless the request queued: see below).
- **REST** (HTTP+JSON binding, transport ``"rest"``): the routes of ``create_rest_routes``:
  ``/message:send``, ``/message:stream``, ``/tasks``, ``/tasks/{id}``,
  ``/tasks/{id}:cancel``, ``/tasks/{id}:subscribe``,
  ``/tasks/{id}/pushNotificationConfigs[/{config}]`` and ``/extendedAgentCard``, the same
  under the tenant mount (``/{tenant}/message:send``), and the v0.3 compatibility routes
  under ``/v1/`` (``/v1/card`` included). With a ``path_prefix`` both layouts count: the
  SDK's ``create_rest_routes(path_prefix=P)`` (``P/...`` and ``/{tenant}P/...``) and the
  routes mounted at ``P`` (``P/...`` and ``P/{tenant}/...``); a request that is work in
  either is gated. A path the router answers with 404, 405 or a redirect reaches no
  endpoint and passes.

What the client sends is read by the rules the broker runs too (``crates/classify``, through
``admitgate._admitgate.A2ARules``): the path matched against the SDK's route table, and a
JSON-RPC body read for its ``method`` and ``id`` exactly as ``json.loads(bytes)`` reads it
(UTF-8, UTF-16 or UTF-32, lone surrogates included, the last of duplicate keys winning), in
one pass with no recursion. ``tests/test_jsonrpc_reader.py`` checks the reader against
``json.loads`` and the A2A SDK's own JSON-RPC handling; ``tests/test_asgi_parsers.py``
bounds every parser on adversarial 64 KiB inputs (linear time, whatever the nesting). A body
nested deeper than :mod:`json` can follow is still read: it is classified by its ``method``
(the app cannot run work from a body it cannot parse, so this never gates less).

Which requests are gated: with ``gate_methods="work"`` (the default) those that start or
continue agent work: ``SendMessage``, ``SendStreamingMessage``, ``SubscribeToTask``, their
v0.3 names (``message/send``, ``message/stream``, ``tasks/resubscribe``) and REST routes
(``POST /message:send``, ``POST /message:stream``, ``GET|POST /tasks/{id}:subscribe``), plus
any JSON-RPC body too large to inspect. Reads and cancellations (``GetTask``, ``ListTasks``,
``CancelTask``, push-notification configs, the extended card) pass, so a saturated agent can
still be polled and told to stop. ``gate_methods="all"`` gates every A2A request, as a mesh
broker does.

A gated request holds its slot until its response body has been sent in full (an SSE stream:
the whole stream) or the app returns, whichever comes first: a slot is freed only when the
agent's work for that request has ended. A client that leaves while the app still answers
does not free it: the app is not told (``receive()`` does not return ``http.disconnect``) and
what it sends is discarded, until its response has ended or ``abandoned_response_timeout``
(60 s) has passed since the client left; then the app is told and the slot freed. So a
stream whose client left runs to its end holding its slot (the A2A SDK runs a stream's task
on after its client leaves), as the broker reads an abandoned response to its end. Work the
app runs on *after it returns* (``returnImmediately``) is bounded only by
:class:`admitgate.a2a.GatedAgentExecutor` on the same gate. A client leaving shows
only as ``receive()`` returning ``http.disconnect``, after every body chunk sent before it, so
the middleware reads a queued request's body to see it. While queued it reads up to
``max_peek_bytes`` more (kept for the app): a client that leaves then withdraws at once (it
frees its queue place, counts as ``cancelled``, never takes a slot). Past that allowance the
upload is paused by back-pressure. When the gate settles the turn, the middleware reads up to
``max_peek_bytes`` more before the turn is claimed, and a client gone by then withdraws the
same way, its granted slot handed to the next waiter. If the body has still not ended, the
rest is read before the app is called, holding the slot as the app reading it would. A client
seen to leave there frees the slot at once; the gate has already counted that turn as
admitted, although it ran nothing. So a request that queued reaches the app only with its
whole body: a truncated upload never does. The body is then held in memory, as the A2A SDK
holds it anyway. A client that stays but stops sending holds its slot for as long as it
stays, as it would in the app: bound that with the server's or a proxy's body timeout. A
request admitted on arrival streams its body to the app as it comes.

A refused request never reaches the app: it gets the HTTP status of
:data:`admitgate.REJECTION_REASONS` (429 or 503), ``Retry-After`` in whole seconds (rounded
up; omitted when there is no hint, i.e. for ``policy``), an ``admitgate-reason`` header with
the reason (as the gRPC front door's trailer) and a body the A2A SDK's client understands: for
JSON-RPC a JSON-RPC 2.0 error with the request's ``id`` and code
:data:`JSONRPC_REJECTED_CODE` (-32029), for REST the SDK's REST error shape
(``google.rpc.Status`` with ``ErrorInfo`` of domain :data:`ERROR_DOMAIN` and ``RetryInfo``).

Every HTTP request through the middleware, gated or not, costs one
``gate.record_request(transport, seconds)`` when its response ends (passthrough requests as
transport ``"passthrough"``); ``lifespan`` and WebSocket are not counted.

A gated request's turn ends as an ``async with gate.admit()`` block does: with the exception
that leaves the app while the slot is held (on a gate with
``adaptive=AdaptiveLimit(throttle_on=...)``, one of those types lowers the ceiling), which
then propagates unchanged. A response with status 500 or more holds its slot until the app
returns, since a framework answers an exception with a 500 first and re-raises it after
(Starlette's ``ServerErrorMiddleware``). The A2A SDK answers an executor's exception itself;
``GatedAgentExecutor`` on the same gate hands it to the request's turn. An app that turns a
provider 429 into its own answer sets the response header ``admitgate-throttled`` (value: the
provider's ``Retry-After`` in seconds, optional): it is reported to the turn
(``report_throttled``) and removed. Only gated requests are read for it, and the middleware's
own refusals never carry it.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from time import perf_counter
from typing import Any, Final

from ._a2a_routes import JSONRPC, PASS, READ, WORK, sdk_rules
from ._admitgate import Entered, Ready
from ._errors import AdmissionRejected
from ._frontdoor import (
    CURRENT_SLOT,
    ERROR_DOMAIN,
    ERROR_INFO_TYPE,
    GATE_METHODS,
    JSONRPC_REJECTED_CODE,
    REASON_KEY,
    THROTTLED_KEY,
    RequestSlot,
    check_abandoned_response_timeout,
    checked_session,
    header_deadline_s,
    refusal,
    throttle_hint,
    whole_seconds,
)
from ._priority_door import PriorityDoor
from ._rate_limit_door import (
    USAGE_HEADER,
    RateKey,
    admit_budget_kwargs,
    check_cost,
    parse_usage,
    refusal_fields,
)

__all__ = [
    "ERROR_DOMAIN",
    "JSONRPC_REJECTED_CODE",
    "AdmissionMiddleware",
    "ASGIApp",
    "Message",
    "Receive",
    "Scope",
    "Send",
]

Scope = MutableMapping[str, Any]
"""An ASGI connection scope."""
Message = MutableMapping[str, Any]
"""An ASGI event."""
Receive = Callable[[], Awaitable[Message]]
"""An ASGI ``receive`` callable."""
Send = Callable[[Message], Awaitable[None]]
"""An ASGI ``send`` callable."""
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
"""An ASGI 3 application."""

# JSONRPC_REJECTED_CODE and ERROR_DOMAIN are defined in ._frontdoor (the clients read them
# too) and exported from here.

_RETRY_INFO_TYPE: Final = "type.googleapis.com/google.rpc.RetryInfo"
_REASON_HEADER: Final = REASON_KEY.encode()
_THROTTLED_HEADER: Final = THROTTLED_KEY.encode()

# What a request is, as far as the gate is concerned.
_PASS: Final = PASS  # not an A2A endpoint: passthrough
_REST_READ: Final = READ  # an A2A REST request that reads, cancels or configures
_REST_WORK: Final = WORK  # an A2A REST request that starts or continues work
_JSONRPC: Final = JSONRPC  # a POST to the JSON-RPC endpoint; the body decides


class _Body:
    """The part of a gated request's body read before the app runs, kept for it: the bytes so
    far, in one buffer (so a body sent in many small chunks costs its bytes, not a message per
    chunk), and whether more follow."""

    __slots__ = ("data", "more", "_first")

    def __init__(self, message: Message) -> None:
        # The first chunk as it came (no copy: most bodies are one message, handed to the app
        # as received); a bytearray once a second chunk is added, so appending stays linear.
        self._first: Message | None = message
        self.data: bytes | bytearray = message.get("body", b"")
        self.more: bool = message.get("more_body", False)

    def add(self, message: Message) -> int:
        """Append one ``http.request`` message; returns how many bytes it brought."""
        chunk = message.get("body", b"")
        if self._first is not None:
            self._first = None
            self.data = bytearray(self.data)
        self.data += chunk
        self.more = message.get("more_body", False)
        return len(chunk)

    def message(self) -> Message:
        """The bytes so far as one ``http.request`` message, emptying the buffer (the app is
        given this first, then the rest of the stream)."""
        message = self._first
        if message is None:
            message = {"type": "http.request", "body": bytes(self.data), "more_body": self.more}
        self._first = None
        self.data = b""
        return message


async def _read_body(receive: Receive, body: _Body, limit: int | None) -> bool:
    """Read on while the body has more, until ``body`` holds ``limit`` bytes (``None``: to its
    end). False if the client left (the next ``receive()`` returned ``http.disconnect``, or
    anything else that is not a body chunk)."""
    while body.more and (limit is None or len(body.data) < limit):
        message = await receive()
        if message["type"] != "http.request":
            return False
        body.add(message)
    return True


async def _wait_unless_gone(entry: Any, receive: Receive, body: _Body, allowance: int) -> bool:
    """Wait for a queued request's slot while watching for its client leaving; False if it
    left (then the turn is withdrawn, counts as ``cancelled``, and no slot is held).

    ASGI shows a client leaving only as the next ``receive()`` returning ``http.disconnect``,
    and that ``receive()`` returns the body's next chunk first when there is one (uvicorn's
    included: it returns the body it has buffered before a disconnect it has not read yet).
    So while the body is still coming, the chunks are kept in ``body`` for the app, up to
    ``allowance`` bytes more. Past that the wait stops reading: the server stops reading the
    socket (TCP back-pressure pauses the upload) and memory stays bounded. Once the body has
    ended, the next ``receive()`` returns only on a disconnect.

    The gate's awaitable (a ``Wait``, or with a fleet limit a ``LeaseWait``) is stepped here
    as an asyncio task would step it, so that between the gate settling the turn (its future
    resolving) and the turn being claimed (the next step, which counts it ``admitted``) the
    body can be read once more, up to ``allowance`` bytes, if it has not ended: a client that
    left during the pause shows here, and withdrawing now (``close()``) hands the granted slot
    to the next waiter and counts the turn as ``cancelled``. That is what happened: the turn
    never started, its client withdrew, exactly as one that leaves while queued; counting it
    ``admitted`` would report agent work that never ran. The read is bounded because the
    settled future does not say whether the turn was granted or refused, and a refused turn's
    body must not be buffered without bound. A refusal is therefore answered only after that
    read (at most ``allowance`` bytes of a client that is sending).
    """
    steps = entry.__await__()
    thrown: BaseException | None = None
    watcher: asyncio.Future[Message] | None = None
    budget = allowance
    try:
        while True:
            # One step: the gate claims the outcome (StopIteration: admitted; AdmissionRejected:
            # refused) or hands the next future to wait for (the slot, then a fleet lease).
            try:
                fut = next(steps) if thrown is None else steps.throw(thrown)
            except StopIteration:
                return True
            thrown = None
            while not fut.done():
                if body.more and budget <= 0:  # paused: the body waits in the socket
                    await asyncio.wait((fut,))
                    break
                watcher = asyncio.ensure_future(receive())
                await asyncio.wait((fut, watcher), return_when=asyncio.FIRST_COMPLETED)
                if not watcher.done():
                    watcher.cancel()
                    watcher = None
                    break
                message = watcher.result()
                watcher = None
                if message["type"] != "http.request":
                    steps.close()  # withdraw: counted cancelled, never takes a slot
                    return False
                budget -= body.add(message)
            if body.more and not await _read_body(receive, body, len(body.data) + allowance):
                steps.close()  # left during the pause: a granted slot is handed on
                return False
            # As a task does: the future's exception (a fleet refusal), or its cancellation (a
            # deadline), is thrown into the awaitable, which turns it into the refusal.
            if fut.cancelled():
                thrown = asyncio.CancelledError()
            else:
                thrown = fut.exception()
    except BaseException:
        # Cancelled from outside (or a step failed): withdraw, handing on a granted slot.
        if watcher is not None:
            watcher.cancel()
        steps.close()
        raise


def _take_throttle_header(message: Message, slot: RequestSlot) -> Message:
    """``message`` (an ``http.response.start``) without :data:`THROTTLED_KEY`, reported to
    ``slot`` if the app set it."""
    headers = message.get("headers") or ()
    for name, value in headers:
        if name.lower() == _THROTTLED_HEADER:
            slot.report_throttled(throttle_hint(value))
            kept = [(n, v) for n, v in headers if n.lower() != _THROTTLED_HEADER]
            return {**message, "headers": kept}
    return message


def _strip_usage(headers: Any) -> tuple[list[Any], bytes | None]:
    """``headers`` without the usage report, and its value (the last one given, if any)."""
    value = None
    kept = []
    for name, v in headers:
        if name.lower() == USAGE_HEADER:
            value = v if value is None else b"x"  # given twice: malformed
        else:
            kept.append((name, v))
    return kept, value


def _check_retry_after(retry_after: object) -> float | None:
    if retry_after is None:
        return None
    if (
        isinstance(retry_after, bool)
        or not isinstance(retry_after, int | float)
        or not math.isfinite(retry_after)
        or retry_after < 0
    ):
        raise ValueError(
            f"retry_after must be None or a finite number of seconds >= 0, got {retry_after!r}"
        )
    return float(retry_after)


def _check_path(name: str, value: object, *, allow_empty: bool) -> str:
    if not isinstance(value, str) or (
        not (allow_empty and value == "") and not value.startswith("/")
    ):
        expected = '"" or a path starting with "/"' if allow_empty else 'a path starting with "/"'
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


class AdmissionMiddleware:
    """ASGI middleware that admits A2A requests through an :class:`admitgate.AdmissionGate`.

    Args:
        app: the ASGI 3 application to protect (for example the Starlette app holding the
            A2A SDK's routes).
        gate: the gate every gated request passes (``gate.admit(session_id=...,
            transport="jsonrpc" | "rest")``); it also receives one ``record_request`` per
            HTTP request.
        path_prefix: where the A2A routes live (``""``: at the root). The JSON-RPC endpoint
            is ``path_prefix + jsonrpc_path``; REST routes are matched below the prefix (and
            as ``/{tenant}<prefix>/...``, the SDK's layout). A trailing ``/`` is ignored.
        jsonrpc_path: the JSON-RPC endpoint below ``path_prefix`` (``"/"``, the SDK's
            default ``rpc_url``), or ``None`` when the app serves no JSON-RPC.
        gate_methods: ``"work"`` gates only requests that start or continue agent work;
            ``"all"`` gates every A2A request.
        session_id: ``callable(scope) -> str`` giving the tenant key (per-tenant limits);
            ``None``: no tenant (``""``). Called once per gated request; what it raises
            propagates. Derive it from something the client cannot choose freely (an
            authenticated identity), or one client can spread its load over many tenants.
        priority: where a gated request's priority class comes from, on a gate built with
            ``priorities=[...]``: ``"header:NAME"`` (a request header, e.g.
            ``"header:x-priority"``) or a ``callable(scope) -> str | None``; ``None``: every
            request in the gate's default class. A missing, empty or unknown class goes to
            the default class and is counted (``<prefix>_priority_defaulted_total``), never
            refused. Refusals name the class (``data.priority`` / ``metadata.priority``).
        retry_after: seconds to advertise in ``Retry-After`` on every refusal; ``None`` uses
            the gate's hint (``AdmissionRejected.retry_after``), and sends no header when
            the gate has none.
        max_peek_bytes: how much of a JSON-RPC body is read before admission to learn its
            method and ``id``; also how much more of a queued request's body is read (and
            kept) while it waits, and again when the gate settles it, to see its client leave.
        abandoned_response_timeout: how long after a gated request's client left the app is
            kept unaware (its sends discarded, the slot held) while it still answers; then it
            is told (``http.disconnect``) and the slot freed. ``0``: told at once, the slot
            freed as the client leaves.
        rate_key: for a gate with ``rate_limit=``: whose budget a gated request spends, the
            first source it carries of ``header:NAME`` and ``tenant`` (``session_id``'s
            tenant), joined by ``|``, e.g. ``"header:x-api-key|header:authorization"``; a
            request with none spends one anonymous budget. Passed as ``gate.admit(identity=)``,
            hashed by the gate, never logged. ``None``: the gate's own key (the tenant).
            A ``rate_limited`` refusal carries ``RateLimit-Policy`` and ``RateLimit``
            (draft-ietf-httpapi-ratelimit-headers-11).
        cost: the tokens each gated request reserves (``gate.admit(cost=)``; 0, the
            default, passes none, so a gate with ``estimator=`` estimates it), settled to the
            app's usage report: an ``admitgate-usage-tokens`` response header (or trailer),
            which is removed before the client (a malformed one is ignored, counted in
            :attr:`usage_reports`, and removed too).

    Raises:
        TypeError: ``app``, ``gate``, ``session_id`` or ``priority`` is not what it should be.
        ValueError: a path, ``gate_methods``, ``priority``, ``retry_after``, ``max_peek_bytes``,
            ``abandoned_response_timeout``, ``rate_key`` or ``cost`` is out of range
            (``priority`` on a gate without classes too).
    """

    def __init__(
        self,
        app: ASGIApp,
        gate: Any,
        *,
        path_prefix: str = "",
        jsonrpc_path: str | None = "/",
        gate_methods: str = "work",
        session_id: Callable[[Scope], str] | None = None,
        priority: str | Callable[[Scope], str | None] | None = None,
        retry_after: float | None = None,
        max_peek_bytes: int = 65536,
        abandoned_response_timeout: float = 60.0,
        rate_key: str | None = None,
        cost: int = 0,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be an ASGI application (a callable), got {app!r}")
        if not callable(getattr(gate, "admit", None)) or not callable(
            getattr(gate, "record_request", None)
        ):
            raise TypeError(
                f"gate must be an admitgate.AdmissionGate (with admit and record_request), "
                f"got {gate!r}"
            )
        prefix = _check_path("path_prefix", path_prefix, allow_empty=True).rstrip("/")
        if jsonrpc_path is not None:
            _check_path("jsonrpc_path", jsonrpc_path, allow_empty=False)
        if gate_methods not in GATE_METHODS:
            raise ValueError(f'gate_methods must be "work" or "all", got {gate_methods!r}')
        if session_id is not None and not callable(session_id):
            raise TypeError(
                f"session_id must be None or a callable(scope) -> str, got {session_id!r}"
            )
        if (
            isinstance(max_peek_bytes, bool)
            or not isinstance(max_peek_bytes, int)
            or not 1 <= max_peek_bytes <= 2**31 - 1
        ):
            raise ValueError(
                f"max_peek_bytes must be an integer in 1..2147483647, got {max_peek_bytes!r}"
            )
        self.app = app
        self.gate = gate
        self.path_prefix = prefix
        self.jsonrpc_path = jsonrpc_path
        self.gate_methods = gate_methods
        self.session_id = session_id
        self.priority = priority
        self._priority = None if priority is None else PriorityDoor(gate, priority)
        self.retry_after = _check_retry_after(retry_after)
        self.max_peek_bytes = max_peek_bytes
        self.abandoned_response_timeout = check_abandoned_response_timeout(
            abandoned_response_timeout
        )
        self.rate_key = None if rate_key is None else RateKey(rate_key)
        if self.rate_key is not None and self.rate_key.uses_tenant and session_id is None:
            raise ValueError(
                f"rate_key={rate_key!r} reads the tenant: it needs session_id (the tenant)"
            )
        self.cost = check_cost(cost)
        self.usage_reports = {"reported": 0, "malformed": 0}
        """Usage reports (``admitgate-usage-tokens``) seen in responses: ``reported`` (handed
        to the turn, or to nothing on a request that holds no slot) and ``malformed``
        (ignored); every one is removed before the client."""
        self._gate_all = gate_methods == "all"
        self._rules = sdk_rules(
            prefix, jsonrpc_path, gate_all=self._gate_all, max_peek_bytes=max_peek_bytes
        )

    # -- classification --------------------------------------------------------------------

    def _classify(self, method: str, path: str, root_path: str) -> int:
        """What ``method path`` reaches, as the A2A SDK's routes below ``root_path`` route it."""
        return self._rules.kind(method, path, root_path)

    def _inspect(self, kind: int, body: bytes | bytearray, more: bool) -> tuple[bool, object]:
        """``(gated, rpc_id)`` of a request from the start of its ``body`` (``more``: it does
        not end there): whether it takes a slot, and the JSON-RPC ``id`` a refusal carries."""
        if kind == _JSONRPC:
            return self._rules.jsonrpc(body, not more)
        return True, None

    # -- the ASGI entry point --------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one ASGI connection: gate A2A requests, pass everything else through."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = perf_counter()
        kind = self._classify(scope["method"], scope["path"], scope.get("root_path", ""))
        if kind == _PASS or (kind == _REST_READ and not self._gate_all):
            end = 0.0

            async def timed_send(message: Message) -> None:
                nonlocal end
                await send(self._take_usage(message, None))
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    end = perf_counter()

            try:
                await self.app(scope, receive, timed_send)
            finally:
                self.gate.record_request(
                    "passthrough" if kind == _PASS else "rest", (end or perf_counter()) - start
                )
            return
        await self._gated(scope, receive, send, kind, start)

    async def _gated(
        self, scope: Scope, receive: Receive, send: Send, kind: int, start: float
    ) -> None:
        """Peek at the body, then run the request with a slot, refuse it, or (a JSON-RPC read)
        run it without one. Records the request once, whatever happens."""
        transport = "jsonrpc" if kind == _JSONRPC else "rest"
        end = 0.0
        slot: RequestSlot | None = None
        token: contextvars.Token[RequestSlot | None] | None = None
        try:
            # Read the start of the body before taking a slot: JSON-RPC needs it to know the
            # method, and a client that uploads slowly (or leaves) holds no slot meanwhile.
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending a body
                return
            held = _Body(message)
            if held.more and not await _read_body(receive, held, self.max_peek_bytes):
                return
            gated, rpc_id = self._inspect(kind, held.data, held.more)
            if not gated:
                first: Message | None = held.message()

                async def replay() -> Message:
                    nonlocal first
                    if first is not None:
                        message, first = first, None
                        return message
                    return await receive()

                async def timed_send(message: Message) -> None:
                    nonlocal end
                    await send(self._take_usage(message, None))
                    if message["type"] == "http.response.body" and not message.get("more_body"):
                        end = perf_counter()

                await self.app(scope, replay, timed_send)
                return

            session = (
                "" if self.session_id is None else checked_session(self.session_id(scope), "scope")
            )
            rate_key = self.rate_key
            admission = self.gate.admit(
                session_id=session,
                transport=transport,
                deadline_s=header_deadline_s(scope["headers"]),
                **admit_budget_kwargs(
                    rate_key,
                    self.cost,
                    lambda: rate_key.identity_of_headers(scope["headers"], session),  # type: ignore[union-attr]
                ),
                priority=None if self._priority is None else self._priority.from_scope(scope),
            )
            try:
                entry = admission.__aenter__()
                if type(entry) is Ready or type(entry) is Entered:
                    await entry
                    waited = False
                elif await _wait_unless_gone(entry, receive, held, self.max_peek_bytes):
                    waited = True
                else:
                    return
            except AdmissionRejected as exc:
                await self._refuse(send, transport, exc, rpc_id)
                end = perf_counter()
                return

            slot = RequestSlot(self.gate, admission)
            request_slot = slot
            if waited and held.more and not await _read_body(receive, held, None):
                # A request that queued reaches the app only with its whole body: its client
                # may have left during the pause with more than the read at admission could
                # drain (uvicorn shows the disconnect only after every byte sent before it),
                # and the app must never run a truncated upload. Reading it here holds the
                # slot exactly as the app reading it would (the A2A SDK reads a body whole
                # before it acts). A client gone here is seen only after the turn was counted
                # admitted (the gate cannot take that back): its slot is freed now, and the
                # app never runs.
                return
            first = held.message()
            response_ended = asyncio.Event()
            client_left = False

            async def gated_receive() -> Message:
                nonlocal first, client_left
                if first is not None:
                    message, first = first, None
                    return message
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not response_ended.is_set() and self.abandoned_response_timeout > 0:
                        # The client left while the app still answers, and the agent may
                        # still work for it (the A2A SDK runs a stream's task on after its
                        # client left, and sse-starlette ends the response at this message):
                        # the app is not told until its response has ended (what it sends is
                        # discarded) or the timeout passes, so the slot stays held until the
                        # work ends. The cap counts work at the agent, not clients waiting.
                        client_left = True
                        try:
                            await asyncio.wait_for(
                                response_ended.wait(), self.abandoned_response_timeout
                            )
                        except asyncio.TimeoutError:
                            pass
                    await request_slot.end_request()
                return message

            status = 0

            trailers = False

            async def gated_send(message: Message) -> None:
                nonlocal end, status, trailers
                if message["type"] == "http.response.start":
                    status = message["status"]
                    trailers = bool(message.get("trailers"))
                    message = _take_throttle_header(message, request_slot)
                message = self._take_usage(message, request_slot)
                try:
                    if not client_left:
                        await send(message)
                finally:
                    # A response that announced trailers ends with its last trailers (they may
                    # carry the usage report), else with its last body chunk.
                    if (
                        message["type"] == "http.response.trailers"
                        and not message.get("more_trailers")
                    ) or (
                        not trailers
                        and message["type"] == "http.response.body"
                        and not message.get("more_body")
                    ):
                        response_ended.set()
                        end = perf_counter()
                        # An error answer's slot is held until the app returns: a framework
                        # that turns an exception into a 500 sends it first, then re-raises
                        # (Starlette's ServerErrorMiddleware), and the turn ends with it.
                        if status < 500:
                            await request_slot.end_request()

            token = CURRENT_SLOT.set(slot)
            try:
                await self.app(scope, gated_receive, gated_send)
            except BaseException as exc:
                # As `async with gate.admit()` sees it: a throttle_on type is a 429 signal.
                slot.saw(exc)
                raise
        finally:
            if token is not None:
                CURRENT_SLOT.reset(token)
            if slot is not None:
                await slot.end_request()
            self.gate.record_request(transport, (end or perf_counter()) - start)

    def _take_usage(self, message: Message, slot: RequestSlot | None) -> Message:
        """``message`` without the agent's usage report (a response header or trailer), which
        is reported to ``slot``'s turn; malformed, it is ignored and counted."""
        kind = message["type"]
        if kind != "http.response.start" and kind != "http.response.trailers":
            return message
        headers = message.get("headers") or ()
        if not any(name.lower() == USAGE_HEADER for name, _ in headers):
            return message
        kept, value = _strip_usage(headers)
        tokens = None if value is None else parse_usage(value)
        if tokens is None:
            self.usage_reports["malformed"] += 1
        else:
            self.usage_reports["reported"] += 1
            if slot is not None:
                slot.report_usage(tokens)
        return {**message, "headers": kept}

    async def _refuse(
        self, send: Send, transport: str, exc: AdmissionRejected, rpc_id: object
    ) -> None:
        reason, status, grpc_status, hint = refusal(exc, self.retry_after)
        seconds = None if hint is None else whole_seconds(hint)
        if transport == "jsonrpc":
            payload: dict[str, Any] = {
                "jsonrpc": "2.0",
                "id": rpc_id,
                "error": {
                    "code": JSONRPC_REJECTED_CODE,
                    "message": exc.message,
                    "data": {"reason": reason, "retryAfter": seconds},
                },
            }
            if exc.priority is not None:
                payload["error"]["data"]["priority"] = exc.priority
        else:
            metadata = {"reason": reason}
            details: list[dict[str, Any]] = [
                {
                    "@type": ERROR_INFO_TYPE,
                    "reason": reason.upper(),
                    "domain": ERROR_DOMAIN,
                    "metadata": metadata,
                }
            ]
            if seconds is not None:
                metadata["retryAfter"] = str(seconds)
                details.append({"@type": _RETRY_INFO_TYPE, "retryDelay": f"{seconds}s"})
            if exc.priority is not None:
                metadata["priority"] = exc.priority
            payload = {
                "error": {
                    "code": status,
                    "status": grpc_status,
                    "message": exc.message,
                    "details": details,
                }
            }
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (_REASON_HEADER, reason.encode()),
        ]
        if seconds is not None:
            headers.append((b"retry-after", str(seconds).encode()))
        headers += refusal_fields(exc, seconds)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
