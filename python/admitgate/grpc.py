"""The A2A front door for ``grpc.aio`` servers, and a client that honours its retry hint.

:class:`AdmissionInterceptor` is a server interceptor that puts an admitgate gate in front of
the A2A gRPC service (``lf.a2a.v1.A2AService``, and the v0.3 ``a2a.v1.A2AService`` that the
A2A SDK still serves): a call that starts or continues agent work takes a slot, with transport
label ``"grpc"``, and holds it until the call ends; a call the gate refuses ends at once with
the status from :data:`admitgate.REJECTION_REASONS` (``RESOURCE_EXHAUSTED`` or
``UNAVAILABLE``), the standard ``grpc-retry-pushback-ms`` trailer and the reason in the
``admitgate-reason`` trailer. Everything else (health checking, reflection, your own services)
passes through ungated and is only counted.

:class:`RetryPushbackInterceptor` and :class:`RetryPushbackStreamInterceptor` are the client
half: ``grpc.aio`` client interceptors that retry a call this front door refused, after the
delay the server asked for.

    server = grpc.aio.server(interceptors=[AdmissionInterceptor(gate)])
    channel = grpc.aio.insecure_channel(target, interceptors=retry_pushback_interceptors())

Needs ``grpcio`` (``pip install admitgate[grpc]``).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import aclosing
from typing import Any, Literal

import grpc
import grpc.aio

from ._errors import AdmissionRejected
from ._frontdoor import (
    A2A_WORK_METHODS,
    CURRENT_SLOT,
    ERROR_DOMAIN,
    GATE_METHODS,
    PRIORITY_KEY,
    REASON_KEY,
    THROTTLED_KEY,
    Refusal,
    RequestSlot,
    check_abandoned_response_timeout,
    check_gate,
    checked_session,
    refusal,
    throttle_hint,
    whole_ms,
)
from ._priority_door import PriorityDoor
from ._rate_limit_door import USAGE_KEY, RateKey, admit_budget_kwargs, check_cost, parse_usage

try:  # google.rpc ships with googleapis-common-protos (a dependency of a2a-sdk and grpcio-status)
    from google.protobuf import any_pb2, duration_pb2  # type: ignore[import-untyped]
    from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - only without googleapis-common-protos
    _RICH_STATUS = False
else:
    _RICH_STATUS = True

__all__ = [
    "A2A_SERVICES",
    "PUSHBACK_TRAILER",
    "REASON_TRAILER",
    "THROTTLED_TRAILER",
    "WORK_METHODS",
    "AdmissionInterceptor",
    "RetryPushbackInterceptor",
    "RetryPushbackStreamInterceptor",
    "retry_pushback_interceptors",
    "session_from_metadata",
]

#: The A2A gRPC services: the current protocol's and the v0.3 one the SDK keeps serving.
A2A_SERVICES: frozenset[str] = frozenset({"lf.a2a.v1.A2AService", "a2a.v1.A2AService"})

#: The A2A methods that start or continue agent work: gated by default (``gate_methods="work"``).
#: Reads (``GetTask``, ``ListTasks``, the agent card), ``CancelTask`` and the push-notification
#: configuration calls pass, so a saturated agent can still be polled and told to stop.
#: They are ``SendMessage``, ``SendStreamingMessage`` and ``SubscribeToTask`` (the same as over
#: HTTP), which the v0.3 service names ``TaskSubscription``.
WORK_METHODS: frozenset[str] = frozenset(
    {
        *(f"/lf.a2a.v1.A2AService/{name}" for name in A2A_WORK_METHODS),
        "/a2a.v1.A2AService/SendMessage",
        "/a2a.v1.A2AService/SendStreamingMessage",
        "/a2a.v1.A2AService/TaskSubscription",
    }
)

#: The standard trailer (gRPC's retry design, A6) carrying the delay before a retry, in whole
#: milliseconds.
PUSHBACK_TRAILER = "grpc-retry-pushback-ms"

#: The trailer carrying the gate's reason (``queue_full``, ``shed``, ``memory_pressure``...);
#: its presence marks a refusal by this front door, which never reached the agent.
REASON_TRAILER = REASON_KEY

#: The trailing metadata key a servicer sets on a gated call whose provider call was throttled
#: (value: the provider's ``Retry-After`` in seconds, or anything else for none): reported to
#: the call's turn as ``turn.report_throttled()`` and removed before the trailers are sent.
THROTTLED_TRAILER = THROTTLED_KEY

#: The transport label of gated calls, and the label of calls that pass ungated.
TRANSPORT = "grpc"
PASSTHROUGH = "passthrough"

# Status codes a refusal by this front door can carry, and so the only ones retried.
_REFUSAL_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})

SessionId = Callable[[grpc.HandlerCallDetails], object]

# The longest grpc-retry-pushback-ms value read as a delay (10^12 ms is 31 years).
_MAX_PUSHBACK_DIGITS = 12

# Wrapped handlers are kept for this many distinct methods (a server serves a fixed set).
_MAX_CACHED_METHODS = 1024


class _CallDetails(grpc.HandlerCallDetails):
    """The ``grpc.HandlerCallDetails`` a ``session_id`` callable receives."""

    __slots__ = ("method", "invocation_metadata")
    method: str
    invocation_metadata: Any

    def __init__(self, method: str, invocation_metadata: Any) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


def session_from_metadata(key: str, *, default: str = "") -> SessionId:
    """A ``session_id=`` callable for :class:`AdmissionInterceptor` that reads the tenant from
    one request metadata entry (first value; ``default`` when absent).

    ``key`` is a metadata key (lowercase ASCII letters, digits, ``-``, ``_``, ``.``; not
    ending in ``-bin``). The client chooses its metadata: key on a value it cannot forge (one
    your authentication layer sets or checks), or a client can spread its load over as many
    tenants as it likes.
    """
    if not isinstance(key, str) or not key or key != key.lower() or key.endswith("-bin"):
        raise ValueError(
            f"key must be a non-empty lowercase gRPC metadata key not ending in -bin, got {key!r}"
        )
    if any(not (c.isascii() and (c.isalnum() or c in "-_.")) for c in key):
        raise ValueError(f"key must contain only a-z, 0-9, '-', '_' and '.', got {key!r}")
    if not isinstance(default, str):
        raise TypeError(f"default must be a str, got {default!r}")

    def session_id(details: grpc.HandlerCallDetails) -> str:
        for entry in details.invocation_metadata or ():
            if entry[0] == key:
                value = entry[1]
                return value if isinstance(value, str) else value.decode("utf-8", "replace")
        return default

    session_id.__doc__ = f"The tenant from request metadata {key!r} ({default!r} when absent)."
    return session_id


def _seconds_or_none(name: str, value: object) -> float | None:
    """``value`` as a float if it is ``None`` or a finite number of seconds > 0."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number of seconds > 0 or None, got {value!r}")
    return float(value)


