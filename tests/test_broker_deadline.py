"""The broker takes the caller's deadline, as the in-process front doors do: Envoy's
``x-envoy-expected-rq-timeout-ms`` on HTTP, ``grpc-timeout`` on gRPC (grpcio's ``timeout=``).
Real servers on loopback: the A2A SDK app on uvicorn (behind the broker, and behind the
in-process ``AdmissionMiddleware`` for the differential test), a grpc.aio A2A server, the
broker binary; clients are httpx, grpcio and raw sockets (to send header bytes exactly).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import _broker
import grpc
import httpx
import pytest
from _a2a_app import (
    A2A_HEADERS,
    ControlledExecutor,
    Latches,
    ServerThread,
    build_sdk_app,
    jsonrpc,
    send_params,
)
from _broker import BrokerProcess, build_broker, key
from _grpc_a2a import A2AServer, LoopThread, user_message
from a2a.types import a2a_pb2_grpc
from admitgate import build_admission_gate
from admitgate._frontdoor import header_deadline_s
from admitgate.asgi import AdmissionMiddleware
from google.rpc import error_details_pb2, status_pb2

BUSY = "Busy right now \u2014 please resend in a moment."
ENVOY = b"x-envoy-expected-rq-timeout-ms"
#: The queue timeout of the differential test's doors: a parsed deadline below it is refused
#: with ``deadline`` first, an ignored one (or a longer one) with ``timeout``.
DIFF_TIMEOUT_S = 0.3


class Recorder:
    """ASGI wrapper: remembers the headers of every request the agent receives."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, dict[bytes, bytes]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["path"], dict(scope["headers"])))
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def env() -> Iterator[types.SimpleNamespace]:
    """The SDK app on uvicorn twice (bare, for the brokers; behind the in-process middleware,
    for the differential test) and the gRPC A2A server, sharing one executor."""
    binary = build_broker()
    latches = Latches()
    executor = ControlledExecutor(latches)
    agent = ServerThread()
    recorder = Recorder(build_sdk_app(executor, agent.url))
    agent.start(recorder)
    door = ServerThread()
    door_gate = build_admission_gate(
        max_concurrent_runs=1, queue_depth=512, queue_timeout_s=DIFF_TIMEOUT_S
    )
    door.start(AdmissionMiddleware(build_sdk_app(executor, door.url), door_gate))
    loop = LoopThread()
    grpc_server = A2AServer([])
    loop.run(grpc_server.start())
    yield types.SimpleNamespace(
        binary=binary,
        latches=latches,
        executor=executor,
        agent=agent,
        recorder=recorder,
        door=door,
        door_gate=door_gate,
        grpc=grpc_server,
        loop=loop,
    )
    latches.release_all()
    loop.run(_release_all(grpc_server))
    loop.run(grpc_server.stop())
    loop.close()
    door.stop()
    agent.stop()


async def _release_all(server: A2AServer) -> None:
    server.executor.release_all()


def wait_until(condition: Any, timeout: float = 10.0) -> None:
    _broker.wait_until(condition, timeout)  # this file's waits allow 10 s


def hold(env: Any, url: str, k: str) -> threading.Thread:
    """A blocking REST SendMessage ``hold k`` to ``url`` on a thread; returns once it runs."""
    results: list[httpx.Response] = []

    def call() -> None:
        results.append(
            httpx.post(
                url + "/message:send",
                json=send_params(f"hold {k}"),
                headers=A2A_HEADERS,
                timeout=30,
            )
        )

    thread = threading.Thread(target=call, daemon=True)
    thread.results = results  # type: ignore[attr-defined]
    thread.start()
    wait_until(env.latches[k].started.is_set)
    return thread


def http_broker(env: Any, *flags: str) -> BrokerProcess:
    return BrokerProcess(env.binary, "--upstream", env.agent.url, *flags)


# -- HTTP ---------------------------------------------------------------------------------------


