"""Every request a client can send, through the broker: gated work stays gated whatever its
headers say.

The real A2A SDK app, with an executor that counts its concurrent executions
(``_attack.CountingExecutor``), served by uvicorn (HTTP/1.1) and by hypercorn (HTTP/1.1 and
h2c on one port), each behind its own broker at ``--max-in-flight 1``. The clients are raw
sockets (and httpx over h2c), as an attacker's would be.

First the regressions of issue 22 (one header walked work past the gate), then a generated
suite (hypothesis, seeded, bounded): every gated route (JSON-RPC 1.0 and v0.3 names, REST
1.0 and v0.3, tenant forms, gRPC method paths), with every header a client controls
perturbed (``Connection``/``Upgrade``, ``content-type``, ``Transfer-Encoding``, ``TE``,
``Expect``, ``Host``, absolute-form targets, HTTP/1.0, pipelining) and bodies split at every
boundary of the peek. Invariants, checked at the agent and the broker's metrics: executions
at the agent never exceed the cap; every execution was counted as admitted; every refusal is
a documented one. Last, HTTP/1.1 requests and h2c connections cut inside, at and around the
24 bytes the broker reads to tell the protocols apart (and dripped a byte at a time across
them): each runs exactly once.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _a2a_app import ServerThread, build_sdk_app, jsonrpc, send_params
from _attack import (
    DOCUMENTED_REASONS,
    CountingExecutor,
    HypercornThread,
    RawResponse,
    h2c_post_headers,
    raw_exchange,
    read_response,
    request_bytes,
)
from _broker import BrokerProcess, build_broker, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

#: The brokers' peek: short, so generated bodies end before, at and after it.
PEEK = 160


@pytest.fixture(scope="module")
def env() -> Iterator[types.SimpleNamespace]:
    """The SDK app on uvicorn and on hypercorn, each behind a broker at cap 1, no queue."""
    binary = build_broker()
    uv_executor = CountingExecutor()
    uv = ServerThread()
    uv.start(build_sdk_app(uv_executor, uv.url))
    hc_executor = CountingExecutor()
    hc = HypercornThread()
    hc.start(build_sdk_app(hc_executor, hc.url))
    common = ("--max-in-flight", "1", "--max-peek-bytes", str(PEEK), "--first-bytes-timeout", "1")
    brokers = {
        "uvicorn": BrokerProcess(binary, "--upstream", uv.url, *common),
        # gRPC goes to --upstream over h2c (the default --grpc-upstream): hypercorn speaks it.
        "hypercorn": BrokerProcess(binary, "--upstream", hc.url, *common),
        "hypercorn-h2": BrokerProcess(
            binary, "--upstream", hc.url, "--upstream-protocol", "h2", *common
        ),
    }
    yield types.SimpleNamespace(
        binary=binary,
        uvicorn=uv,
        hypercorn=hc,
        executors={"uvicorn": uv_executor, "hypercorn": hc_executor, "hypercorn-h2": hc_executor},
        brokers=brokers,
    )
    for broker in brokers.values():
        broker.stop()
    hc.stop()
    uv.stop()


def _send_body(text: str, *, rpc: str | None = "SendMessage") -> bytes:
    if rpc is None:
        return json.dumps(send_params(text)).encode()
    return json.dumps(jsonrpc(rpc, send_params(text), rpc_id=uuid.uuid4().hex[:8])).encode()


def _refusal_is_documented(response: RawResponse) -> bool:
    return response.headers.get("admitgate-reason") in DOCUMENTED_REASONS


def _concurrently(count: int, send: Any) -> list[RawResponse]:
    """``send()`` from ``count`` threads at once; their responses."""
    results: list[RawResponse] = []
    lock = threading.Lock()
    barrier = threading.Barrier(count)

    def one() -> None:
        barrier.wait()
        response = send()
        with lock:
            results.append(response)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def _settle(env: Any, name: str) -> None:
    """Waits until nothing runs at the agent nor holds a slot at the broker."""
    executor, broker = env.executors[name], env.brokers[name]
    wait_until(lambda: executor.running == 0, timeout=15)
    broker.wait_for("broker_gate_in_flight", 0, timeout=15)


# -- regressions (issue 22) ---------------------------------------------------------------------


@pytest.mark.parametrize("target", ["/", "/message:send"])
def test_an_upgrade_header_does_not_walk_work_past_the_gate(env: Any, target: str) -> None:
    """Item 1: `Connection: upgrade` with any `Upgrade` but h2c used to be forwarded ungated
    (uvicorn serves it as a plain request, so the SDK ran it): four at once at cap 1. Seen
    failing before the fix: peak 4, all 200."""
    executor, broker = env.executors["uvicorn"], env.brokers["uvicorn"]
    _settle(env, "uvicorn")
    executor.reset()
    rpc = "SendMessage" if target == "/" else None
    body = _send_body("sleep 0.6", rpc=rpc)
    request = request_bytes(
        "POST",
        target,
        [
            ("Host", "agent"),
            ("Connection", "Upgrade"),
            # Any protocol but h2c (uvicorn answers a websocket one as a WebSocket handshake;
            # this one it logs as unsupported and serves as a plain request).
            ("Upgrade", "foo/1"),
            ("Content-Type", "application/json"),
            ("A2A-Version", "1.0"),
            ("Content-Length", str(len(body))),
        ],
        body,
    )
    responses = _concurrently(4, lambda: raw_exchange(broker.address, [request]))
    _settle(env, "uvicorn")
    assert executor.peak == 1, executor.peak
    statuses = sorted(r.status for r in responses)
    assert statuses == [200, 429, 429, 429], statuses
    assert all(_refusal_is_documented(r) for r in responses if r.status == 429)


@pytest.mark.parametrize("target", ["/", "/message:send"])
def test_a_grpc_content_type_does_not_exempt_work(env: Any, target: str) -> None:
    """Item 2: `content-type: application/grpc` on `POST /message:send` (or a JSON-RPC send)
    made it "gRPC to a non-A2A method", forwarded ungated to the gRPC upstream (the agent
    over h2c), which routes by path and ran it: four at once at cap 1. Seen failing before
    the fix: peak 4."""
    executor, broker = env.executors["hypercorn"], env.brokers["hypercorn"]
    _settle(env, "hypercorn")
    executor.reset()
    rpc = "SendMessage" if target == "/" else None
    body = _send_body("sleep 0.6", rpc=rpc)
    request = request_bytes(
        "POST",
        target,
        [
            # The agent's own address: a Host the h2c agent accepts whatever the broker does
            # with :authority (item 3 is tested on its own).
            ("Host", env.hypercorn.url.removeprefix("http://")),
            ("Content-Type", "application/grpc+json"),
            ("A2A-Version", "1.0"),
            ("Content-Length", str(len(body))),
        ],
        body,
    )
    responses = _concurrently(4, lambda: raw_exchange(broker.address, [request]))
    _settle(env, "hypercorn")
    assert executor.peak <= 1, executor.peak
    refused = [r for r in responses if r.headers.get("admitgate-reason")]
    assert len(refused) >= 3, [(r.status, r.headers) for r in responses]
    assert all(_refusal_is_documented(r) for r in refused)


# -- the generated suite ------------------------------------------------------------------------


#: Every gated route: (target, JSON-RPC method or None for REST, content-type family).
GATED = [
    ("/", "SendMessage"),
    ("/", "SendStreamingMessage"),
    ("/", "message/send"),
    ("/", "message/stream"),
    ("/message:send", None),
    ("/message:stream", None),
    ("/v1/message:send", None),
    ("/acme/message:send", None),
    ("/acme/message:stream", None),
    ("/lf.a2a.v1.A2AService/SendMessage", None),
    ("/a2a.v1.A2AService/SendStreamingMessage", None),
]


@st.composite
def attacks(draw: Any) -> dict[str, Any]:
    """One request as a client may shape it, sent by three clients at once."""
    target, rpc = draw(st.sampled_from(GATED))
    return {
        "target": target,
        "rpc": rpc,
        "server": draw(st.sampled_from(["uvicorn", "hypercorn", "hypercorn-h2"])),
        "h2": draw(st.booleans()),
        "version": draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0"])),
        "upgrade": draw(st.sampled_from([None, "websocket", "h2c", "foo/1", "websocket, h2c"])),
        "connection": draw(st.sampled_from([None, "keep-alive", "close", "te", "x-hop"])),
        "content_type": draw(
            st.sampled_from(
                [
                    "application/json",
                    "application/grpc",
                    "application/grpc+json",
                    "APPLICATION/GRPC",
                    "text/plain",
                    "application/a2a+json",
                    None,
                ]
            )
        ),
        "chunked": draw(st.booleans()),
        "te": draw(st.sampled_from([None, "trailers", "gzip"])),
        "expect": draw(st.booleans()),
        "host": draw(st.sampled_from(["agent", "agent-address", None, "evil:1"])),
        "absolute": draw(st.booleans()),
        "pad": draw(st.sampled_from([0, PEEK // 2, PEEK, PEEK * 3])),
        "split": draw(st.sampled_from([None, -1, 0, 1, "head"])),
        "pipelined": draw(st.booleans()),
    }


def _attack_bytes(plan: dict[str, Any], agent: str) -> tuple[list[bytes], int]:
    """The request's bytes, in the pieces they are sent in, and how many requests they
    hold."""
    params = send_params("sleep 0.15")
    if plan["pad"]:
        params["metadata"] = {"pad": "p" * plan["pad"]}
    if plan["rpc"]:
        body = json.dumps(jsonrpc(plan["rpc"], params, rpc_id=uuid.uuid4().hex[:6])).encode()
    else:
        body = json.dumps(params).encode()
    headers: list[tuple[str, str]] = []
    host = {"agent": "agent", "agent-address": agent, None: None, "evil:1": "evil:1"}[plan["host"]]
    if host is not None:
        headers.append(("Host", host))
    connection = [c for c in (plan["connection"],) if c]
    if plan["upgrade"]:
        connection.append("Upgrade")
        headers.append(("Upgrade", plan["upgrade"]))
    if connection:
        headers.append(("Connection", ", ".join(connection)))
    if plan["connection"] == "x-hop":
        headers.append(("x-hop", "1"))
    if plan["content_type"]:
        headers.append(("Content-Type", plan["content_type"]))
    if plan["te"]:
        headers.append(("TE", plan["te"]))
    if plan["expect"]:
        headers.append(("Expect", "100-continue"))
    headers.append(("A2A-Version", "1.0"))
    if plan["chunked"] and plan["version"] == "HTTP/1.1":
        headers.append(("Transfer-Encoding", "chunked"))
        cut = min(PEEK, len(body))
        wire = b"".join(
            f"{len(part):x}\r\n".encode() + part + b"\r\n"
            for part in (body[:cut], body[cut:])
            if part
        )
        wire += b"0\r\n\r\n"
    else:
        headers.append(("Content-Length", str(len(body))))
        wire = body
    target = f"http://{host or 'agent'}{plan['target']}" if plan["absolute"] else plan["target"]
    head = f"POST {target} {plan['version']}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    message = head.encode("latin-1") + b"\r\n" + wire
    count = 1
    if plan["pipelined"] and plan["version"] == "HTTP/1.1" and plan["connection"] != "close":
        message += message
        count = 2
    split = plan["split"]
    if split is None:
        return [message], count
    at = len(head) + 2 if split == "head" else len(head) + 2 + PEEK + split
    at = max(1, min(at, len(message) - 1))
    return [message[:at], message[at:]], count


def _read_all(address: str, pieces: list[bytes], count: int) -> list[Any]:
    """Sends ``pieces`` 50 ms apart on one connection and reads ``count`` responses."""
    host, port = address.rsplit(":", 1)
    responses = []
    pending = bytearray()
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        for i, piece in enumerate(pieces):
            if i:
                time.sleep(0.05)
            sock.sendall(piece)
        for _ in range(count):
            try:
                response = read_response(sock, pending)
            except OSError:
                break
            responses.append(response)
            if not response.status:
                break
    return responses


def _h2_send(url: str, plan: dict[str, Any]) -> list[Any]:
    """The plan's request over h2c (prior knowledge), with the headers h2 allows."""
    params = send_params("sleep 0.15")
    if plan["rpc"]:
        content = json.dumps(jsonrpc(plan["rpc"], params)).encode()
    else:
        content = json.dumps(params).encode()
    headers = {"A2A-Version": "1.0"}
    if plan["content_type"]:
        headers["Content-Type"] = plan["content_type"]
    if plan["te"] == "trailers":
        headers["TE"] = "trailers"
    with httpx.Client(http1=False, http2=True, timeout=20) as client:
        response = client.post(url + plan["target"], content=content, headers=headers)
    return [RawResponse(response.status_code, dict(response.headers), response.content)]


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=attacks())
def test_no_request_shape_runs_more_than_the_cap(env: Any, plan: dict[str, Any]) -> None:
    """Generated: any route, any header a client controls, any split, three clients at
    once. Invariants: the agent never runs more than the cap; every execution was counted
    as admitted by the broker; every refusal is a documented one; every request is
    answered (a pipelined one may go unanswered only after an answer that said
    `Connection: close`)."""
    name = plan["server"]
    executor = env.executors[name]
    broker = env.brokers[name]
    agent = (env.uvicorn if name == "uvicorn" else env.hypercorn).url.removeprefix("http://")
    wait_until(lambda: executor.running == 0, timeout=15)
    broker.wait_for("broker_gate_in_flight", 0, timeout=15)
    executor.reset()
    admitted_before = _counter_sum(broker, "broker_admitted_total")
    if plan["h2"]:
        send = lambda: _h2_send(broker.url, plan)  # noqa: E731
    else:
        pieces, count = _attack_bytes(plan, agent)
        send = lambda: _read_all(broker.address, pieces, count)  # noqa: E731
    batches = _concurrently(3, send)
    wait_until(lambda: executor.running == 0, timeout=15)
    broker.wait_for("broker_gate_in_flight", 0, timeout=15)
    assert executor.peak <= 1, (plan, executor.peak)
    admitted = _counter_sum(broker, "broker_admitted_total") - admitted_before
    assert executor.executions <= admitted, (plan, executor.executions, admitted)
    for responses in batches:
        # Every request is answered, unless an answer said the connection closes after it.
        answered = [r for r in responses if r.status]
        if plan["h2"] or not (plan["pipelined"] and len(answered) < len(responses)):
            assert answered, (plan, responses)
        else:
            assert answered[-1].headers.get("connection", "").lower() == "close", (plan, responses)
        for response in responses:
            reason = response.headers.get("admitgate-reason")
            if reason is not None or response.status in (429, 503, 504):
                assert reason in DOCUMENTED_REASONS, (plan, response)


