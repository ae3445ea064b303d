"""The broker binary in front of real servers on loopback: the A2A SDK app on uvicorn
(JSON-RPC, REST, SSE, agent card, a WebSocket echo) and a grpc.aio A2A server, driven by
httpx, the websockets client and grpcio. No mocks: every byte crosses real sockets.

One upstream and one broker (cap 2, no queue) per module; tests that need other flags start
their own broker. Timing is controlled by the executors' latches, not by sleeping.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import signal
import socket
import threading
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import websockets
from _a2a_app import (
    A2A_HEADERS,
    ControlledExecutor,
    Latches,
    ServerThread,
    build_sdk_app,
    jsonrpc,
    send_params,
)
from _broker import BrokerProcess, build_broker, key, wait_until
from _grpc_a2a import A2AServer, LoopThread, user_message
from a2a.types import a2a_pb2_grpc
from google.rpc import error_details_pb2, status_pb2
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

BUSY = "Busy right now \u2014 please resend in a moment."


async def _echo_headers(request: Request) -> JSONResponse:
    return JSONResponse({k: v for k, v in request.headers.items()})


async def _ws_echo(websocket: WebSocket) -> None:
    await websocket.accept()
    try:
        while True:
            await websocket.send_text(await websocket.receive_text())
    except Exception:
        return


@pytest.fixture(scope="module")
def binary() -> Any:
    return build_broker()


@pytest.fixture(scope="module")
def env(binary: Any) -> Iterator[types.SimpleNamespace]:
    """The SDK app on uvicorn, the gRPC A2A server, and a broker (cap 2, no queue) in front."""
    latches = Latches()
    executor = ControlledExecutor(latches)
    server = ServerThread()
    app = build_sdk_app(executor, server.url)
    app.router.routes[:0] = [
        Route("/echo-headers", _echo_headers, methods=["GET", "POST"]),
        WebSocketRoute("/ws", _ws_echo),
    ]
    server.start(app)
    loop = LoopThread()
    grpc_server = A2AServer([])
    loop.run(grpc_server.start())
    broker = BrokerProcess(
        binary,
        "--upstream",
        server.url,
        "--grpc-upstream",
        f"http://{grpc_server.target}",
        "--max-in-flight",
        "2",
    )
    yield types.SimpleNamespace(
        latches=latches,
        executor=executor,
        server=server,
        grpc=grpc_server,
        loop=loop,
        broker=broker,
        binary=binary,
    )
    latches.release_all()
    grpc_server.executor.release_all()
    broker.stop()
    loop.run(grpc_server.stop())
    loop.close()
    server.stop()


def hold(env: Any, k: str, *, rest: bool = False) -> threading.Thread:
    """A blocking SendMessage ``hold k`` through the broker, on a thread; returns once the
    agent runs it."""
    results: list[httpx.Response] = []

    def call() -> None:
        if rest:
            response = httpx.post(
                env.broker.url + "/message:send",
                json=send_params(f"hold {k}"),
                headers=A2A_HEADERS,
                timeout=30,
            )
        else:
            response = httpx.post(
                env.broker.url + "/",
                json=jsonrpc("SendMessage", send_params(f"hold {k}")),
                headers=A2A_HEADERS,
                timeout=30,
            )
        results.append(response)

    thread = threading.Thread(target=call, daemon=True)
    thread.results = results  # type: ignore[attr-defined]
    thread.start()
    wait_until(lambda: env.latches[k].started.is_set(), timeout=15)
    return thread


def finish(env: Any, *pairs: tuple[str, threading.Thread]) -> None:
    for k, thread in pairs:
        env.latches[k].release()
        thread.join(10)
        assert thread.results[0].status_code == 200  # type: ignore[attr-defined]
    env.broker.wait_for("broker_gate_in_flight", 0, timeout=15)
    env.broker.wait_for('broker_inflight_requests{transport="jsonrpc"}', 0)
    env.broker.wait_for('broker_inflight_requests{transport="rest"}', 0)
    env.broker.wait_for('broker_inflight_requests{transport="grpc"}', 0)


# -- gating and refusals ------------------------------------------------------------------------


def test_exactly_the_cap_passes_and_refusals_are_the_front_doors(env: Any) -> None:
    k1, k2 = key(), key()
    a, b = hold(env, k1), hold(env, k2, rest=True)
    assert env.broker.gauge('broker_inflight_requests{transport="jsonrpc"}') == 1
    assert env.broker.gauge('broker_inflight_requests{transport="rest"}') == 1
    before = env.broker.gauge('broker_rejected_total{transport="jsonrpc"}')
    for rpc_id in ("abc", 7):
        refused = httpx.post(
            env.broker.url + "/",
            json=jsonrpc("SendMessage", send_params("echo no"), rpc_id=rpc_id),
            headers=A2A_HEADERS,
        )
        assert refused.status_code == 429
        assert refused.headers["admitgate-reason"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1
        body = refused.json()
        assert body["id"] == rpc_id
        assert body["error"]["code"] == -32029
        assert body["error"]["message"] == BUSY
        assert body["error"]["data"] == {
            "reason": "queue_full",
            "retryAfter": int(refused.headers["retry-after"]),
        }
    # The same reader as the middleware's (crates/classify): a UTF-16 body holding a lone
    # surrogate is JSON to the SDK, so it is work (before: "not JSON", passed ungated); an id
    # holding one cannot be echoed, so it is answered null.
    for body, rpc_id in (
        (
            json.dumps(
                jsonrpc("SendMessage", {**send_params("echo no"), "x": "\udc00"}, 5),
                ensure_ascii=False,
            ).encode("utf-16", "surrogatepass"),
            5,
        ),
        (json.dumps(jsonrpc("SendMessage", send_params("echo no"), "\ud800")).encode(), None),
    ):
        refused = httpx.post(env.broker.url + "/", content=body, headers=A2A_HEADERS)
        assert refused.status_code == 429, refused.text
        assert refused.json()["id"] == rpc_id
    rest = httpx.post(
        env.broker.url + "/message:send", json=send_params("echo no"), headers=A2A_HEADERS
    )
    assert rest.status_code == 429
    error = rest.json()["error"]
    assert (error["code"], error["status"], error["message"]) == (
        429,
        "RESOURCE_EXHAUSTED",
        BUSY,
    )
    info, retry = error["details"]
    assert info["reason"] == "QUEUE_FULL" and info["domain"] == "admitgate"
    assert retry["retryDelay"] == f"{rest.headers['retry-after']}s"
    assert env.broker.gauge('broker_rejected_total{transport="jsonrpc"}') == before + 4
    assert env.executor.running == 2  # nothing refused reached the agent
    finish(env, (k1, a), (k2, b))


def test_the_a2a_sdk_client_through_the_broker_is_served_then_sees_the_refusal(env: Any) -> None:
    """The A2A SDK's own client, over both HTTP bindings, streaming or not: served through the
    broker, then refused with the front doors' errors while the cap is held, then served again.
    """
    from _a2a_app import agent_card
    from a2a.client import A2ACardResolver, A2AClientError, ClientConfig, create_client
    from a2a.types import Message, Part, Role, SendMessageRequest

    def request(text: str) -> SendMessageRequest:
        return SendMessageRequest(
            message=Message(
                role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text=text)]
            )
        )

    async def send_all(binding: str, streaming: bool, text: str) -> list[Any]:
        async with httpx.AsyncClient(timeout=10) as http:
            # The card comes through the broker (passthrough); the interfaces it advertises are
            # the broker's, as a sidecar's agent advertises its public address.
            fetched = await A2ACardResolver(http, env.broker.url).get_agent_card()
            assert fetched.name == agent_card(env.broker.url).name
            config = ClientConfig(
                httpx_client=http, streaming=streaming, supported_protocol_bindings=[binding]
            )
            sdk = await create_client(agent_card(env.broker.url), client_config=config)
            return [event async for event in sdk.send_message(request(text))]

    bindings = [(b, s) for b in ("JSONRPC", "HTTP+JSON") for s in (False, True)]

    def served() -> None:
        for binding, streaming in bindings:
            events = asyncio.run(send_all(binding, streaming, "echo through"))
            assert events, (binding, streaming)
            assert "through" in str(events[-1]), (binding, streaming, events[-1])

    served()
    k1, k2 = key(), key()
    a, b = hold(env, k1), hold(env, k2, rest=True)
    before = env.executor.running
    for binding, streaming in bindings:
        with pytest.raises(A2AClientError, match="429") as info:
            asyncio.run(send_all(binding, streaming, "echo no"))
        cause = info.value.__cause__
        assert isinstance(cause, httpx.HTTPStatusError), (binding, streaming, cause)
        assert cause.response.headers["admitgate-reason"] == "queue_full"
        assert int(cause.response.headers["retry-after"]) >= 1
        error = cause.response.json()["error"]
        if binding == "JSONRPC":
            assert error["code"] == -32029
        else:
            assert error["details"][0]["domain"] == "admitgate"
    assert env.executor.running == before  # nothing refused reached the agent
    finish(env, (k1, a), (k2, b))
    served()


def test_reads_cards_custom_routes_and_websockets_pass_while_saturated(env: Any) -> None:
    k1, k2 = key(), key()
    a, b = hold(env, k1), hold(env, k2)
    passthrough = env.broker.gauge('broker_requests_total{transport="passthrough"}')
    started = time.monotonic()
    card = httpx.get(env.broker.url + "/.well-known/agent-card.json")
    assert card.status_code == 200 and card.json()["name"]
    assert httpx.get(env.broker.url + "/custom").json() == {"custom": True}
    get_task = httpx.post(
        env.broker.url + "/",
        json=jsonrpc("GetTask", {"id": "nope"}),
        headers=A2A_HEADERS,
    )
    assert get_task.status_code == 200 and "error" in get_task.json()  # the agent answered
    assert time.monotonic() - started < 2

    async def ws() -> None:
        async with websockets.connect(env.broker.url.replace("http", "ws") + "/ws") as socket_:
            for text in ("one", "two"):
                await socket_.send(text)
                assert await socket_.recv() == text

    asyncio.run(asyncio.wait_for(ws(), 10))
    assert env.broker.gauge('broker_requests_total{transport="passthrough"}') >= passthrough + 3
    finish(env, (k1, a), (k2, b))


def test_an_sse_stream_holds_its_slot_even_after_its_client_leaves(env: Any) -> None:
    """A stream holds its slot for its whole life; a client leaving mid-stream does not free
    it while the agent still works (issue 22 item 7: the cap counts runs at the agent), only
    the stream's end does."""

    async def main() -> None:
        k1, k2 = key(), key()
        async with httpx.AsyncClient(base_url=env.broker.url, timeout=20) as c:
            body = jsonrpc("SendStreamingMessage", send_params(f"hold {k1}"))
            async with c.stream("POST", "/", json=body, headers=A2A_HEADERS) as stream:
                # The iterators are kept: a dropped one closes its response (the client leaves).
                first = stream.aiter_lines()
                async for line in first:
                    if line.startswith("data:"):
                        break
                await asyncio.to_thread(wait_until, env.latches[k1].started.is_set)
                assert env.broker.gauge('broker_inflight_requests{transport="jsonrpc"}') == 1
                async with c.stream(
                    "POST", "/message:stream", json=send_params(f"hold {k2}"), headers=A2A_HEADERS
                ) as second:
                    lines = second.aiter_lines()
                    async for line in lines:
                        if line.startswith("data:"):
                            break
                    assert env.broker.gauge("broker_gate_in_flight") == 2
                    refused = await c.post("/message:send", json=send_params("echo no"))
                    assert refused.status_code == 429
            # Both clients left mid-stream while the agent still works: both slots are held.
            await asyncio.sleep(0.3)
            assert env.broker.gauge('broker_inflight_requests{transport="jsonrpc"}') == 1
            assert env.broker.gauge('broker_inflight_requests{transport="rest"}') == 1
            assert not env.latches[k1].finished.is_set()
            env.latches[k1].release()
            env.latches[k2].release()
            # The streams end at the agent: both slots are free.
            await asyncio.to_thread(
                env.broker.wait_for, 'broker_inflight_requests{transport="jsonrpc"}', 0
            )
            await asyncio.to_thread(
                env.broker.wait_for, 'broker_inflight_requests{transport="rest"}', 0
            )

    asyncio.run(asyncio.wait_for(main(), 20))


