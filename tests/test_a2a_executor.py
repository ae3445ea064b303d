"""admitgate.a2a.GatedAgentExecutor in a real a2a-sdk app on uvicorn.

The request-level cap of the middleware cannot bound ``returnImmediately`` work; the executor
wrapper can. Each test builds the SDK app around its own wrapped executor and gate and puts
it behind the module's one uvicorn server (tests/_a2a_app.py).
"""

from __future__ import annotations

import asyncio
import types
import uuid
from collections.abc import Iterator
from typing import Any

import admitgate
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
    wait_until,
)
from admitgate.a2a import GatedAgentExecutor
from admitgate.asgi import AdmissionMiddleware
from conftest import run

BUSY = "Busy right now \u2014 please resend in a moment."


@pytest.fixture(scope="module")
def env() -> Iterator[types.SimpleNamespace]:
    """uvicorn on loopback, once for the module; tests install their own app."""
    latches = Latches()
    server = ServerThread()
    inner = ControlledExecutor(latches)
    server.start(build_sdk_app(inner, server.url))
    yield types.SimpleNamespace(latches=latches, server=server, url=server.url)
    latches.release_all()
    server.stop()


@pytest.fixture
def install(env: types.SimpleNamespace) -> Iterator[Any]:
    """``install(gate, middleware_gate=None, **executor_kwargs)``: a fresh SDK app whose
    executor is ``GatedAgentExecutor(ControlledExecutor, gate)`` (or the bare executor when
    ``gate`` is None), optionally behind ``AdmissionMiddleware(middleware_gate)``."""

    def install(gate: Any, middleware_gate: Any = None, **kwargs: Any) -> ControlledExecutor:
        inner = ControlledExecutor(env.latches)
        executor = inner if gate is None else GatedAgentExecutor(inner, gate, **kwargs)
        app: Any = build_sdk_app(executor, env.url)
        if middleware_gate is not None:
            app = AdmissionMiddleware(app, middleware_gate)
        env.server.switch.app = app
        return inner

    previous = env.server.switch.app
    yield install
    env.latches.release_all()
    env.server.switch.app = previous


def new_gate(cap: int, queue: int = 0, **kwargs: Any) -> Any:
    gate = admitgate.build_admission_gate(max_concurrent_runs=cap, queue_depth=queue, **kwargs)
    assert gate is not None
    return gate


def key() -> str:
    return uuid.uuid4().hex


def client(env: types.SimpleNamespace) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=env.url, headers=A2A_HEADERS, timeout=10)


def stats(gate: Any, transport: str) -> dict[str, Any]:
    return gate.transport_stats().get(transport, {})


async def send(c: httpx.AsyncClient, text: str, **kwargs: Any) -> dict[str, Any]:
    response = await c.post("/", json=jsonrpc("SendMessage", send_params(text, **kwargs)))
    assert response.status_code == 200, response.text
    return response.json()["result"]


def test_return_immediately_work_holds_a_slot_until_execute_ends(env: Any, install: Any) -> None:
    gate = new_gate(1)
    inner = install(gate)
    a, b = key(), key()

    async def main() -> None:
        async with client(env) as c:
            first = await send(c, f"hold {a}", return_immediately=True)
            await wait_until(env.latches[a].started.is_set)
            # No HTTP request is in flight, but the work holds the slot.
            assert gate.in_flight == 1 and stats(gate, "a2a_task")["in_flight"] == 1
            second = await send(c, f"hold {b}", return_immediately=True)
            task = second["task"]
            assert task["status"]["state"] == "TASK_STATE_REJECTED"
            assert task["status"]["message"]["parts"][0]["text"] == BUSY
            assert task["status"]["message"]["role"] == "ROLE_AGENT"
            hint = task["metadata"]["admitgate"]
            assert hint["reason"] == "queue_full"
            assert 1 <= hint["retryAfter"] <= 30
            assert not env.latches[b].started.is_set()
            assert inner.executions == 1  # the refused task never reached the agent
            stored = (await c.get(f"/tasks/{task['id']}")).json()
            assert stored["status"]["state"] == "TASK_STATE_REJECTED"
            # A blocking send is refused the same way.
            blocked = await send(c, "echo x")
            assert blocked["task"]["status"]["state"] == "TASK_STATE_REJECTED"
            env.latches[a].release()
            await wait_until(lambda: gate.in_flight == 0)
            done = (await c.get(f"/tasks/{first['task']['id']}")).json()
            assert done["status"]["state"] == "TASK_STATE_COMPLETED"
            assert (await send(c, "echo again"))["message"]["parts"][0]["text"] == "again"

    run(main(), timeout=20)
    assert stats(gate, "a2a_task")["admitted"] == 2
    assert stats(gate, "a2a_task")["rejected"]["queue_full"] == 2


def test_without_the_wrapper_a_request_cap_does_not_bound_the_work(env: Any, install: Any) -> None:
    gate = new_gate(1)
    install(None, middleware_gate=gate)
    a = key()

    async def main() -> None:
        async with client(env) as c:
            await send(c, f"hold {a}", return_immediately=True)
            await wait_until(env.latches[a].started.is_set)
            await wait_until(lambda: gate.in_flight == 0)
            # The agent still works, yet the slot is free: a second task starts at once.
            b = key()
            await send(c, f"hold {b}", return_immediately=True)
            await wait_until(env.latches[b].started.is_set)
            assert not env.latches[a].finished.is_set()

    run(main(), timeout=20)