def test_a_queued_request_whose_deadline_passes_is_refused_before_the_agent_sees_it(
    env: Any,
) -> None:
    broker = http_broker(env, "--max-in-flight", "1", "--queue-depth", "4", "--queue-timeout", "10")
    try:
        k = key()
        holder = hold(env, broker.url, k)
        executions = env.executor.executions
        started = time.monotonic()
        late = httpx.post(
            broker.url + "/message:send",
            json=send_params("echo late"),
            headers={**A2A_HEADERS, ENVOY.decode(): "300"},
            timeout=10,
        )
        waited = time.monotonic() - started
        assert late.status_code == 504, late.text
        assert late.headers["admitgate-reason"] == "deadline"
        error = late.json()["error"]
        assert (error["code"], error["status"], error["message"]) == (
            504,
            "DEADLINE_EXCEEDED",
            BUSY,
        )
        assert error["details"][0]["reason"] == "DEADLINE"
        assert "retry-after" not in late.headers and len(error["details"]) == 1
        assert 0.28 < waited < 5, waited
        # A deadline already passed, on a request that would queue: refused at once, with
        # the JSON-RPC id echoed.
        now = httpx.post(
            broker.url + "/",
            json=jsonrpc("SendMessage", send_params("echo now"), rpc_id=41),
            headers={**A2A_HEADERS, ENVOY.decode(): "0"},
            timeout=10,
        )
        assert now.status_code == 504 and now.headers["admitgate-reason"] == "deadline"
        assert now.json()["id"] == 41
        assert now.json()["error"]["data"] == {"reason": "deadline", "retryAfter": None}
        assert "retry-after" not in now.headers
        assert env.executor.executions == executions  # neither reached the agent
        # An ample deadline waits for its slot and runs; the agent sees what is left of it.
        ample: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: ample.append(
                httpx.post(
                    broker.url + "/message:send",
                    json=send_params("echo ample"),
                    headers={**A2A_HEADERS, ENVOY.decode(): "30000"},
                    timeout=30,
                )
            )
        )
        waiter.start()
        broker.wait_for('broker_queued_requests{transport="rest"}', 1)
        time.sleep(0.2)
        env.latches[k].release()
        waiter.join(10)
        holder.join(10)
        assert ample[0].status_code == 200 and holder.results[0].status_code == 200  # type: ignore[attr-defined]
        forwarded = [headers for path, headers in env.recorder.seen if path == "/message:send"][-1]
        left = int(forwarded[ENVOY])
        assert 20_000 < left <= 29_800, left
        broker.wait_for("broker_gate_in_flight", 0)
        m = broker.metrics()
        assert m['broker_rejected_reason_total{transport="rest",reason="deadline"}'] == 1
        assert m['broker_rejected_reason_total{transport="jsonrpc",reason="deadline"}'] == 1
        for transport in ("rest", "jsonrpc"):
            by_reason = sum(
                v
                for name, v in m.items()
                if name.startswith(f'broker_rejected_reason_total{{transport="{transport}"')
            )
            assert m[f'broker_rejected_total{{transport="{transport}"}}'] == by_reason == 1
        assert m['broker_admitted_total{transport="rest"}'] == 2
        assert m['broker_queued_requests{transport="rest"}'] == 0
    finally:
        env.latches.release_all()
        assert broker.stop() == 0


# -- the differential test: the broker and the in-process middleware on the same bytes -------


def _generated_requests(rng: random.Random, n: int) -> list[list[tuple[bytes, bytes]]]:
    """Deadline header lines near the rule's edges: digits with leading zeros up to 12 long
    (the rule allows 10), a byte inserted or replaced, whitespace around or inside, other
    spellings of the name, a second header after the first. Valid values are either far
    below the queue timeout or far above it, so the outcome never hangs on timing."""
    numbers = [0, 1, 7, 42, 99, 1000, 65_000, 9_999_999_999, 10**11]
    junk = [b" ", b"\t", b"+", b"-", b".", b"e", b"x", b"0x", "\u0663".encode(), b"\xff", b"\xb2"]
    names = [
        ENVOY,
        ENVOY,
        ENVOY,
        b"X-Envoy-Expected-Rq-Timeout-Ms",
        b"X-ENVOY-EXPECTED-RQ-TIMEOUT-MS",
    ]
    requests = []
    for _ in range(n):
        value = str(rng.choice(numbers)).zfill(rng.choice([0, 0, 2, 5, 9, 10, 11, 12])).encode()
        shape = rng.random()
        if shape < 0.15 and value:
            at = rng.randrange(len(value) + 1)
            value = value[:at] + rng.choice(junk) + value[at:]
        elif shape < 0.3 and value:
            at = rng.randrange(len(value))
            value = value[:at] + rng.choice(junk) + value[at + 1 :]
        elif shape < 0.4:
            value = rng.choice([b" ", b"\t", b"  "]) + value
        elif shape < 0.5:
            value = value + rng.choice([b" ", b"\t", b"  "])
        elif shape < 0.55:
            value = b""
        lines = [(rng.choice(names), value)]
        if rng.random() < 0.2:
            lines.append((ENVOY, rng.choice([b"0", b"5000", b"x"])))
        requests.append(lines)
    return requests