async def _endless_sse(scope: Any, receive: Any, send: Any) -> None:
    """A trivial agent whose every response is an SSE stream that never ends by itself."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    try:
        while True:
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
            await asyncio.sleep(0.01)
    except OSError:
        return


def test_aborted_streams_leak_no_slot(env: Any) -> None:
    """1,000 gated SSE streams, each left by its client after its first bytes, 50 at a time:
    every one is admitted and every slot comes back. (The streams never end, so the slots
    are freed as their clients leave: --abandoned-response-timeout 0.)"""
    upstream = ServerThread()
    upstream.start(_endless_sse)
    broker = BrokerProcess(
        env.binary,
        "--upstream",
        upstream.url,
        "--max-in-flight",
        "50",
        "--abandoned-response-timeout",
        "0",
    )

    async def one(c: httpx.AsyncClient) -> None:
        async with c.stream("POST", "/message:stream", json=send_params("x")) as stream:
            assert stream.status_code == 200
            async for _ in stream.aiter_bytes():
                break  # leave at the first bytes

    async def main() -> None:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=broker.url, timeout=20, limits=limits) as c:
            for _ in range(20):
                await asyncio.gather(*(one(c) for _ in range(50)))

    try:
        asyncio.run(asyncio.wait_for(main(), 50))
        broker.wait_for("broker_gate_in_flight", 0)
        broker.wait_for('broker_inflight_requests{transport="rest"}', 0)
        metrics = broker.metrics()
        assert metrics['broker_admitted_total{transport="rest"}'] == 1000
        assert metrics['broker_rejected_total{transport="rest"}'] == 0
    finally:
        assert broker.stop() == 0
        upstream.stop()


def test_grpc_is_gated_with_jsonrpc_under_one_cap_and_trailers_pass(env: Any) -> None:
    k = key()
    a = hold(env, k)
    target = env.broker.address

    async def main() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            held = asyncio.ensure_future(stub.SendMessage(user_message("hold:g1")))
            await asyncio.to_thread(
                env.broker.wait_for, 'broker_inflight_requests{transport="grpc"}', 1
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SendMessage(user_message("hold:g2"))
            error = refused.value
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details() == BUSY
            trailers = dict(error.trailing_metadata() or ())
            assert trailers["admitgate-reason"] == "queue_full"
            assert int(trailers["grpc-retry-pushback-ms"]) >= 1000
            # The rich status, as the in-process interceptor sends it (ErrorInfo, RetryInfo).
            status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
            assert (status.code, status.message) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                BUSY,
            )
            info = error_details_pb2.ErrorInfo()
            assert status.details[0].Unpack(info)
            assert (info.reason, info.domain, dict(info.metadata)) == (
                "QUEUE_FULL",
                "admitgate",
                {"reason": "queue_full"},
            )
            retry = error_details_pb2.RetryInfo()
            assert status.details[1].Unpack(retry)
            assert retry.retry_delay.ToMilliseconds() == int(trailers["grpc-retry-pushback-ms"])
            # A call that is not work passes, and the upstream's own trailers arrive intact.
            busy = channel.unary_unary("/test.Plain/Busy")
            with pytest.raises(grpc.aio.AioRpcError) as upstream:
                await busy(b"x")
            assert upstream.value.details() == "busy elsewhere"
            assert ("grpc-retry-pushback-ms", "10") in tuple(
                upstream.value.trailing_metadata() or ()
            )
            assert "admitgate-reason" not in dict(upstream.value.trailing_metadata() or ())
            count = channel.unary_stream("/test.Plain/AsyncCount")
            assert [m async for m in count(bytes([3]))] == [b"\x00", b"\x01", b"\x02"]
            env.grpc.executor.release("g1")
            env.grpc.executor.release("g2")
            await held

    env.loop.run(main(), timeout=20)
    finish(env, (k, a))


# -- protocol hygiene ---------------------------------------------------------------------------


def test_hop_by_hop_headers_are_stripped_and_h2c_upgrade_refused(env: Any) -> None:
    seen = httpx.get(
        env.broker.url + "/echo-headers",
        headers={"Connection": "x-private", "x-private": "1", "Keep-Alive": "5", "x-end": "1"},
    ).json()
    assert "x-private" not in seen and "keep-alive" not in seen and seen["x-end"] == "1"
    assert seen["x-forwarded-for"] == "127.0.0.1"
    host, port = env.broker.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(
            b"GET /echo-headers HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
            chunk = raw.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200")
    echoed = json.loads(reply.split(b"\r\n\r\n", 1)[1].split(b"\r\n")[-1] or b"{}")
    assert "upgrade" not in echoed and "http2-settings" not in echoed


def test_a_silent_connection_is_closed_after_the_first_bytes_timeout(env: Any) -> None:
    broker = BrokerProcess(
        env.binary, "--upstream", env.server.url, "--first-bytes-timeout", "0.3", metrics=False
    )
    try:
        host, port = broker.address.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            started = time.monotonic()
            assert raw.recv(1) == b""
            assert 0.2 < time.monotonic() - started < 3
    finally:
        assert broker.stop() == 0


# -- operations ---------------------------------------------------------------------------------


def test_metrics_livez_and_readyz(env: Any) -> None:
    base = env.broker.metrics_url
    assert httpx.get(base + "/livez").status_code == 200
    wait_until(lambda: httpx.get(base + "/readyz").status_code == 200)
    text = httpx.get(base + "/metrics").text
    for name in (
        "broker_inflight_requests",
        "broker_rejected_total",
        "broker_requests_total",
        "broker_request_duration_seconds",
        "broker_limit",
        "broker_saturated",
    ):
        assert f"# TYPE {name} " in text
    assert env.broker.gauge("broker_limit") == 2


class _Answering(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _answering_server(port: int = 0) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Answering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_readyz_goes_unready_when_the_agent_dies_and_ready_when_it_is_back(env: Any) -> None:
    """/readyz and broker_upstream_up follow the agent: 503 within 3 s of its last answer
    (the broker probes it every second while nothing else answers), 200 again within about a
    second of it answering again. Fails before the fix: once ready, it stayed ready."""
    agent = _answering_server()
    port = agent.server_address[1]
    broker = BrokerProcess(env.binary, "--upstream", f"http://127.0.0.1:{port}")
    readyz = f"{broker.metrics_url}/readyz"
    try:
        wait_until(lambda: httpx.get(readyz).status_code == 200, timeout=3)
        assert broker.gauge("broker_upstream_up") == 1
        agent.shutdown()
        agent.server_close()
        died = time.monotonic()
        wait_until(lambda: httpx.get(readyz).status_code == 503, timeout=5)
        assert time.monotonic() - died < 3.5
        assert httpx.get(readyz).text == "upstream not answering\n"
        assert broker.gauge("broker_upstream_up") == 0
        agent = _answering_server(port)
        back = time.monotonic()
        wait_until(lambda: httpx.get(readyz).status_code == 200, timeout=5)
        assert time.monotonic() - back < 2.5
        assert broker.gauge("broker_upstream_up") == 1
    finally:
        assert broker.stop() == 0
        agent.shutdown()
        agent.server_close()


def test_sigterm_refuses_queued_turns_and_drains_running_ones(env: Any) -> None:
    broker = BrokerProcess(
        env.binary,
        "--upstream",
        env.server.url,
        "--max-in-flight",
        "1",
        "--queue-depth",
        "4",
        "--drain-timeout",
        "10",
    )
    k = key()
    results: dict[str, httpx.Response] = {}

    def call(name: str, text: str) -> None:
        results[name] = httpx.post(
            broker.url + "/",
            json=jsonrpc("SendMessage", send_params(text)),
            headers=A2A_HEADERS,
            timeout=30,
        )

    running = threading.Thread(target=call, args=("running", f"hold {k}"))
    running.start()
    wait_until(env.latches[k].started.is_set)
    queued = threading.Thread(target=call, args=("queued", "echo later"))
    queued.start()
    broker.wait_for('broker_queued_requests{transport="jsonrpc"}', 1)
    broker.process.send_signal(signal.SIGTERM)
    queued.join(10)
    assert results["queued"].status_code == 503
    assert results["queued"].json()["error"]["data"]["reason"] == "closing"
    assert broker.process.poll() is None  # still draining the running request
    env.latches[k].release()
    running.join(10)
    assert results["running"].status_code == 200
    assert broker.stop() == 0
    drained = broker.events("drained")
    assert drained and drained[0]["all_requests_finished"] is True


def test_refusal_logs_are_limited_to_one_line_per_second(env: Any) -> None:
    k1, k2 = key(), key()
    a, b = hold(env, k1), hold(env, k2)
    logged = len(env.broker.events("refused"))
    started = time.monotonic()
    with httpx.Client(base_url=env.broker.url) as c:
        for _ in range(50):
            assert c.post("/message:send", json=send_params("echo no")).status_code == 429
    # At most one line per reason per wall-clock second the burst touched.
    seconds = int(time.monotonic() - started) + 2
    time.sleep(0.1)  # the last line crosses the pipe
    lines = env.broker.events("refused")[logged:]
    assert 1 <= len(lines) <= seconds, (len(lines), seconds)
    assert sum(line["suppressed_since_last"] for line in lines[1:]) <= 50
    finish(env, (k1, a), (k2, b))


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length body, or b"" if the socket closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head


def test_a_refused_request_whose_body_comes_late_keeps_its_connection_usable(env: Any) -> None:
    """A REST refusal needs nothing of the body, so it used to be answered before the body
    arrived; hyper then closed the kept-alive connection without saying so, and the client's
    next request on it met a closed socket (seen as "Server disconnected without sending a
    response" from httpx in a burst of refusals). The broker now reads a refused body to its
    end (a bounded amount, briefly) or answers `Connection: close`."""
    k1, k2 = key(), key()
    a, b = hold(env, k1), hold(env, k2)
    body = json.dumps(send_params("echo no")).encode()
    host, port = env.broker.url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /message:send HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"A2A-Version: 1.0\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for _ in range(3):
            sock.sendall(head)
            time.sleep(0.05)  # the body in a later segment than the head
            sock.sendall(body)
            response = _read_response(sock)
            assert response.startswith(b"HTTP/1.1 429"), response[:200]
            if b"connection: close" in response.lower():
                break  # told: a client opens a new connection
        else:
            # Not told to close: the connection must still serve the next request.
            sock.sendall(b"GET /custom HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(sock).startswith(b"HTTP/1.1 200")
    finish(env, (k1, a), (k2, b))


def test_memory_pressure_of_the_agent_container_refuses_work(env: Any, tmp_path: Any) -> None:
    """The container's cgroup v2 files (a directory laid out as /sys/fs/cgroup is): at the
    hard ratio of memory.max new work is refused with 503 memory_pressure; reads pass."""
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("1000000000\n")  # 93 %
    broker = BrokerProcess(
        env.binary,
        "--upstream",
        env.server.url,
        "--max-in-flight",
        "4",
        "--memory-hard-ratio",
        "0.9",
        "--memory-cgroup",
        str(tmp_path),
    )
    try:
        refused = httpx.post(
            broker.url + "/message:send", json=send_params("echo no"), headers=A2A_HEADERS
        )
        assert refused.status_code == 503
        assert refused.headers["admitgate-reason"] == "memory_pressure"
        assert refused.headers["retry-after"] == "5"
        assert httpx.get(broker.url + "/custom").status_code == 200
        (tmp_path / "memory.current").write_text("500000000\n")
        time.sleep(0.05)  # past the 5 ms cache
        ok = httpx.post(
            broker.url + "/message:send", json=send_params("echo yes"), headers=A2A_HEADERS
        )
        assert ok.status_code == 200
    finally:
        assert broker.stop() == 0
    # Where the files are missing, memory-aware admission is off, with one warning.
    broker = BrokerProcess(
        env.binary,
        "--upstream",
        env.server.url,
        "--memory-hard-ratio",
        "0.9",
        "--memory-cgroup",
        str(tmp_path / "missing"),
        metrics=False,
    )
    assert broker.stop() == 0
    assert len(broker.events("memory_aware_admission_off")) == 1


@pytest.mark.parametrize(
    ("files", "why"),
    [
        ({"memory.max": "lots\n", "memory.current": "1\n"}, "memory.max is not a number"),
        ({"memory.max": "1073741824\n"}, "no readable cgroup v2 memory.current"),
    ],
)
def test_memory_aware_admission_that_cannot_run_says_so(
    env: Any, tmp_path: Any, files: dict[str, str], why: str
) -> None:
    """Issue 22 item 5: an unparsable memory.max or a missing memory.current left
    memory-aware admission off without the warning docs/broker.md promises. Seen failing
    before the fix: no `memory_aware_admission_off` line."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    broker = BrokerProcess(
        env.binary,
        "--upstream",
        env.server.url,
        "--memory-hard-ratio",
        "0.9",
        "--memory-cgroup",
        str(tmp_path),
        metrics=False,
    )
    assert broker.stop() == 0
    warnings = broker.events("memory_aware_admission_off")
    assert len(warnings) == 1 and why in warnings[0]["why"], broker.lines