def test_behind_the_middleware_on_the_same_gate_one_slot_serves_both(
    env: Any, install: Any
) -> None:
    gate = new_gate(1)
    install(gate, middleware_gate=gate)
    a, b = key(), key()

    async def main() -> None:
        async with client(env) as c:
            # A blocking send: one slot for the request and its work (no deadlock at cap 1).
            blocking = asyncio.create_task(
                c.post("/", json=jsonrpc("SendMessage", send_params(f"hold {a}")))
            )
            await wait_until(env.latches[a].started.is_set)
            assert gate.in_flight == 1 and stats(gate, "jsonrpc")["in_flight"] == 1
            refused = await c.post("/message:send", json=send_params("echo"))
            assert refused.status_code == 429
            env.latches[a].release()
            assert (await blocking).status_code == 200
            await wait_until(lambda: gate.in_flight == 0)
            # returnImmediately: the response is out, the work keeps the request's slot.
            await send(c, f"hold {b}", return_immediately=True)
            await wait_until(env.latches[b].started.is_set)
            assert gate.in_flight == 1
            refused = await c.post("/", json=jsonrpc("SendMessage", send_params("echo")))
            assert refused.status_code == 429
            env.latches[b].release()
            await wait_until(lambda: gate.in_flight == 0)

    run(main(), timeout=20)
    assert "a2a_task" not in gate.transport_stats()
    assert stats(gate, "jsonrpc")["admitted"] == 2
    assert gate.peak_in_flight == 1


def test_a_refused_follow_up_leaves_the_task_waiting_for_input(env: Any, install: Any) -> None:
    gate = new_gate(1)
    install(gate)
    a, b = key(), key()

    async def main() -> None:
        async with client(env) as c:
            asked = (await send(c, "ask"))["task"]
            assert asked["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
            await send(c, f"hold {a}", return_immediately=True)
            await wait_until(env.latches[a].started.is_set)
            follow = (await send(c, f"hold {b}", task_id=asked["id"]))["task"]
            assert follow["id"] == asked["id"]
            assert follow["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
            assert follow["status"]["message"]["parts"][0]["text"] == BUSY
            assert not env.latches[b].started.is_set()
            env.latches[a].release()
            await wait_until(lambda: gate.in_flight == 0)
            # Capacity is back: the same task continues.
            resumed = asyncio.create_task(send(c, f"hold {b}", task_id=asked["id"]))
            await wait_until(env.latches[b].started.is_set)
            env.latches[b].release()
            assert (await resumed)["task"]["status"]["state"] == "TASK_STATE_COMPLETED"

    run(main(), timeout=20)


def test_cancel_passes_and_frees_the_slot(env: Any, install: Any) -> None:
    gate = new_gate(1)
    install(gate)
    a = key()

    async def main() -> None:
        async with client(env) as c:
            task = (await send(c, f"hold {a}", return_immediately=True))["task"]
            await wait_until(env.latches[a].started.is_set)
            response = await c.post("/", json=jsonrpc("CancelTask", {"id": task["id"]}))
            assert response.json()["result"]["status"]["state"] == "TASK_STATE_CANCELED"
            assert env.latches[a].cancelled.is_set()
            await wait_until(lambda: gate.in_flight == 0)

    run(main(), timeout=20)


def test_work_waits_in_the_queue_and_tenants_from_the_context(env: Any, install: Any) -> None:
    gate = new_gate(2, queue=2, max_concurrent_runs_per_scope=1)
    install(gate, session_id=lambda context: context.tenant)
    a, b = key(), key()

    async def main() -> None:
        async with client(env) as c:
            first = await c.post(
                "/acme/message:send", json=send_params(f"hold {a}", return_immediately=True)
            )
            assert first.status_code == 200
            await wait_until(env.latches[a].started.is_set)
            # Same tenant: its work waits in the tenant's lane (the response waits with it).
            waiting = asyncio.create_task(c.post("/acme/message:send", json=send_params("echo q")))
            await wait_until(lambda: gate.queued == 1)
            # Another tenant runs at once.
            other = await c.post(
                "/globex/message:send", json=send_params(f"hold {b}", return_immediately=True)
            )
            assert other.status_code == 200
            await wait_until(env.latches[b].started.is_set)
            assert gate.in_flight == 2 and not waiting.done()
            env.latches[a].release()
            response = await waiting
            assert response.json()["message"]["parts"][0]["text"] == "q"
            env.latches[b].release()
            await wait_until(lambda: gate.in_flight == 0)

    run(main(), timeout=20)
    assert stats(gate, "a2a_task")["admitted"] == 3


def test_constructor_validates_its_arguments() -> None:
    inner = ControlledExecutor(Latches())
    gate = new_gate(1)
    with pytest.raises(TypeError, match="executor"):
        GatedAgentExecutor(object(), gate)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gate"):
        GatedAgentExecutor(inner, None)
    with pytest.raises(TypeError, match="session_id"):
        GatedAgentExecutor(inner, gate, session_id="x")  # type: ignore[arg-type]
    for bad in ("", "A2A", "a-b", "x" * 33, "passthrough", 3):
        with pytest.raises(ValueError, match="transport"):
            GatedAgentExecutor(inner, gate, transport=bad)  # type: ignore[arg-type]
    assert GatedAgentExecutor(inner, gate, transport="agent_work").transport == "agent_work"
