"""A provider throttle inside a front door's request reaches the gate (issue 17's adaptive
ceiling: "a throttle_on exception leaving the block is a 429 signal").

``async with gate.admit(): raise RateLimited`` lowers an adaptive gate's ceiling at once. The
same must hold when the turn is a front door's request and the exception is raised by what
runs behind it:

- the HTTP middleware: an ASGI app that raises (also after its framework answered 500 and
  re-raised, as Starlette's ``ServerErrorMiddleware`` does);
- the A2A SDK app (JSON-RPC and REST), whose handler answers an executor's exception itself:
  through ``GatedAgentExecutor`` on the same gate, which adopts the request's slot;
- the gRPC interceptor on a real ``grpc.aio`` server: a servicer that raises, and the SDK's
  gRPC handler over ``GatedAgentExecutor``;
- and an app that turns a provider 429 into its own answer: the ``admitgate-throttled``
  response header (gRPC trailer), which the front door reports and removes.

In every case the exception propagates exactly as without the gate (the same HTTP status or
gRPC status reaches the client), and a refusal by the gate itself never counts as a throttle.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import admitgate
import grpc
import grpc.aio
import httpx
import pytest
from _a2a_app import A2A_HEADERS, build_sdk_app, jsonrpc, send_params
from _grpc_a2a import A2AServer, LoopThread, user_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.types import a2a_pb2_grpc
from admitgate import AdaptiveLimit
from admitgate.a2a import GatedAgentExecutor
from admitgate.asgi import AdmissionMiddleware
from admitgate.grpc import AdmissionInterceptor
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

INITIAL = 8


class ProviderThrottled(Exception):
    """What an LLM client raises on a provider 429 (``openai.RateLimitError``, say)."""


def adaptive_gate() -> Any:
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=16,
        adaptive=AdaptiveLimit(initial_limit=INITIAL, throttle_on=(ProviderThrottled,)),
    )
    assert gate is not None and gate.limit == INITIAL
    return gate


def test_the_reference_async_with_lowers_the_limit() -> None:
    """What every front door must match."""
    gate = adaptive_gate()

    async def main() -> None:
        with pytest.raises(ProviderThrottled):
            async with gate.admit():
                raise ProviderThrottled

    asyncio.run(main())
    assert gate.limit < INITIAL


# -- the HTTP middleware ------------------------------------------------------------------------


async def _post(app: Any, path: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        return await c.post(path, headers=A2A_HEADERS, **kwargs)


def _raising_asgi_app(exc: Callable[[], BaseException]) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        raise exc()

    return app


async def _throttled_route(request: Request) -> Response:
    await request.body()
    raise ProviderThrottled("provider 429")


async def _other_error_route(request: Request) -> Response:
    raise KeyError("not a throttle")


_STARLETTE = Starlette(
    routes=[
        Route("/message:send", _throttled_route, methods=["POST"]),
        Route("/message:stream", _other_error_route, methods=["POST"]),
    ]
)


@pytest.mark.parametrize(
    "app",
    [_raising_asgi_app(lambda: ProviderThrottled("429")), _STARLETTE],
    ids=["bare ASGI app", "Starlette 500 then re-raise"],
)
def test_an_exception_leaving_the_app_lowers_the_limit_and_still_propagates(app: Any) -> None:
    """Fails before the fix: the middleware ended the turn with no exception (and, for the
    Starlette app, at the 500 it sent, before the exception reached it), so the limit stayed."""
    gate = adaptive_gate()

    async def main() -> None:
        bare = await _post(app, "/message:send", json=send_params("x"))
        gated = await _post(AdmissionMiddleware(app, gate), "/message:send", json=send_params("x"))
        assert gated.status_code == bare.status_code == 500
        assert gated.text == bare.text

    asyncio.run(main())
    assert gate.limit < INITIAL
    assert gate.stats()["in_flight"] == 0


def test_an_unrelated_exception_is_no_throttle() -> None:
    gate = adaptive_gate()
    response = asyncio.run(
        _post(AdmissionMiddleware(_STARLETTE, gate), "/message:stream", json=send_params("x"))
    )
    assert response.status_code == 500
    assert gate.limit == INITIAL and gate.stats()["in_flight"] == 0


class ThrottledExecutor(AgentExecutor):
    """An agent whose provider call is throttled: it raises what the LLM client raises."""

    def __init__(self) -> None:
        self.calls = 0

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.calls += 1
        raise ProviderThrottled("provider 429")

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/", jsonrpc("SendMessage", send_params("x"), 7)),
        ("/", jsonrpc("SendStreamingMessage", send_params("x"), 8)),
        ("/message:send", send_params("x")),
    ],
    ids=["jsonrpc", "jsonrpc stream", "rest"],
)
def test_the_sdk_app_over_the_middleware_reports_its_executors_throttle(
    path: str, body: Any
) -> None:
    """The SDK answers the executor's exception itself (a JSON-RPC error, a REST 500), so it
    never leaves the app: GatedAgentExecutor on the same gate adopts the request's slot and
    ends the turn with it. Fails before the fix: both ended the turn with no exception."""
    gate = adaptive_gate()
    executor = ThrottledExecutor()
    bare_app = build_sdk_app(ThrottledExecutor(), "http://test")
    gated_app = AdmissionMiddleware(
        build_sdk_app(GatedAgentExecutor(executor, gate), "http://test"), gate
    )

    async def main() -> None:
        bare = await _post(bare_app, path, json=body)
        gated = await _post(gated_app, path, json=body)
        assert gated.status_code == bare.status_code
        assert _error_of(gated) == _error_of(bare)

    asyncio.run(main())
    assert executor.calls == 1
    assert gate.limit < INITIAL
    stats = gate.stats()
    assert stats["in_flight"] == 0 and stats["admitted"] == 1  # one slot, shared


def _error_of(response: httpx.Response) -> Any:
    text = response.text
    if text.startswith("data:"):
        text = text.partition("\n")[0].removeprefix("data:")
    answer = json.loads(text)
    return answer.get("error", answer)


def test_the_executor_alone_reports_its_throttle() -> None:
    """Without a front door GatedAgentExecutor takes its own slot and ends it the same way."""
    gate = adaptive_gate()
    app = build_sdk_app(GatedAgentExecutor(ThrottledExecutor(), gate), "http://test")
    response = asyncio.run(_post(app, "/", json=jsonrpc("SendMessage", send_params("x"), 1)))
    assert response.json()["error"]["code"] == -32603
    assert gate.limit < INITIAL and gate.stats()["in_flight"] == 0


def _header_app(headers: list[tuple[bytes, bytes]], status: int = 200) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def test_the_throttled_header_is_reported_and_removed() -> None:
    """An app that answers a provider 429 itself says so with ``admitgate-throttled``."""
    gate = adaptive_gate()
    headers = [(b"content-type", b"application/json"), (b"Admitgate-Throttled", b"2.5")]
    app = AdmissionMiddleware(_header_app(headers, 429), gate)
    response = asyncio.run(_post(app, "/message:send", json=send_params("x")))
    assert response.status_code == 429
    assert "admitgate-throttled" not in response.headers
    assert response.headers["content-type"] == "application/json"
    assert gate.limit < INITIAL


def test_without_the_header_a_429_from_the_app_is_no_throttle() -> None:
    """Opt-in: an app's own 429 (its own rate limit, say) says nothing of the provider."""
    gate = adaptive_gate()
    app = AdmissionMiddleware(_header_app([(b"retry-after", b"3")], 429), gate)
    assert asyncio.run(_post(app, "/message:send", json=send_params("x"))).status_code == 429
    assert gate.limit == INITIAL