class _Counting(http.server.BaseHTTPRequestHandler):
    """Answers 200 and remembers each path it was asked for."""

    paths: list[str] = []

    def do_GET(self) -> None:
        self.paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_the_readiness_probe_runs_only_when_readiness_is_served(env: Any) -> None:
    """Issue 22 item 6: the probe sent the agent `GET /` at start and every idle second even
    without --metrics-listen, when nothing reads its result. Now it runs only with /readyz,
    and asks --readiness-path (by default the agent card, which an A2A agent serves without
    side effects). Seen failing before the fix: the agent saw `GET /` without /readyz."""

    class Handler(_Counting):
        paths: list[str] = []

    agent = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=agent.serve_forever, daemon=True).start()
    upstream = f"http://127.0.0.1:{agent.server_address[1]}"
    try:
        silent = BrokerProcess(env.binary, "--upstream", upstream, metrics=False)
        time.sleep(1.5)
        assert silent.stop() == 0
        assert Handler.paths == []
        probing = BrokerProcess(env.binary, "--upstream", upstream)
        wait_until(lambda: httpx.get(probing.metrics_url + "/readyz").status_code == 200)
        assert probing.stop() == 0
        assert set(Handler.paths) == {"/.well-known/agent-card.json"}
        Handler.paths.clear()
        custom = BrokerProcess(env.binary, "--upstream", upstream, "--readiness-path", "/healthz")
        wait_until(lambda: httpx.get(custom.metrics_url + "/readyz").status_code == 200)
        assert custom.stop() == 0
        assert set(Handler.paths) == {"/healthz"}
    finally:
        agent.shutdown()
        agent.server_close()