class AdmissionInterceptor(grpc.aio.ServerInterceptor):
    """A ``grpc.aio`` server interceptor that admits A2A calls through an admitgate gate.

    ``gate`` is an :class:`admitgate.AdmissionGate`. ``gate_methods`` picks the gated A2A
    methods: ``"work"`` (default: :data:`WORK_METHODS`, the calls that start or continue agent
    work) or ``"all"`` (every method of the A2A services, the mesh broker's behaviour). Calls to
    any other service (``grpc.health.v1``, reflection, your own) are never gated.

    ``session_id`` tells the tenant of a call for the gate's per-tenant limit: a callable that
    receives the call's ``grpc.HandlerCallDetails`` (``.method``, ``.invocation_metadata``)
    and returns a str, ``""`` for none (see :func:`session_from_metadata`); default: every call
    is ``""`` (the global ceiling only). It runs once per gated call, on the event loop, before
    admission; an exception it raises, or a value that is not a str (``TypeError``), fails the
    call (``UNKNOWN``) without touching the gate.

    ``priority`` says where a gated call's priority class comes from, on a gate built with
    ``priorities=[...]``: ``"metadata:KEY"`` (a request metadata key, e.g.
    ``"metadata:x-priority"``; ``"header:KEY"`` is the same) or a callable given the call's
    ``grpc.HandlerCallDetails`` that returns a class name or ``None``; default: every call in
    the gate's default class. A missing, empty or unknown class goes to the default class and
    is counted (``<prefix>_priority_defaulted_total``), never refused. A refusal names the
    class in the ``admitgate-priority`` trailer and the ``ErrorInfo`` metadata.

    ``retry_after`` fixes the delay (seconds, > 0) sent in ``grpc-retry-pushback-ms`` on a
    refusal; default: the gate's own hint (``AdmissionRejected.retry_after``), and no
    pushback trailer when it has none (reason ``policy``).

    For a gate with ``rate_limit=``: ``rate_key`` says whose budget a gated call spends, the
    first source it carries of ``metadata:KEY`` (request metadata, first value) and
    ``tenant`` (``session_id``'s tenant), joined by ``|``, e.g.
    ``"metadata:x-api-key|metadata:authorization"``; a call with none spends one anonymous
    budget (passed as ``gate.admit(identity=)``, hashed by the gate, never logged; ``None``:
    the gate's own key). A ``rate_limited`` refusal is ``RESOURCE_EXHAUSTED`` with the exact
    retry time in ``grpc-retry-pushback-ms``. ``cost`` is the tokens each gated call reserves
    (``gate.admit(cost=)``; 0, the default, passes none, so a gate with ``estimator=``
    estimates it), settled to the servicer's ``admitgate-usage-tokens`` trailing
    metadata, which is removed before the client (a malformed value is ignored, counted in
    :attr:`usage_reports`, and removed too).

    A gated call holds its slot until it ends: a unary call until its response is ready, a
    streaming call until its handler has sent its last message or failed. A slot is freed
    only when the agent's work for the call has ended: a streaming call the client cancels
    keeps its slot while its handler still runs (the A2A SDK's would otherwise hand the
    task to a background consumer and the agent would work on unbounded), and so does a
    unary one. The handler runs on a task of its own, so the cancellation does not reach it;
    what it answers is discarded until it ends or ``abandoned_response_timeout`` (seconds,
    default 60, as the broker's flag) passes, then it is cancelled and the slot freed
    (``0``: at once).
    A :class:`admitgate.a2a.GatedAgentExecutor` on the same gate, running the call's work,
    takes over the call's slot instead of a second one (as behind the HTTP middleware): the
    slot is released when both the call and ``execute`` are done, so ``returnImmediately`` work
    stays bounded and a full gate cannot deadlock on blocking sends.
    Every call that reaches a handler costs one ``gate.record_request(transport, seconds)``
    (``"grpc"`` for gated methods, refusals included; ``"passthrough"`` for the rest).
    Handlers of gated methods must be ``async`` (as the A2A SDK's are); a synchronous one
    fails the call with a ``TypeError`` rather than run ungated.
    """

    def __init__(
        self,
        gate: Any,
        *,
        gate_methods: Literal["work", "all"] = "work",
        session_id: SessionId | None = None,
        priority: str | Callable[[grpc.HandlerCallDetails], str | None] | None = None,
        retry_after: float | None = None,
        abandoned_response_timeout: float = 60.0,
        rate_key: str | None = None,
        cost: int = 0,
    ) -> None:
        check_gate(gate)
        if gate_methods not in GATE_METHODS:
            raise ValueError(f"gate_methods must be 'work' or 'all', got {gate_methods!r}")
        if session_id is not None and not callable(session_id):
            raise TypeError(f"session_id must be a callable or None, got {session_id!r}")
        fixed_retry_after = _seconds_or_none("retry_after", retry_after)
        self._abandoned_timeout = check_abandoned_response_timeout(abandoned_response_timeout)
        self._gate = gate
        self._gate_all = gate_methods == "all"
        self._session_id = session_id
        self._priority = None if priority is None else PriorityDoor(gate, priority)
        self._retry_after = fixed_retry_after
        self._rate_key = None if rate_key is None else RateKey(rate_key)
        if self._rate_key is not None and self._rate_key.uses_tenant and session_id is None:
            raise ValueError(
                f"rate_key={rate_key!r} reads the tenant: it needs session_id (the tenant)"
            )
        self._cost = check_cost(cost)
        #: Usage reports (``admitgate-usage-tokens`` trailing metadata) seen: ``reported``
        #: (handed to the call's turn) and ``malformed`` (ignored); every one is removed
        #: before the client.
        self.usage_reports = {"reported": 0, "malformed": 0}
        self._wrapped: dict[str, tuple[Any, grpc.RpcMethodHandler[Any, Any]]] = {}

    @property
    def gate(self) -> Any:
        """The gate this interceptor admits through."""
        return self._gate

    def gates(self, method: str) -> bool:
        """Whether calls to ``method`` (``"/package.Service/Method"``) are gated."""
        if self._gate_all:
            return method[1:].partition("/")[0] in A2A_SERVICES
        return method in WORK_METHODS

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        """Wrap the handler of one call: gated A2A methods take a slot, the rest are timed."""
        handler = await continuation(handler_call_details)
        if handler is None:  # not served here: gRPC answers UNIMPLEMENTED, nothing to count
            return None
        # A server hands out the same handler object for a method on every call, so its
        # wrapped version is built once (the call's details reach the wrapper through its
        # context); a handler built anew per call is wrapped anew.
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._gated(handler, method) if self.gates(method) else self._passthrough(handler)
        if cached is not None or len(self._wrapped) < _MAX_CACHED_METHODS:
            self._wrapped[method] = (handler, wrapped)
        return wrapped

    # -- gated calls -------------------------------------------------------------------------

    def _gated(
        self, handler: grpc.RpcMethodHandler[Any, Any], method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        behaviour = _behaviour(handler)
        if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
            raise TypeError(
                f"admitgate.grpc gates only async handlers; {method} is served by the "
                f"synchronous {behaviour!r}"
            )
        if handler.response_streaming and inspect.isasyncgenfunction(behaviour):

            async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                started = time.perf_counter()
                try:
                    slot = await self._enter(method, context)
                    token = CURRENT_SLOT.set(slot)
                    try:
                        pump = _Pump(behaviour(request, context))
                        try:
                            async for response in pump:
                                yield response
                        finally:
                            # Ended, failed, or cancelled by the client: in the last case
                            # the handler (the agent's work) runs on, its messages
                            # discarded, and the slot stays held until it ends.
                            await pump.finish(self._abandoned_timeout)
                    except BaseException as exc:
                        slot.saw(exc)  # a throttle_on exception is a 429 signal
                        raise
                    finally:
                        _reset(token)
                        _take_throttle_trailer(context, slot)
                        self._take_usage_trailer(context, slot)
                        await slot.end_request()
                finally:
                    self._gate.record_request(TRANSPORT, time.perf_counter() - started)

            return _rebuild(handler, stream)

        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            # Unary responses, and streaming handlers written as coroutines that call
            # context.write(): the slot is held until the coroutine returns.
            started = time.perf_counter()
            try:
                slot = await self._enter(method, context)
                token = CURRENT_SLOT.set(slot)
                try:
                    return await _run_to_end(behaviour(request, context), self._abandoned_timeout)
                except BaseException as exc:
                    slot.saw(exc)  # a throttle_on exception is a 429 signal
                    raise
                finally:
                    _reset(token)
                    _take_throttle_trailer(context, slot)
                    self._take_usage_trailer(context, slot)
                    await slot.end_request()
            finally:
                self._gate.record_request(TRANSPORT, time.perf_counter() - started)

        return _rebuild(handler, unary)

    async def _enter(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> RequestSlot:
        """Admit the call (waiting in the gate's queue if need be), or end it refused.

        The slot is shared with a :class:`admitgate.a2a.GatedAgentExecutor` on the same gate
        that runs this call's work, so that work never takes a second slot."""
        session = ""
        metadata = context.invocation_metadata() or ()
        if self._session_id is not None:
            details = _CallDetails(method, metadata)
            session = checked_session(self._session_id(details), "handler_call_details")
        rate_key = self._rate_key
        priority = None
        if self._priority is not None:
            priority = self._priority.from_call(_CallDetails(method, metadata), metadata)
        # The call's gRPC deadline is the caller's: a turn that cannot finish in it is refused.
        admission = self._gate.admit(
            session_id=session,
            transport=TRANSPORT,
            deadline_s=context.time_remaining(),
            **admit_budget_kwargs(
                rate_key,
                self._cost,
                lambda: rate_key.identity_of_metadata(metadata, session),  # type: ignore[union-attr]
            ),
            priority=priority,
        )
        try:
            await admission.__aenter__()
        except AdmissionRejected as exc:
            await self._refuse(context, exc)
            raise  # not reached: abort raises
        return RequestSlot(self._gate, admission)

    async def _refuse(
        self, context: grpc.aio.ServicerContext[Any, Any], exc: AdmissionRejected
    ) -> None:
        answer = refusal(exc, self._retry_after)
        code = grpc.StatusCode[answer.grpc_status]
        trailers: list[tuple[str, str | bytes]] = [(REASON_TRAILER, answer.reason)]
        if exc.priority is not None and exc.priority.isascii() and exc.priority.isprintable():
            trailers.append((PRIORITY_KEY, exc.priority))
        if answer.retry_after is not None:
            trailers.append((PUSHBACK_TRAILER, str(whole_ms(answer.retry_after))))
        if _RICH_STATUS:
            trailers.append(
                (
                    "grpc-status-details-bin",
                    _status_details(code, exc.message, answer, exc.priority),
                )
            )
        await context.abort(code, exc.message, trailing_metadata=tuple(trailers))

    def _take_usage_trailer(
        self, context: grpc.aio.ServicerContext[Any, Any], slot: RequestSlot
    ) -> None:
        """Report the servicer's ``admitgate-usage-tokens`` trailing metadata to ``slot``'s
        turn and remove it (it is for the front door, not the client); a malformed value is
        ignored, counted, and removed too."""
        trailers = context.trailing_metadata() or ()
        values = [value for key, value in trailers if key == USAGE_KEY]
        if not values:
            return
        tokens = parse_usage(values[0]) if len(values) == 1 else None
        if tokens is None:
            self.usage_reports["malformed"] += 1
        else:
            self.usage_reports["reported"] += 1
            slot.report_usage(tokens)
        context.set_trailing_metadata(tuple((k, v) for k, v in trailers if k != USAGE_KEY))

    # -- passthrough -------------------------------------------------------------------------

    def _passthrough(
        self, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        behaviour = _behaviour(handler)
        record = self._gate.record_request

        if inspect.isasyncgenfunction(behaviour):

            async def stream(request: Any, context: Any) -> Any:
                started = time.perf_counter()
                try:
                    async with aclosing(behaviour(request, context)) as responses:
                        async for response in responses:
                            yield response
                finally:
                    record(PASSTHROUGH, time.perf_counter() - started)

            return _rebuild(handler, stream)

        if inspect.iscoroutinefunction(behaviour):

            async def unary(request: Any, context: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await behaviour(request, context)
                finally:
                    record(PASSTHROUGH, time.perf_counter() - started)

            return _rebuild(handler, unary)

        # Synchronous handlers stay synchronous: the server keeps running them in its thread
        # pool with a synchronous context.
        if handler.response_streaming:

            def sync_stream(request: Any, context: Any) -> Iterator[Any]:
                started = time.perf_counter()
                try:
                    yield from behaviour(request, context)
                finally:
                    record(PASSTHROUGH, time.perf_counter() - started)

            return _rebuild(handler, sync_stream)

        def sync_unary(request: Any, context: Any) -> Any:
            started = time.perf_counter()
            try:
                return behaviour(request, context)
            finally:
                record(PASSTHROUGH, time.perf_counter() - started)

        return _rebuild(handler, sync_unary)


_END: Any = object()


async def _run_to_end(handling: Awaitable[Any], timeout: float) -> Any:
    """Awaits a unary handler on a task of its own: a client's cancellation reaches the
    call's task, not the handler's, which runs on (its answer discarded, the slot held) for
    at most ``timeout`` seconds, then is cancelled; the call's cancellation then propagates."""
    task = asyncio.ensure_future(handling)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            await asyncio.wait({task}, timeout=timeout)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        raise


class _Pump:
    """A streaming handler's messages, produced on a task of its own (one message ahead of
    the call): a client's cancellation reaches the call's task, not the handler's, so the
    handler (and the agent's work it streams) can run to its end with the slot held. The
    task runs in a copy of the call's context (``CURRENT_SLOT`` included)."""

    def __init__(self, responses: AsyncIterator[Any]) -> None:
        self._queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue(1)
        self._ended = False
        self._task = asyncio.ensure_future(self._run(responses))

    async def _run(self, responses: AsyncIterator[Any]) -> None:
        try:
            async with aclosing(responses) as running:  # type: ignore[type-var]
                async for response in running:
                    await self._queue.put((response, None))
        except asyncio.CancelledError:
            raise  # closed by finish(): nobody reads any more
        except BaseException as exc:  # the handler's failure (an abort too) is the call's
            await self._queue.put((_END, exc))
            return
        await self._queue.put((_END, None))

    def __aiter__(self) -> _Pump:
        return self

    async def __anext__(self) -> Any:
        response, error = await self._queue.get()
        if response is _END:
            self._ended = True
            if error is not None:
                raise error
            raise StopAsyncIteration
        return response

    async def finish(self, timeout: float) -> None:
        """Lets the handler run to its end, its messages discarded, for at most ``timeout``
        seconds; then closes it."""
        if not self._ended:

            async def discard() -> None:
                while (await self._queue.get())[0] is not _END:
                    pass

            try:
                await asyncio.wait_for(discard(), timeout)
            except asyncio.TimeoutError:
                pass
        if not self._task.done():
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _take_throttle_trailer(context: grpc.aio.ServicerContext[Any, Any], slot: RequestSlot) -> None:
    """Report :data:`THROTTLED_TRAILER` to ``slot`` if the servicer set it in its trailing
    metadata, and remove it there (it is for the front door, not the client)."""
    trailers = context.trailing_metadata() or ()
    for key, value in trailers:
        if key == THROTTLED_TRAILER:
            slot.report_throttled(throttle_hint(value))
            context.set_trailing_metadata(tuple((k, v) for k, v in trailers if k != key))
            return


def _reset(token: contextvars.Token[Any]) -> None:
    try:
        CURRENT_SLOT.reset(token)
    except ValueError:  # a stream closed from another context: nothing of ours to restore
        pass


def _behaviour(handler: grpc.RpcMethodHandler[Any, Any]) -> Callable[..., Any]:
    if handler.request_streaming:
        found = handler.stream_stream if handler.response_streaming else handler.stream_unary
    else:
        found = handler.unary_stream if handler.response_streaming else handler.unary_unary
    if found is None:  # pragma: no cover - a malformed RpcMethodHandler
        raise TypeError(f"the method handler {handler!r} has no behaviour for its arity")
    return found


def _rebuild(
    handler: grpc.RpcMethodHandler[Any, Any], behaviour: Callable[..., Any]
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler (arity, (de)serializers) with ``behaviour`` in place of its own."""
    if handler.request_streaming:
        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
    else:
        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _status_details(
    code: grpc.StatusCode, message: str, answer: Refusal, priority: str | None = None
) -> bytes:
    """A serialized ``google.rpc.Status`` with ``ErrorInfo`` (the reason, and the class on a
    gate with classes) and, when there is a hint, ``RetryInfo``: the rich error model Google's
    client libraries read."""
    status = status_pb2.Status(code=code.value[0], message=message)
    info = any_pb2.Any()
    metadata = {"reason": answer.reason}
    if priority is not None:
        metadata["priority"] = priority
    info.Pack(
        error_details_pb2.ErrorInfo(
            reason=answer.reason.upper(), domain=ERROR_DOMAIN, metadata=metadata
        )
    )
    status.details.append(info)
    if answer.retry_after is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(whole_ms(answer.retry_after))
        retry = any_pb2.Any()
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        status.details.append(retry)
    return status.SerializeToString()


# -- client --------------------------------------------------------------------------------


class _PushbackRetry:
    """The retry settings both client interceptors share (validated once)."""

    def __init__(
        self,
        max_retries: int = 3,
        *,
        deadline_s: float | None = 30.0,
        jitter: float = 0.2,
    ) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        deadline = _seconds_or_none("deadline_s", deadline_s)
        if (
            isinstance(jitter, bool)
            or not isinstance(jitter, (int, float))
            or not 0.0 <= jitter <= 1.0
        ):
            raise ValueError(f"jitter must be a number between 0 and 1, got {jitter!r}")
        self._max_retries = max_retries
        self._deadline_s = deadline
        self._jitter = float(jitter)

    @property
    def max_retries(self) -> int:
        """The most retries of one call."""
        return self._max_retries

    @property
    def deadline_s(self) -> float | None:
        """How long after a call was made a retry may still start (``None``: no limit)."""
        return self._deadline_s

    @property
    def jitter(self) -> float:
        """The largest random fraction added to each wait."""
        return self._jitter


class RetryPushbackInterceptor(_PushbackRetry, grpc.aio.UnaryUnaryClientInterceptor):
    """A ``grpc.aio`` client interceptor that retries unary calls an
    :class:`AdmissionInterceptor` refused, after the delay the server asked for in
    ``grpc-retry-pushback-ms``. For streams add :class:`RetryPushbackStreamInterceptor`, or
    take both from :func:`retry_pushback_interceptors`: ``grpc.aio`` files an interceptor
    object under one kind of call only.

    Only a refusal by admitgate is retried: status ``RESOURCE_EXHAUSTED`` or ``UNAVAILABLE``
    with the ``admitgate-reason`` trailer and a pushback of 0 or more milliseconds. Such a call
    never reached the agent, so repeating it is safe even for ``SendMessage``. Anything else
    (another server's ``RESOURCE_EXHAUSTED``, a refusal without a hint) is returned as is.

    ``max_retries`` (default 3) bounds the retries of one call. ``deadline_s`` (default 30 s,
    ``None`` for none) bounds the time spent on refusals and waits: a retry that would start
    later than ``deadline_s`` after the call was made is not attempted, and the last refusal is
    returned. It does not limit how long an admitted call may run. The call's own ``timeout``
    still covers the whole call, retries included: each attempt gets what is left of it.
    ``jitter`` (0 to 1, default 0.2) lengthens each wait by a random fraction up to that much,
    so refused clients do not come back in step; a wait is never shorter than the server
    asked.
    """

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        """Make the call; while admitgate refuses it with a hint, wait and make it again."""
        attempts = _Attempts(self, client_call_details)
        while True:
            call = await continuation(attempts.details(), request)
            code = await call.code()
            delay = _pushback(code, await call.trailing_metadata())
            if not await attempts.wait(delay):
                return call


class RetryPushbackStreamInterceptor(_PushbackRetry, grpc.aio.UnaryStreamClientInterceptor):
    """The unary-stream companion of :class:`RetryPushbackInterceptor` (same arguments and
    rule), for ``SendStreamingMessage`` and ``SubscribeToTask``.

    A stream is retried only while it has yielded nothing: the interceptor reads the first
    message before handing the stream to the caller (so ``initial_metadata()`` resolves with
    it); once a message has arrived, a failure is the caller's.
    """

    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> AsyncIterator[Any]:
        """Start the stream; while admitgate refuses it before its first message, wait and
        start it again. The caller reads the first message and the rest from the stream."""
        attempts = _Attempts(self, client_call_details)
        while True:
            call = await continuation(attempts.details(), request)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as err:
                delay = _pushback(err.code(), err.trailing_metadata())
                if await attempts.wait(delay):
                    continue
                return _raise(err)
            return _replay(call, first)


def retry_pushback_interceptors(
    max_retries: int = 3, *, deadline_s: float | None = 30.0, jitter: float = 0.2
) -> list[grpc.aio.ClientInterceptor]:
    """Both retrying client interceptors with the same settings, for
    ``grpc.aio.insecure_channel(target, interceptors=retry_pushback_interceptors())``."""
    return [
        RetryPushbackInterceptor(max_retries, deadline_s=deadline_s, jitter=jitter),
        RetryPushbackStreamInterceptor(max_retries, deadline_s=deadline_s, jitter=jitter),
    ]


class _Attempts:
    """The retry budget and clock of one intercepted call."""

    def __init__(self, owner: _PushbackRetry, details: grpc.aio.ClientCallDetails) -> None:
        self._owner = owner
        self._details = details
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._retries = 0

    def details(self) -> grpc.aio.ClientCallDetails:
        """The call details for the next attempt: the caller's, with what is left of its
        timeout."""
        timeout = self._details.timeout
        if timeout is None or self._retries == 0:
            return self._details
        left = max(timeout - (self._loop.time() - self._started), 0.0)
        return grpc.aio.ClientCallDetails(
            self._details.method,
            left,
            self._details.metadata,
            self._details.credentials,
            self._details.wait_for_ready,
        )

    async def wait(self, delay: float | None) -> bool:
        """Sleep before a retry and return True, or return False when there is to be none."""
        owner = self._owner
        if delay is None or self._retries >= owner._max_retries:
            return False
        delay *= 1.0 + random.uniform(0.0, owner._jitter)
        resume_at = self._loop.time() + delay - self._started
        if owner._deadline_s is not None and resume_at > owner._deadline_s:
            return False
        timeout = self._details.timeout
        if timeout is not None and resume_at >= timeout:
            return False
        self._retries += 1
        await asyncio.sleep(delay)
        return True


def _pushback(code: grpc.StatusCode, trailers: Iterable[Any] | None) -> float | None:
    """The delay (seconds) admitgate asked for, or None when this is not its refusal."""
    if code not in _REFUSAL_CODES or not trailers:
        return None
    found: dict[str, Any] = {}
    for entry in trailers:
        found.setdefault(entry[0], entry[1])
    if REASON_TRAILER not in found:
        return None
    raw = found.get(PUSHBACK_TRAILER)
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    # Absent, negative or unparseable: the server asks not to retry (A6). ``str.isdigit``
    # alone takes "²" (which int() refuses); more than 12 digits (31 years) is no sane hint,
    # and a few hundred would overflow a float.
    if (
        not isinstance(raw, str)
        or not 0 < len(raw) <= _MAX_PUSHBACK_DIGITS
        or not (raw.isascii() and raw.isdigit())
    ):
        return None
    return int(raw) / 1000.0


async def _replay(call: Any, first: Any) -> AsyncIterator[Any]:
    message = first
    while message is not grpc.aio.EOF:
        yield message
        message = await call.read()


async def _raise(err: grpc.aio.AioRpcError) -> AsyncIterator[Any]:
    raise err
    yield  # pragma: no cover - makes this an async generator
