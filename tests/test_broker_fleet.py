"""The broker's policy beyond one cap, and its upstream connections: two brokers on one Redis
share the cap exactly, a per-tenant cap, a gRPC stream the upstream breaks off ends with a
status, custom trailing metadata passes, and no 502 from an upstream with a 1 s keep-alive.

Real servers on loopback: redis-server (the session's), uvicorn, grpc.aio (in a child process
where the test kills it mid-stream).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import uvicorn
from _a2a_app import (
    A2A_HEADERS,
    ControlledExecutor,
    Latches,
    ServerThread,
    build_sdk_app,
    send_params,
)
from _broker import BrokerProcess, build_broker, wait_until


@pytest.fixture(scope="module")
def env() -> Iterator[types.SimpleNamespace]:
    latches = Latches()
    executor = ControlledExecutor(latches)
    server = ServerThread()
    server.start(build_sdk_app(executor, server.url))
    yield types.SimpleNamespace(
        latches=latches, executor=executor, server=server, binary=build_broker()
    )
    latches.release_all()
    server.stop()


def post_hold(url: str, k: str, results: list[int], headers: dict[str, str] | None = None) -> None:
    response = httpx.post(
        url + "/message:send",
        json=send_params(f"hold {k}"),
        headers={**A2A_HEADERS, **(headers or {})},
        timeout=30,
    )
    results.append(response.status_code)


def test_two_brokers_on_one_redis_share_the_cap_exactly(env: Any, redis_server: Any) -> None:
    fleet_key = f"broker-test:{uuid.uuid4().hex[:8]}"
    common = ("--upstream", env.server.url, "--max-in-flight", "3", "--fleet", redis_server.url)
    a = BrokerProcess(env.binary, *common, "--fleet-key", fleet_key)
    # The second broker is `python -m admitgate broker` (in-process): one cap for both kinds.
    b = BrokerProcess(
        sys.executable, *common, "--fleet-key", fleet_key, prefix=["-m", "admitgate", "broker"]
    )
    try:
        results: list[int] = []
        keys = [uuid.uuid4().hex[:8] for _ in range(3)]
        threads = [
            threading.Thread(target=post_hold, args=(broker.url, k, results))
            for broker, k in zip((a, b, a), keys, strict=True)
        ]
        for thread in threads:
            thread.start()
        wait_until(lambda: all(env.latches[k].started.is_set() for k in keys))
        # The fleet holds 3: every further request on either broker is refused at once.
        for broker in (a, b, b, a):
            refused = httpx.post(
                broker.url + "/message:send", json=send_params("echo no"), headers=A2A_HEADERS
            )
            assert refused.status_code == 429
            assert refused.headers["admitgate-reason"] == "queue_full"
        assert env.executor.running == 3
        assert a.gauge("broker_fleet_in_flight") == 3
        assert a.gauge("broker_fleet_max_in_flight") == 3
        for k in keys:
            env.latches[k].release()
        for thread in threads:
            thread.join(10)
        assert results == [200, 200, 200]
        # Released everywhere: the other broker gets the room back.
        ok = httpx.post(b.url + "/message:send", json=send_params("echo yes"), headers=A2A_HEADERS)
        assert ok.status_code == 200
    finally:
        assert a.stop() == 0
        assert b.stop() == 0


def test_the_redis_password_never_appears_in_a_log_line(env: Any, redis_tls_server: Any) -> None:
    broker = BrokerProcess(
        env.binary,
        "--upstream",
        env.server.url,
        "--max-in-flight",
        "2",
        "--fleet",
        redis_tls_server.url,
        "--fleet-tls-ca-file",
        redis_tls_server.ca_file,
        "--fleet-key",
        f"broker-secret:{uuid.uuid4().hex[:8]}",
    )
    try:
        ok = httpx.post(
            broker.url + "/message:send", json=send_params("echo x"), headers=A2A_HEADERS
        )
        assert ok.status_code == 200
        assert broker.gauge("broker_fleet_backend_up") == 1
    finally:
        assert broker.stop() == 0
    listening = broker.events("listening")[0]
    assert listening["fleet"].startswith("rediss://") and "***" in listening["fleet"]
    assert redis_tls_server.password and not any(
        redis_tls_server.password in line for line in broker.raw
    )


def test_a_tenant_is_held_to_its_own_cap(env: Any) -> None:
    broker = BrokerProcess(
        env.binary,
        "--upstream",
        env.server.url,
        "--max-in-flight",
        "4",
        "--max-in-flight-per-tenant",
        "1",
        "--tenant-from",
        "header:x-tenant",
    )
    try:
        k = uuid.uuid4().hex[:8]
        results: list[int] = []
        thread = threading.Thread(
            target=post_hold, args=(broker.url, k, results, {"x-tenant": "acme"})
        )
        thread.start()
        wait_until(env.latches[k].started.is_set)
        acme = httpx.post(
            broker.url + "/message:send",
            json=send_params("echo no"),
            headers={**A2A_HEADERS, "x-tenant": "acme"},
        )
        assert acme.status_code == 429
        other = httpx.post(
            broker.url + "/message:send",
            json=send_params("echo yes"),
            headers={**A2A_HEADERS, "x-tenant": "other"},
        )
        assert other.status_code == 200
        env.latches[k].release()
        thread.join(10)
        assert results == [200]
    finally:
        assert broker.stop() == 0


# -- upstream connections -----------------------------------------------------------------------


class ShortKeepAlive:
    """uvicorn with a 1 s keep-alive, serving the SDK app (its ``/upload`` echoes a body)."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True
        )
        self.thread.start()
        wait_until(lambda: self.server.started)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def soak(binary: Any, upstream: str, *flags: str) -> list[int]:
    """Posts bodies through a broker with pauses around the upstream's 1 s keep-alive, from
    12 clients at once; returns the statuses."""
    broker = BrokerProcess(binary, "--upstream", upstream, *flags, metrics=False)
    statuses: list[int] = []

    def client(offset: float) -> None:
        with httpx.Client(base_url=broker.url, timeout=10) as c:
            for round_ in range(4):
                statuses.append(c.post("/upload", content=b"x" * 4096).status_code)
                time.sleep(0.96 + offset + 0.01 * round_)

    try:
        threads = [threading.Thread(target=client, args=(i * 0.008,)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        assert broker.stop() == 0
    return statuses


def test_no_502_from_an_upstream_with_a_one_second_keep_alive(env: Any) -> None:
    upstream = ShortKeepAlive(build_sdk_app(env.executor, "http://unused"))
    try:
        statuses = soak(env.binary, upstream.url)
    finally:
        upstream.stop()
    assert len(statuses) == 48
    assert set(statuses) == {200}, statuses


# -- gRPC streams -------------------------------------------------------------------------------

_STREAMER = """
import asyncio, sys, grpc

async def count(request, context):
    for i in range(request[0]):
        yield bytes([i])
        await asyncio.sleep(0.01)
    context.set_trailing_metadata((("x-custom", "kept"), ("x-bin-bin", b"\\x00\\xff")))

async def forever(request, context):
    yield b"first"
    await asyncio.sleep(3600)

async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Stream", {
        "Count": grpc.unary_stream_rpc_method_handler(count),
        "Forever": grpc.unary_stream_rpc_method_handler(forever),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def test_trailers_pass_and_a_broken_upstream_stream_ends_with_a_status(env: Any) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _STREAMER], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    broker = None
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        broker = BrokerProcess(
            env.binary, "--upstream", env.server.url, "--grpc-upstream", f"http://127.0.0.1:{port}"
        )

        async def main() -> None:
            async with grpc.aio.insecure_channel(broker.address) as channel:
                count = channel.unary_stream("/test.Stream/Count")
                call = count(bytes([5]))
                assert [m async for m in call] == [bytes([i]) for i in range(5)]
                trailers = tuple(await call.trailing_metadata())
                assert ("x-custom", "kept") in trailers
                assert ("x-bin-bin", b"\x00\xff") in trailers
                forever = channel.unary_stream("/test.Stream/Forever")(b"")
                assert await forever.read() == b"first"
                child.kill()  # the upstream dies mid-stream
                with pytest.raises(grpc.aio.AioRpcError) as broken:
                    await forever.read()
                assert broken.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "upstream" in (broken.value.details() or "")

        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        child.kill()
        child.wait(5)
        if child.stdout is not None:
            child.stdout.close()
        if broker is not None:
            assert broker.stop() == 0


def test_a_request_waiting_for_its_fleet_lease_counts_as_queued(
    env: Any, redis_server: Any
) -> None:
    # Two brokers share a fleet cap of 1: a request on B holds B's free local slot while it
    # waits for the lease A's request holds. Its caller waits, so it counts as queued (as the
    # in-process gate counts it), then as admitted once the lease comes.
    fleet_key = f"broker-test:{uuid.uuid4().hex[:8]}"
    common = ("--upstream", env.server.url, "--max-in-flight", "1", "--queue-depth", "4")
    fleet = ("--fleet", redis_server.url, "--fleet-key", fleet_key)
    a = BrokerProcess(env.binary, *common, *fleet)
    b = BrokerProcess(env.binary, *common, *fleet)
    queued = 'broker_queued_requests{transport="rest"}'
    admitted = 'broker_admitted_total{transport="rest"}'
    first, second = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    try:
        results: list[int] = []
        holder = threading.Thread(target=post_hold, args=(a.url, first, results))
        holder.start()
        wait_until(lambda: env.latches[first].started.is_set())
        waiter = threading.Thread(target=post_hold, args=(b.url, second, results))
        waiter.start()
        b.wait_for(queued, 1)
        assert b.gauge(admitted) == 0
        env.latches[first].release()
        wait_until(lambda: env.latches[second].started.is_set())
        assert b.gauge(queued) == 0
        assert b.gauge(admitted) == 1
        env.latches[second].release()
        holder.join(10)
        waiter.join(10)
        assert results == [200, 200]
    finally:
        env.latches[first].release()
        env.latches[second].release()
        assert a.stop() == 0
        assert b.stop() == 0


def test_brokers_with_classes_order_the_fleet_by_them_and_one_with_other_classes_is_refused(
    env: Any, redis_server: Any
) -> None:
    """`--priority` with `--fleet` reaches the fleet's lease queue: the fleet keeps the classes'
    identity while a broker that has them holds a lease, and a broker configured with other
    classes on the same key is refused (`fleet_unavailable`) rather than serving the fleet's
    tickets by its own shares (docs/priorities.md, "Across a fleet")."""
    fleet_key = f"broker-test:{uuid.uuid4().hex[:8]}"
    common = ("--upstream", env.server.url, "--max-in-flight", "2", "--fleet", redis_server.url)
    classes = ("--priority", "interactive:min=0.5", "--priority", "batch:min=0.2")
    a = BrokerProcess(env.binary, *common, "--fleet-key", fleet_key, *classes)
    same = BrokerProcess(env.binary, *common, "--fleet-key", fleet_key, *classes)
    other = BrokerProcess(
        env.binary, *common, "--fleet-key", fleet_key, "--priority", "chat", "--priority", "bulk"
    )
    try:
        results: list[int] = []
        k = uuid.uuid4().hex[:8]
        thread = threading.Thread(target=post_hold, args=(a.url, k, results))
        thread.start()
        wait_until(lambda: env.latches[k].started.is_set())
        refused = httpx.post(
            other.url + "/message:send", json=send_params("echo other"), headers=A2A_HEADERS
        )
        assert refused.headers.get("admitgate-reason") == "fleet_unavailable", (
            refused.status_code,
            refused.text,
        )
        agrees = httpx.post(
            same.url + "/message:send", json=send_params("echo same"), headers=A2A_HEADERS
        )
        assert agrees.status_code == 200, agrees.text
        env.latches[k].release()
        thread.join(10)
        assert results == [200]
    finally:
        assert a.stop() == 0
        assert same.stop() == 0
        assert other.stop() == 0