def test_the_gates_own_refusals_are_no_throttle() -> None:
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1,
        queue_depth=0,
        adaptive=AdaptiveLimit(initial_limit=1, throttle_on=(ProviderThrottled,)),
    )
    assert gate is not None
    release = asyncio.Event()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def main() -> None:
        app = AdmissionMiddleware(slow, gate)
        holder = asyncio.create_task(_post(app, "/message:send", json=send_params("x")))
        while gate.stats()["in_flight"] == 0:
            await asyncio.sleep(0.001)
        for _ in range(20):
            refused = await _post(app, "/message:send", json=send_params("x"))
            assert refused.status_code == 429
        release.set()
        assert (await holder).status_code == 200

    asyncio.run(main())
    assert gate.stats()["rejected"] == 20
    assert gate.limit >= 1 and gate.stats()["in_flight"] == 0


# -- the gRPC interceptor -----------------------------------------------------------------------

_SEND = "/lf.a2a.v1.A2AService/SendMessage"


def _raw_service(behaviour: Callable[..., Any]) -> grpc.GenericRpcHandler:
    """A gated method name (the A2A SDK's SendMessage) served on raw bytes by ``behaviour``."""
    return grpc.method_handlers_generic_handler(
        "lf.a2a.v1.A2AService", {"SendMessage": grpc.unary_unary_rpc_method_handler(behaviour)}
    )