def _counter_sum(broker: BrokerProcess, name: str) -> float:
    return sum(v for k, v in broker.metrics().items() if k.startswith(name + "{"))


# -- the protocol sniff -------------------------------------------------------------------------

#: The broker tells HTTP/1.1 from h2c by the first 24 bytes (the HTTP/2 preface's length), then
#: hands them back to the parser before the rest (``server/io.rs``, ``ClientIo``).
SNIFF = 24

#: Where a client may cut its first bytes: inside, at and just past the sniff, and a drip of
#: one byte at a time across it.
SNIFF_CUTS = [[1], [SNIFF - 1], [SNIFF], [SNIFF + 1], [SNIFF, SNIFF + 1], list(range(1, 31))]


def _pieces(message: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *cuts, len(message)]
    return [message[a:b] for a, b in zip(edges, edges[1:], strict=False)]


@pytest.mark.parametrize(
    "cuts", SNIFF_CUTS, ids=lambda c: "-".join(map(str, c[:3])) + "..."[: 3 * (len(c) > 3)]
)
def test_an_http1_request_cut_anywhere_around_the_sniff_runs_once(
    env: Any, cuts: list[int]
) -> None:
    """A request whose first bytes come in pieces, 10 ms apart, cut at every place the sniff
    and its replay could mishandle: answered 200, run exactly once at the agent, within the
    cap."""
    executor, broker = env.executors["uvicorn"], env.brokers["uvicorn"]
    _settle(env, "uvicorn")
    executor.reset()
    body = _send_body("sleep 0.05")
    request = request_bytes(
        "POST",
        "/",
        [
            ("Host", "agent"),
            ("Content-Type", "application/json"),
            ("A2A-Version", "1.0"),
            ("Content-Length", str(len(body))),
        ],
        body,
    )
    response = raw_exchange(broker.address, _pieces(request, cuts), pause=0.01)
    _settle(env, "uvicorn")
    assert response.status == 200, response
    assert executor.executions == 1 and executor.peak == 1, (executor.executions, executor.peak)


