"""A usage report sent as an HTTP/2 trailer (``admitgate-usage-tokens`` after the body, as an
agent that learns its usage only at the end of a stream sends it) is settled and removed by the
HTTP middleware on hypercorn and by the broker over h2c, while the other trailers pass.

The client is a raw HTTP/2 connection (the ``h2`` library over a socket): httpx does not show
trailers, and the test must see exactly what reached the client.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from typing import Any

import admitgate
import h2.config
import h2.connection
import h2.events
import pytest
from _attack import HypercornThread
from _broker import BrokerProcess, build_broker
from admitgate.asgi import AdmissionMiddleware

USAGE = b"admitgate-usage-tokens"


async def reporting_app(scope: Any, receive: Any, send: Any) -> None:
    """``POST /message:send`` (an A2A REST send): answers, then reports the usage the
    request's ``x-test-usage`` header asks for in a trailer, beside ``x-kept: 1``."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    usage = dict(scope["headers"]).get(b"x-test-usage", b"0")
    trailers = "http.response.trailers" in scope.get("extensions", {})
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
            "trailers": trailers,
        }
    )
    await send({"type": "http.response.body", "body": b'{"answer":"done"}', "more_body": False})
    if trailers:
        await send(
            {
                "type": "http.response.trailers",
                "headers": [(USAGE, usage), (b"x-kept", b"1")],
                "more_trailers": False,
            }
        )


def h2_post(port: int, headers: dict[str, str]) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    """One POST /message:send over h2c (prior knowledge): the response's headers and trailers."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    body = b'{"message":{"parts":[{"text":"hi"}]}}'
    stream = conn.get_next_available_stream_id()
    conn.send_headers(
        stream,
        [
            (":method", "POST"),
            (":path", "/message:send"),
            (":scheme", "http"),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/json"),
            ("te", "trailers"),
            *headers.items(),
        ],
    )
    conn.send_data(stream, body, end_stream=True)
    sock.sendall(conn.data_to_send())
    head: dict[bytes, bytes] = {}
    trailers: dict[bytes, bytes] = {}
    try:
        while True:
            data = sock.recv(65536)
            assert data, "the connection closed before the stream ended"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    head = dict(event.headers)
                elif isinstance(event, h2.events.TrailersReceived):
                    trailers = dict(event.headers)
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, h2.events.StreamEnded):
                    return head, trailers
                elif isinstance(event, h2.events.StreamReset):
                    raise AssertionError(f"stream reset: {event}")
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()


@pytest.fixture(scope="module")
def agent() -> Iterator[HypercornThread]:
    server = HypercornThread()
    server.start(reporting_app)
    yield server
    server.stop()


def test_the_middleware_settles_and_removes_a_usage_trailer() -> None:
    gate = admitgate.build_admission_gate(
        rate_limit=admitgate.RateLimit(requests="100/min", tokens="10000/min")
    )
    door = AdmissionMiddleware(reporting_app, gate, rate_key="header:x-api-key", cost=100)
    server = HypercornThread()
    server.start(door)
    try:
        head, trailers = h2_post(server.port, {"x-api-key": "k", "x-test-usage": "321"})
        _, malformed = h2_post(server.port, {"x-api-key": "k", "x-test-usage": "3.5"})
    finally:
        server.stop()
    assert head[b":status"] == b"200"
    assert USAGE not in trailers and trailers[b"x-kept"] == b"1"
    assert USAGE not in malformed and malformed[b"x-kept"] == b"1"
    assert door.usage_reports == {"reported": 1, "malformed": 1}
    assert gate.stats()["rate_limits"]["default"]["tokens_settled"] == 321


def test_the_broker_settles_and_removes_a_usage_trailer_over_h2c(agent: HypercornThread) -> None:
    broker = BrokerProcess(
        build_broker(),
        "--upstream",
        agent.url,
        "--upstream-protocol",
        "h2",
        "--max-in-flight",
        "10",
        "--rate-limit",
        "requests=100/min,tokens=10000/min,cost=100",
        "--rate-key",
        "header:x-api-key",
    )
    try:
        port = int(broker.address.rsplit(":", 1)[1])
        key = uuid.uuid4().hex
        head, trailers = h2_post(port, {"x-api-key": key, "x-test-usage": "250"})
        assert head[b":status"] == b"200"
        assert USAGE not in trailers and trailers[b"x-kept"] == b"1"
        metrics = broker.metrics()
        assert metrics['broker_rate_limit_usage_reports_total{outcome="settled"}'] == 1
        assert metrics['broker_rate_limit_tokens_settled_total{limit="agent:default"}'] == 250
    finally:
        assert broker.stop() == 0