async def _raw_call(behaviour: Callable[..., Any], interceptors: list[Any]) -> grpc.aio.AioRpcError:
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers((_raw_service(behaviour),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary(_SEND)(b"x", timeout=10)
            return err.value
    finally:
        await server.stop(None)


def test_a_servicer_that_raises_lowers_the_limit_and_keeps_its_status() -> None:
    """Fails before the fix: the interceptor ended the call's turn with no exception."""
    gate = adaptive_gate()

    async def throttled(request: bytes, context: Any) -> bytes:
        raise ProviderThrottled("provider 429")

    async def main() -> None:
        bare = await _raw_call(throttled, [])
        gated = await _raw_call(throttled, [AdmissionInterceptor(gate)])
        assert gated.code() == bare.code() == grpc.StatusCode.UNKNOWN
        assert gated.details() == bare.details()

    asyncio.run(main())
    assert gate.limit < INITIAL and gate.stats()["in_flight"] == 0


def test_a_servicers_throttled_trailer_is_reported_and_removed() -> None:
    """A servicer that answers a provider 429 itself sets ``admitgate-throttled``; the
    interceptor reports it, and removes it unless the servicer aborted (``abort`` sends the
    trailers at once, before the interceptor sees them)."""

    async def answered(request: bytes, context: Any) -> bytes:
        context.set_trailing_metadata((("admitgate-throttled", "1"), ("x-kept", "yes")))
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("provider said 429")
        return b""

    async def aborted(request: bytes, context: Any) -> bytes:
        context.set_trailing_metadata((("admitgate-throttled", "1"),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "provider said 429")
        raise AssertionError("abort returned")

    for behaviour, stripped in ((answered, True), (aborted, False)):
        gate = adaptive_gate()
        err = asyncio.run(_raw_call(behaviour, [AdmissionInterceptor(gate)]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(err.trailing_metadata() or ())
        assert ("admitgate-throttled" not in trailers) == stripped, trailers
        assert "admitgate-reason" not in trailers  # the app's answer, not a refusal
        assert gate.limit < INITIAL


def test_the_sdk_grpc_handler_over_gated_executor_reports_the_throttle() -> None:
    gate = adaptive_gate()
    executor = ThrottledExecutor()
    statuses: list[grpc.StatusCode] = []
    loop = LoopThread()

    async def call(server: A2AServer) -> None:
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = a2a_pb2_grpc.A2AServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SendMessage(user_message("x"), timeout=10)
                statuses.append(err.value.code())
        finally:
            await server.stop()

    try:
        loop.run(call(A2AServer([], wrap=lambda _: ThrottledExecutor())))
        gated = A2AServer(
            [AdmissionInterceptor(gate)], wrap=lambda _: GatedAgentExecutor(executor, gate)
        )
        loop.run(call(gated))
    finally:
        loop.close()
    assert statuses[0] == statuses[1]
    assert executor.calls == 1
    assert gate.limit < INITIAL
    stats = gate.stats()
    assert stats["in_flight"] == 0 and stats["admitted"] == 1


def test_the_throttled_marks_value_is_seconds_or_no_hint() -> None:
    from admitgate._frontdoor import throttle_hint

    assert throttle_hint(b"2.5") == 2.5 and throttle_hint("1") == 1.0 and throttle_hint(b" 0 ") == 0
    for bad in (b"", b"yes", b"-1", b"1e3", "\u0663".encode(), b"86401", b"1.2.3", b"9" * 17):
        assert throttle_hint(bad) is None, bad


# -- issue 22 item 10: a Retry-After of 0 is a valid hint ------------------------------------


def test_a_throttled_header_of_zero_over_uvicorn_is_a_throttle_with_no_hold() -> None:
    """Fails before the fix: ``admitgate-throttled: 0`` made ``report_throttled(0.0)`` raise
    inside the middleware, so the client got a 500 with an empty body and the limit stayed."""
    from _a2a_app import ServerThread

    gate = adaptive_gate()
    headers = [(b"content-type", b"application/json"), (b"admitgate-throttled", b"0")]
    server = ServerThread()
    server.start(AdmissionMiddleware(_header_app(headers, 429), gate))
    try:
        response = httpx.post(f"{server.url}/message:send", json=send_params("x"), timeout=10)
    finally:
        server.stop()
    assert response.status_code == 429, response
    assert response.content == b"{}"
    assert "admitgate-throttled" not in response.headers
    assert gate.limit < INITIAL and gate.stats()["in_flight"] == 0


def test_a_throttled_trailer_of_zero_over_grpc_aio_is_a_throttle_with_no_hold() -> None:
    """Fails before the fix: over gRPC the details became "Unexpected ValueError", the trailer
    was not stripped and the limit stayed."""

    async def answered(request: bytes, context: Any) -> bytes:
        context.set_trailing_metadata((("admitgate-throttled", "0"), ("x-kept", "yes")))
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("provider said 429")
        return b""

    gate = adaptive_gate()
    err = asyncio.run(_raw_call(answered, [AdmissionInterceptor(gate)]))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "provider said 429"
    trailers = dict(err.trailing_metadata() or ())
    assert "admitgate-throttled" not in trailers and trailers.get("x-kept") == "yes", trailers
    assert gate.limit < INITIAL and gate.stats()["in_flight"] == 0


def test_report_throttled_takes_zero_and_refuses_negative_or_nan() -> None:
    gate = adaptive_gate()

    async def main() -> None:
        async with gate.admit() as turn:
            turn.report_throttled(0)
            turn.report_throttled(0.0)
            for bad in (-1, float("nan"), float("inf"), "soon"):
                with pytest.raises(ValueError, match="retry_after_s"):
                    turn.report_throttled(bad)

    asyncio.run(main())
    assert gate.limit < INITIAL