@pytest.mark.parametrize(
    "cuts", SNIFF_CUTS, ids=lambda c: "-".join(map(str, c[:3])) + "..."[: 3 * (len(c) > 3)]
)
def test_an_h2c_connection_cut_anywhere_in_its_preface_runs_once(env: Any, cuts: list[int]) -> None:
    """The same over h2c with prior knowledge: the client's preface and first frames cut inside
    and around the 24-byte preface. Answered 200, run exactly once, within the cap."""
    import h2.events

    executor, broker = env.executors["uvicorn"], env.brokers["uvicorn"]
    _settle(env, "uvicorn")
    executor.reset()
    body = _send_body("sleep 0.05")
    conn = h2c_post_headers(body)
    conn.send_data(1, body, end_stream=True)
    host, port = broker.address.rsplit(":", 1)
    status = None
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        for i, piece in enumerate(_pieces(conn.data_to_send(), cuts)):
            if i:
                time.sleep(0.01)
            sock.sendall(piece)
        ended = False
        while not ended:
            data = sock.recv(65536)
            assert data, "the broker closed the connection before the response ended"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = dict(event.headers)[b":status"]
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    ended = True
            sock.sendall(conn.data_to_send())
    _settle(env, "uvicorn")
    assert status == b"200", status
    assert executor.executions == 1 and executor.peak == 1, (executor.executions, executor.peak)