def test_sigterm_right_after_start_up_still_drains(env: Any) -> None:
    """The signal handlers are in place before the broker says it listens. Fails before the
    fix: they were installed by a task that had not run yet, and SIGTERM killed the process
    (exit -15) without a drain."""
    for _ in range(5):
        broker = BrokerProcess(env.binary, "--upstream", env.server.url, metrics=False)
        assert broker.stop() == 0


def test_http2_prior_knowledge_on_the_same_port_reaches_an_http1_agent(env: Any) -> None:
    """h2c clients (prior knowledge) on the HTTP/1.1 port: gated and refused alike, and the
    agent (HTTP/1.1 only) gets the :authority as Host."""
    k1, k2 = key(), key()
    a, b = hold(env, k1), hold(env, k2)
    with httpx.Client(base_url=env.broker.url, http1=False, http2=True) as c:
        card = c.get("/.well-known/agent-card.json")
        assert card.http_version == "HTTP/2" and card.status_code == 200
        assert c.get("/echo-headers").json()["host"] == env.broker.address
        refused = c.post(
            "/", json=jsonrpc("SendMessage", send_params("echo no"), rpc_id=9), headers=A2A_HEADERS
        )
        assert refused.http_version == "HTTP/2" and refused.status_code == 429
        assert refused.json()["id"] == 9
    finish(env, (k1, a), (k2, b))
    with httpx.Client(base_url=env.broker.url, http1=False, http2=True) as c:
        ok = c.post("/", json=jsonrpc("SendMessage", send_params("echo yes")), headers=A2A_HEADERS)
        assert ok.status_code == 200 and ok.json()["result"]


