"""Clients that leave early, at the in-process front doors: the ASGI middleware in front of
the real A2A SDK app on uvicorn, and the gRPC interceptor in front of the SDK's gRPC
handlers on grpc.aio.

The rule (issue 22, item 7, for the in-process doors): a slot is freed only when the
agent's work for that request has ended. A client that leaves while the agent works must
not let the next client's work start beside it: with the cap at 1, the agent never runs
two at once, however many clients leave and come back.

The work is counted where it runs (``_attack.CountingExecutor`` for HTTP, the executor's
own count for gRPC); the clients are raw sockets (HTTP) and grpc.aio channels, each leaving
after a fraction of the work.
"""

from __future__ import annotations

import json
import socket
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import admitgate
import pytest
from _a2a_app import ServerThread, build_sdk_app, jsonrpc, send_params
from _attack import CountingExecutor, request_bytes
from _broker import wait_until
from admitgate.a2a import GatedAgentExecutor
from admitgate.asgi import AdmissionMiddleware


def new_gate(cap: int) -> Any:
    gate = admitgate.build_admission_gate(max_concurrent_runs=cap, queue_depth=0)
    assert gate is not None
    return gate


@pytest.fixture(scope="module")
def env() -> Iterator[types.SimpleNamespace]:
    """uvicorn on loopback, once for the module; each test installs its own app."""
    server = ServerThread()
    server.start(build_sdk_app(CountingExecutor(), server.url))
    yield types.SimpleNamespace(server=server)
    server.stop()


def _install(env: Any, gate: Any, *, wrap: bool) -> CountingExecutor:
    """A fresh SDK app on ``gate`` (the middleware's), its executor counted; with ``wrap``
    the executor is also a ``GatedAgentExecutor`` on the same gate."""
    counting = CountingExecutor()
    executor: Any = GatedAgentExecutor(counting, gate) if wrap else counting
    env.server.switch.app = AdmissionMiddleware(build_sdk_app(executor, env.server.url), gate)
    return counting


def _send(text: str, rpc: str) -> bytes:
    body = json.dumps(jsonrpc(rpc, send_params(text), rpc_id=uuid.uuid4().hex[:8])).encode()
    return request_bytes(
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


def _leave_after(url: str, request: bytes, seconds: float) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        time.sleep(seconds)


@pytest.mark.parametrize("rpc", ["SendMessage", "SendStreamingMessage"])
@pytest.mark.parametrize("wrap", [False, True], ids=["middleware", "middleware+executor"])
def test_clients_that_leave_never_let_the_agent_run_past_the_cap(
    env: Any, rpc: str, wrap: bool
) -> None:
    """Five clients in a row each send work that takes 1.5 s and leave after 0.3 s, at cap 1
    with no queue: the first one's work runs on, and every later one is refused while it
    does; the agent never runs two at once."""
    gate = new_gate(1)
    executor = _install(env, gate, wrap=wrap)
    work = "sleep 1.5" if rpc == "SendMessage" else "task 1.5"
    for _ in range(5):
        _leave_after(env.server.url, _send(work, rpc), 0.3)
    wait_until(lambda: executor.running == 0, timeout=10)
    wait_until(lambda: gate.stats()["in_flight"] == 0, timeout=5)
    assert executor.peak == 1, (executor.peak, executor.executions)
    assert executor.executions == 1


def test_an_abandoned_stream_is_waited_for_at_most_its_timeout(env: Any) -> None:
    """The bound: ``abandoned_response_timeout`` after the client left, the app is told and
    the slot freed even though the agent still works."""
    gate = new_gate(1)
    counting = CountingExecutor()
    env.server.switch.app = AdmissionMiddleware(
        build_sdk_app(counting, env.server.url), gate, abandoned_response_timeout=0.5
    )
    _leave_after(env.server.url, _send("task 3", "SendStreamingMessage"), 0.3)
    left = time.monotonic()
    assert counting.running == 1
    wait_until(lambda: gate.stats()["in_flight"] == 0, timeout=5)
    assert 0.3 < time.monotonic() - left < 2.5
    assert counting.running == 1  # the agent still works: the bound freed the slot
    wait_until(lambda: counting.running == 0, timeout=10)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "1"])
def test_a_bad_abandoned_response_timeout_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=r"abandoned_response_timeout must be .*got"):
        AdmissionMiddleware(
            build_sdk_app(CountingExecutor(), "http://x"),
            new_gate(1),
            abandoned_response_timeout=bad,
        )  # type: ignore[arg-type]