async def _raw_post(
    address: str, path: bytes, lines: list[tuple[bytes, bytes]], body: bytes
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One HTTP/1.1 request with ``lines`` as extra header lines, bytes as given."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" % path
    head += b"A2A-Version: 1.0\r\nConnection: close\r\nContent-Length: %d\r\n" % len(body)
    for name, value in lines:
        head += name + b": " + value + b"\r\n"
    writer.write(head + b"\r\n" + body)
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    response, _, content = data.partition(b"\r\n\r\n")
    status_line, *header_lines = response.split(b"\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, content


def _door_address(door: ServerThread) -> str:
    return door.url.removeprefix("http://")


def test_the_broker_reads_the_deadline_header_as_the_middleware_does(env: Any) -> None:
    """For generated header lines, the broker and ``AdmissionMiddleware`` (each holding its
    one slot, so every request queues) refuse alike: ``deadline`` when the header was read
    (and its deadline is the sooner), ``timeout`` when it was ignored. Fails before the fix:
    the broker ignored the header, so every request timed out."""
    broker = http_broker(
        env,
        "--max-in-flight",
        "1",
        "--queue-depth",
        "512",
        "--queue-timeout",
        str(DIFF_TIMEOUT_S),
    )
    k_broker, k_door = key(), key()
    holders = [hold(env, broker.url, k_broker), hold(env, env.door.url, k_door)]
    requests = _generated_requests(random.Random(20261201), 150)
    body = json.dumps(send_params("echo never")).encode()

    async def both() -> list[tuple[Any, Any]]:
        async def one(address: str, lines: list[tuple[bytes, bytes]]) -> Any:
            status, headers, _ = await _raw_post(address, b"/message:send", lines, body)
            return status, headers.get(b"admitgate-reason")

        broker_side = [one(broker.address, lines) for lines in requests]
        door_side = [one(_door_address(env.door), lines) for lines in requests]
        results = await asyncio.gather(*broker_side, *door_side)
        return list(zip(results[: len(requests)], results[len(requests) :], strict=True))

    try:
        before = env.door_gate.transport_stats().get("rest", {}).get("rejected", {})
        outcomes = asyncio.run(both())
        differences = [
            (lines, b, d) for lines, (b, d) in zip(requests, outcomes, strict=True) if b != d
        ]
        assert not differences, differences[:5]
        kinds = {b for b, _ in outcomes}
        assert kinds == {(504, b"deadline"), (429, b"timeout")}, kinds
        # Lines without whitespace at their ends reach the rule as sent: its answer too.
        for lines, (outcome, _) in zip(requests, outcomes, strict=True):
            value = lines[0][1]
            if value == value.strip(b" \t"):
                parsed = header_deadline_s([(ENVOY, value)])
                expected = parsed is not None and parsed < DIFF_TIMEOUT_S
                assert (outcome[1] == b"deadline") == expected, lines
        deadlines = sum(1 for b, _ in outcomes if b[1] == b"deadline")
        m = broker.metrics()
        assert m['broker_rejected_reason_total{transport="rest",reason="deadline"}'] == deadlines
        assert (
            m['broker_rejected_reason_total{transport="rest",reason="timeout"}']
            == len(requests) - deadlines
        )
        after = env.door_gate.transport_stats()["rest"]["rejected"]
        assert after.get("deadline", 0) - before.get("deadline", 0) == deadlines
        # The answers themselves, byte for byte, where they carry no time-dependent hint.
        for path, payload in (
            (b"/message:send", body),
            (
                b"/",
                json.dumps(
                    jsonrpc("SendMessage", send_params("echo x"), rpc_id="r\u00e9")
                ).encode(),
            ),
        ):

            async def pair(path: bytes = path, payload: bytes = payload) -> Any:
                lines = [(ENVOY, b"0")]
                return await asyncio.gather(
                    _raw_post(broker.address, path, lines, payload),
                    _raw_post(_door_address(env.door), path, lines, payload),
                )

            (bs, bh, bb), (ds, dh, db) = asyncio.run(pair())
            assert (bs, bb) == (ds, db) == (504, db), (bb, db)
            for name in (b"content-type", b"admitgate-reason", b"content-length"):
                assert bh[name] == dh[name], name
            assert b"retry-after" not in bh and b"retry-after" not in dh
    finally:
        env.latches[k_broker].release()
        env.latches[k_door].release()
        for thread in holders:
            thread.join(10)
        assert broker.stop() == 0


# -- gRPC ---------------------------------------------------------------------------------------


def test_grpc_calls_are_refused_when_they_would_queue_past_their_deadline(env: Any) -> None:
    """grpcio's ``timeout=`` (``grpc-timeout`` on the wire): a call that cannot be served in
    time is refused by the broker with DEADLINE_EXCEEDED and the reason trailer, at once or
    while it waits, before the client's own deadline; one with time to spare runs."""
    broker = BrokerProcess(
        env.binary,
        "--upstream",
        env.agent.url,
        "--grpc-upstream",
        f"http://{env.grpc.target}",
        "--max-in-flight",
        "1",
        "--queue-depth",
        "4",
        "--queue-timeout",
        "10",
    )
    executor = env.grpc.executor

    async def refused_by_broker(stub: Any, timeout: float) -> tuple[Any, float]:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SendMessage(user_message("no"), timeout=timeout)
        return caught.value, time.monotonic() - started

    async def main() -> None:
        async with grpc.aio.insecure_channel(broker.address) as channel:
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            # A timed turn of about 0.4 s teaches the broker the service time.
            first = asyncio.ensure_future(stub.SendMessage(user_message("hold:t1"), timeout=10))
            await executor.started("t1")
            await asyncio.sleep(0.4)
            executor.release("t1")
            await first
            held = asyncio.ensure_future(stub.SendMessage(user_message("hold:t2"), timeout=10))
            await executor.started("t2")
            # 0.2 s left, less than a turn takes: refused at once.
            error, waited = await refused_by_broker(stub, 0.2)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert error.details() == BUSY
            trailers = dict(error.trailing_metadata() or ())
            assert trailers["admitgate-reason"] == "deadline"
            assert "grpc-retry-pushback-ms" not in trailers
            status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
            info = error_details_pb2.ErrorInfo()
            assert status.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            assert status.details[0].Unpack(info) and info.reason == "DEADLINE"
            assert waited < 0.15, waited
            # 1.2 s left: it queues, and is refused once less than a turn is left (about
            # 0.4 s before the client would give up itself).
            error, waited = await refused_by_broker(stub, 1.2)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert dict(error.trailing_metadata() or ())["admitgate-reason"] == "deadline"
            assert 0.5 < waited < 1.1, waited
            # Time to spare: it waits for the slot and runs.
            spare = asyncio.ensure_future(stub.SendMessage(user_message("echo"), timeout=20))
            await asyncio.to_thread(broker.wait_for, 'broker_queued_requests{transport="grpc"}', 1)
            executor.release("t2")
            await held
            assert (await spare).message.parts[0].text == "echo:echo"

    try:
        env.loop.run(main(), timeout=30)
        broker.wait_for('broker_inflight_requests{transport="grpc"}', 0)
        m = broker.metrics()
        assert m['broker_rejected_reason_total{transport="grpc",reason="deadline"}'] == 2
        assert m['broker_rejected_total{transport="grpc"}'] == 2
        assert m['broker_admitted_total{transport="grpc"}'] == 3
    finally:
        env.loop.run(_release_all(env.grpc))
        assert broker.stop() == 0


# -- the fleet lease ----------------------------------------------------------------------------


def test_a_wait_for_the_fleet_lease_ends_at_the_deadline(env: Any, redis_server: Any) -> None:
    """Two brokers on one fleet of one: the second holds its local slot and waits for the
    lease; its deadline ends that wait with ``deadline``, not the queue timeout."""
    fleet = ("--fleet", redis_server.url, "--fleet-key", f"deadline:{uuid.uuid4().hex[:8]}")
    queue = ("--max-in-flight", "1", "--queue-depth", "4", "--queue-timeout", "10")
    a = http_broker(env, *queue, *fleet)
    b = http_broker(env, *queue, *fleet)
    try:
        k = key()
        holder = hold(env, a.url, k)
        started = time.monotonic()
        late = httpx.post(
            b.url + "/message:send",
            json=send_params("echo late"),
            headers={**A2A_HEADERS, ENVOY.decode(): "300"},
            timeout=15,
        )
        waited = time.monotonic() - started
        assert late.status_code == 504 and late.headers["admitgate-reason"] == "deadline"
        assert "retry-after" not in late.headers
        assert 0.28 < waited < 5, waited
        ample: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: ample.append(
                httpx.post(
                    b.url + "/message:send",
                    json=send_params("echo ample"),
                    headers={**A2A_HEADERS, ENVOY.decode(): "30000"},
                    timeout=30,
                )
            )
        )
        waiter.start()
        # A turn waiting for its lease is not in broker_queued_requests (the passage counts
        # only the local queue there), so the test gives it time to be waiting instead.
        time.sleep(0.5)
        assert not ample
        env.latches[k].release()
        waiter.join(15)
        holder.join(10)
        assert ample[0].status_code == 200
        m = b.metrics()
        assert m['broker_rejected_reason_total{transport="rest",reason="deadline"}'] == 1
        assert m['broker_rejected_total{transport="rest"}'] == 1
        assert m['broker_admitted_total{transport="rest"}'] == 1
    finally:
        env.latches.release_all()
        assert a.stop() == 0
        assert b.stop() == 0