def test_a_queued_request_waits_for_a_slot_or_times_out(env: Any) -> None:
    broker = BrokerProcess(
        env.binary,
        "--upstream",
        env.server.url,
        "--max-in-flight",
        "1",
        "--queue-depth",
        "1",
        "--queue-timeout",
        "1.5",
    )
    try:
        k = key()
        results: list[httpx.Response] = []
        holder = threading.Thread(
            target=lambda: results.append(
                httpx.post(
                    broker.url + "/message:send",
                    json=send_params(f"hold {k}"),
                    headers=A2A_HEADERS,
                    timeout=30,
                )
            )
        )
        holder.start()
        wait_until(env.latches[k].started.is_set)
        started = time.monotonic()
        timed_out = httpx.post(
            broker.url + "/message:send", json=send_params("echo late"), headers=A2A_HEADERS
        )
        assert timed_out.status_code == 429
        assert timed_out.headers["admitgate-reason"] == "timeout"
        assert 1.4 < time.monotonic() - started < 5
        waiter: list[httpx.Response] = []
        queued = threading.Thread(
            target=lambda: waiter.append(
                httpx.post(
                    broker.url + "/message:send",
                    json=send_params("echo next"),
                    headers=A2A_HEADERS,
                    timeout=30,
                )
            )
        )
        queued.start()
        broker.wait_for('broker_queued_requests{transport="rest"}', 1)
        env.latches[k].release()
        queued.join(10)
        holder.join(10)
        assert waiter[0].status_code == 200 and results[0].status_code == 200
    finally:
        assert broker.stop() == 0
