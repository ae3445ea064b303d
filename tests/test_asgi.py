"""admitgate.asgi.AdmissionMiddleware in front of a real a2a-sdk app served by uvicorn.

One uvicorn server per module (tests/_a2a_app.py); each test puts its own middleware and a
fresh gate in front of the same SDK app, and drives it with httpx and with the SDK's own
client over loopback. Timing is controlled by latches in the executor, not by sleeping.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
import types
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import admitgate
import httpx
import pytest
from _a2a_app import (
    A2A_HEADERS,
    ControlledExecutor,
    Latches,
    ServerThread,
    agent_card,
    build_sdk_app,
    jsonrpc,
    send_params,
    wait_until,
)
from admitgate.asgi import (
    _JSONRPC,
    _PASS,
    _REST_READ,
    _REST_WORK,
    ERROR_DOMAIN,
    JSONRPC_REJECTED_CODE,
    AdmissionMiddleware,
)
from admitgate.client import RetryingTransport
from conftest import run

# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env() -> Iterator[types.SimpleNamespace]:
    """The SDK app (ControlledExecutor) on uvicorn, once for the module."""
    latches = Latches()
    executor = ControlledExecutor(latches)
    server = ServerThread()
    sdk_app = build_sdk_app(executor, server.url)
    server.start(sdk_app)
    yield types.SimpleNamespace(
        latches=latches, executor=executor, server=server, sdk_app=sdk_app, url=server.url
    )
    latches.release_all()
    server.stop()


@pytest.fixture
def front(env: types.SimpleNamespace) -> Iterator[Any]:
    """``front(gate, **kwargs)`` puts ``AdmissionMiddleware(sdk_app, gate, **kwargs)`` in front."""

    def install(gate: Any, app: Any = None, **kwargs: Any) -> AdmissionMiddleware:
        middleware = AdmissionMiddleware(app or env.sdk_app, gate, **kwargs)
        env.server.switch.app = middleware
        return middleware

    yield install
    env.latches.release_all()
    env.server.switch.app = env.sdk_app


def new_gate(cap: int, queue: int = 0, **kwargs: Any) -> Any:
    gate = admitgate.build_admission_gate(max_concurrent_runs=cap, queue_depth=queue, **kwargs)
    assert gate is not None
    return gate


def key() -> str:
    return uuid.uuid4().hex


def client(env: types.SimpleNamespace, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=env.url, headers=A2A_HEADERS, timeout=10, **kwargs)


def rpc_send(k: str, *, method: str = "SendMessage", rpc_id: Any = "1", **kw: Any) -> Any:
    return jsonrpc(method, send_params(f"hold {k}", **kw), rpc_id)


def in_flight(gate: Any, transport: str) -> int:
    return gate.transport_stats().get(transport, {}).get("in_flight", 0)


def rejected(gate: Any, transport: str, reason: str = "queue_full") -> int:
    return gate.transport_stats().get(transport, {}).get("rejected", {}).get(reason, 0)


def requests(gate: Any, transport: str) -> int:
    return gate.request_stats().get(transport, {}).get("count", 0)


def counted(gate: Any, transport: str, expected: int) -> bool:
    """Whether ``expected`` requests were recorded for ``transport``, waiting a little: the
    middleware records a request after its response is out, so the client may be first."""
    deadline = time.monotonic() + 5
    while requests(gate, transport) != expected and time.monotonic() < deadline:
        time.sleep(0.002)
    return requests(gate, transport) == expected


async def started(env: types.SimpleNamespace, *keys: str) -> None:
    for k in keys:
        await wait_until(env.latches[k].started.is_set)


def check_retry_after(response: httpx.Response, expected: int | None = None) -> int:
    assert response.headers["admitgate-reason"]
    value = response.headers["retry-after"]
    assert value.isdigit(), value
    seconds = int(value)
    if expected is None:
        assert 1 <= seconds <= 30  # the gate's hint is clamped to [1 s, 30 s], rounded up
    else:
        assert seconds == expected
    return seconds


# -- classification (no server) ---------------------------------------------------------------


def classify(path: str, method: str = "POST", **kwargs: Any) -> int:
    middleware = AdmissionMiddleware(_noop_app, new_gate(1), **kwargs)
    return middleware._classify(method, path, "")


async def _noop_app(scope: Any, receive: Any, send: Any) -> None:
    return None


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        ("POST", "/", _JSONRPC),
        ("GET", "/", _PASS),
        ("POST", "/message:send", _REST_WORK),
        ("POST", "/message:stream", _REST_WORK),
        ("GET", "/message:send", _PASS),  # a 405: no endpoint runs
        ("POST", "/tasks/message:send", _REST_WORK),  # the tenant "tasks"
        ("POST", "/tasks/message:stream", _REST_WORK),
        ("GET", "/tasks/message:send", _REST_READ),  # GetTask of the task "message:send"
        ("POST", "/message:send\n", _REST_WORK),  # Starlette's "$" matches before a final \n
        ("POST", "/\n", _JSONRPC),
        ("POST", "/tasks/t1", _PASS),
        ("POST", "/acme/message:send", _REST_WORK),
        ("POST", "/v1/message:send", _REST_WORK),
        ("POST", "/v1/message:stream", _REST_WORK),
        ("GET", "/tasks", _REST_READ),
        ("GET", "/acme/tasks", _REST_READ),
        ("GET", "/tasks/t1", _REST_READ),
        ("HEAD", "/tasks/t1", _REST_READ),
        ("POST", "/tasks/t1:cancel", _REST_READ),
        ("POST", "/v1/tasks/t1:cancel", _REST_READ),
        ("GET", "/tasks/t1:subscribe", _REST_WORK),
        ("POST", "/tasks/t1:subscribe", _REST_WORK),
        ("GET", "/acme/tasks/t1:subscribe", _REST_WORK),
        ("GET", "/v1/tasks/t1:subscribe", _REST_WORK),
        ("GET", "/tasks/t1/pushNotificationConfigs", _REST_READ),
        ("POST", "/tasks/t1/pushNotificationConfigs", _REST_READ),
        ("GET", "/tasks/t1/pushNotificationConfigs/p1", _REST_READ),
        ("DELETE", "/acme/tasks/t1/pushNotificationConfigs/p1", _REST_READ),
        ("GET", "/extendedAgentCard", _REST_READ),
        ("GET", "/acme/extendedAgentCard", _REST_READ),
        ("GET", "/v1/card", _REST_READ),
        ("GET", "/card", _PASS),
        ("GET", "/acme/card", _PASS),
        ("GET", "/.well-known/agent-card.json", _PASS),
        ("GET", "/custom", _PASS),
        ("POST", "/upload", _PASS),
        ("GET", "/tasks/", _PASS),
        ("GET", "/tasks/t1/other", _PASS),
        ("POST", "//message:send", _PASS),
        ("POST", "/a/b/message:send", _PASS),
    ],
)
def test_classification_at_the_root(method: str, path: str, kind: int) -> None:
    assert classify(path, method) == kind


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        ("POST", "/a2a", _JSONRPC),
        ("POST", "/a2a/", _JSONRPC),
        ("POST", "/", _PASS),
        ("POST", "/a2a/message:send", _REST_WORK),
        ("POST", "/a2a/acme/message:send", _REST_WORK),
        ("POST", "/acme/a2a/message:send", _REST_WORK),  # the SDK's /{tenant}<prefix>/ layout
        ("GET", "/a2a/tasks/t1", _REST_READ),
        ("POST", "/message:send", _PASS),
        ("POST", "/a2ax/message:send", _PASS),
        ("GET", "/.well-known/agent-card.json", _PASS),
    ],
)
def test_classification_under_a_prefix(method: str, path: str, kind: int) -> None:
    assert classify(path, method, path_prefix="/a2a/") == kind


def test_classification_other_jsonrpc_path_and_none() -> None:
    assert classify("/rpc", jsonrpc_path="/rpc") == _JSONRPC
    assert classify("/", jsonrpc_path="/rpc") == _PASS
    assert classify("/", jsonrpc_path=None) == _PASS
    assert classify("/message:send", jsonrpc_path=None) == _REST_WORK


# -- argument validation ----------------------------------------------------------------------


def test_constructor_validates_every_argument() -> None:
    gate = new_gate(1)
    with pytest.raises(TypeError, match="app"):
        AdmissionMiddleware(object(), gate)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gate"):
        AdmissionMiddleware(_noop_app, None)
    with pytest.raises(ValueError, match="path_prefix.*'a2a'"):
        AdmissionMiddleware(_noop_app, gate, path_prefix="a2a")
    with pytest.raises(ValueError, match="jsonrpc_path.*''"):
        AdmissionMiddleware(_noop_app, gate, jsonrpc_path="")
    with pytest.raises(ValueError, match="gate_methods.*'some'"):
        AdmissionMiddleware(_noop_app, gate, gate_methods="some")
    with pytest.raises(TypeError, match="session_id"):
        AdmissionMiddleware(_noop_app, gate, session_id="tenant")  # type: ignore[arg-type]
    for bad in (-1, math.nan, math.inf, True, "3"):
        with pytest.raises(ValueError, match="retry_after"):
            AdmissionMiddleware(_noop_app, gate, retry_after=bad)  # type: ignore[arg-type]
    for bad in (0, -5, 1.5, True, 2**31):
        with pytest.raises(ValueError, match="max_peek_bytes"):
            AdmissionMiddleware(_noop_app, gate, max_peek_bytes=bad)  # type: ignore[arg-type]
    middleware = AdmissionMiddleware(_noop_app, gate, path_prefix="/a2a/", retry_after=0)
    assert middleware.path_prefix == "/a2a" and middleware.retry_after == 0.0


# -- lifespan and websocket pass straight through (ASGI level) ------------------------------


def test_lifespan_and_websocket_pass_through_untouched() -> None:
    gate = new_gate(1)
    seen: list[tuple[Any, Any, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((scope, receive, send))

    middleware = AdmissionMiddleware(app, gate, gate_methods="all")

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: Any) -> None:
        return None

    async def main() -> None:
        for scope in (
            {"type": "lifespan", "asgi": {"version": "3.0"}},
            {"type": "websocket", "path": "/", "root_path": "", "headers": []},
            {"type": "websocket", "path": "/message:send", "root_path": "", "headers": []},
        ):
            await middleware(scope, receive, send)
            assert seen[-1] == (scope, receive, send)

    run(main())
    assert len(seen) == 3
    assert gate.request_stats() == {} or all(v["count"] == 0 for v in gate.request_stats().values())
    assert gate.in_flight == 0 and gate.admitted == 0


# -- caps, refusals and bodies ------------------------------------------------------------------


def test_jsonrpc_sends_are_capped_and_refused(env: Any, front: Any) -> None:
    gate = new_gate(2)
    front(gate)
    keys = [key() for _ in range(6)]

    async def main() -> None:
        async with client(env) as c:
            before = env.executor.executions
            sends = [
                asyncio.create_task(c.post("/", json=rpc_send(k, rpc_id=i)))
                for i, k in enumerate(keys)
            ]
            await wait_until(lambda: sum(s.done() for s in sends) == 4)
            assert in_flight(gate, "jsonrpc") == 2
            # Admitted is not yet running: wait for the two turns to reach the agent.
            await wait_until(lambda: sum(env.latches[k].started.is_set() for k in keys) == 2)
            running = [k for k in keys if env.latches[k].started.is_set()]
            assert len(running) == 2
            refused = [s for s in sends if s.done()]
            assert len(refused) == 4
            for task in refused:
                response = task.result()
                assert response.status_code == 429
                seconds = check_retry_after(response)
                body = response.json()
                assert body["jsonrpc"] == "2.0"
                assert body["id"] == sends.index(task)
                assert body["error"]["code"] == JSONRPC_REJECTED_CODE
                assert (
                    body["error"]["message"] == "Busy right now \u2014 please resend in a moment."
                )
                assert body["error"]["data"] == {"reason": "queue_full", "retryAfter": seconds}
            # The refused requests never reached the agent.
            assert env.executor.executions - before == 2
            for k in running:
                env.latches[k].release()
            for task in sends:
                if task not in refused:
                    response = await task
                    assert response.status_code == 200
                    assert response.json()["result"]["task"]["status"]["state"] == (
                        "TASK_STATE_COMPLETED"
                    )
            await wait_until(lambda: gate.in_flight == 0)

    run(main(), timeout=20)
    stats = gate.transport_stats()["jsonrpc"]
    assert stats["admitted"] == 2 and stats["rejected"]["queue_full"] == 4
    assert counted(gate, "jsonrpc", 6)


def test_caps_hold_per_transport_and_rest_refusal_body(env: Any, front: Any) -> None:
    gate = new_gate(2)
    front(gate, retry_after=7)
    k1, k2 = key(), key()

    async def main() -> None:
        async with client(env) as c:
            a = asyncio.create_task(c.post("/", json=rpc_send(k1)))
            b = asyncio.create_task(c.post("/acme/message:send", json=send_params(f"hold {k2}")))
            await started(env, k1, k2)
            assert in_flight(gate, "jsonrpc") == 1 and in_flight(gate, "rest") == 1
            refused = await c.post("/message:send", json=send_params("echo no"))
            assert refused.status_code == 429
            check_retry_after(refused, 7)
            body = refused.json()
            assert body == {
                "error": {
                    "code": 429,
                    "status": "RESOURCE_EXHAUSTED",
                    "message": "Busy right now \u2014 please resend in a moment.",
                    "details": [
                        {
                            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                            "reason": "QUEUE_FULL",
                            "domain": ERROR_DOMAIN,
                            "metadata": {"reason": "queue_full", "retryAfter": "7"},
                        },
                        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "7s"},
                    ],
                }
            }
            # The details are real google.rpc messages (the SDK's REST error shape).
            from google.protobuf.json_format import ParseDict
            from google.rpc import error_details_pb2, status_pb2

            status = ParseDict(
                {k: v for k, v in body["error"].items() if k != "status"}, status_pb2.Status()
            )
            info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
            assert status.details[0].Unpack(info) and info.domain == ERROR_DOMAIN
            assert status.details[1].Unpack(retry) and retry.retry_delay.seconds == 7
            # The SDK's REST error parser accepts it (no A2A reason, so no typed error).
            from a2a.client.transports.rest import _parse_rest_error

            assert _parse_rest_error(body, "fallback") is None
            refused_rpc = await c.post("/", json=jsonrpc("SendMessage", send_params("echo"), "q"))
            assert refused_rpc.status_code == 429 and refused_rpc.json()["id"] == "q"
            check_retry_after(refused_rpc, 7)
            env.latches[k1].release()
            env.latches[k2].release()
            assert (await a).status_code == 200 and (await b).status_code == 200

    run(main(), timeout=20)
    stats = gate.transport_stats()
    assert stats["jsonrpc"]["admitted"] == 1 and stats["jsonrpc"]["rejected"]["queue_full"] == 1
    assert stats["rest"]["admitted"] == 1 and stats["rest"]["rejected"]["queue_full"] == 1
    assert "passthrough" not in stats


@pytest.mark.parametrize(
    "path",
    [
        "/tasks/message:send",
        "/tasks/message:stream",
        "/message:send%0A",
        "/message:send/message:send",
    ],
)
def test_tenant_named_like_a_route_is_still_capped(env: Any, front: Any, path: str) -> None:
    """Issue 15 item 1, end to end: the SDK runs POST /tasks/message:send as SendMessage for
    the tenant "tasks". Fails before the fix: the middleware took it for GET /tasks/{id}, so
    with the ceiling of 1 held, a second agent run started."""
    gate = new_gate(1)
    front(gate)
    k1, k2 = key(), key()

    async def main() -> None:
        async with client(env) as c:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k1)))
            await started(env, k1)
            assert env.executor.running == 1
            probe = asyncio.create_task(c.post(path, json=send_params(f"hold {k2}")))
            await wait_until(lambda: probe.done() or env.latches[k2].started.is_set())
            assert not env.latches[k2].started.is_set(), "a second run started past the cap"
            refused = await probe
            assert refused.status_code == 429, refused.text
            env.latches[k1].release()
            assert (await holder).status_code == 200
            # With the slot free, the same request runs: it really is SendMessage.
            env.latches[k2].release()
            ok = await c.post(path, json=send_params(f"hold {k2}"))
            assert ok.status_code == 200, ok.text
            assert env.latches[k2].finished.is_set()

    run(main(), timeout=20)
    assert rejected(gate, "rest") == 1 and gate.transport_stats()["rest"]["admitted"] == 1


def test_a_body_nested_too_deep_to_read_is_gated(env: Any, front: Any) -> None:
    """A body json cannot follow on the middleware's stack may still parse in the app (on a
    shallower stack, as in a task of its own), so it is gated, never passed. Fails before the
    fix: first the RecursionError escaped the middleware (a 500), then such a body passed as
    "not work"."""
    gate = new_gate(1)
    front(gate)
    k = key()
    deep = "[" * 3000 + "]" * 3000
    body = json.dumps(jsonrpc("SendMessage", send_params("echo deep"), "deep"))
    body = body[:-1] + ', "nested": ' + deep + "}"
    assert len(body) < 65536

    async def main() -> None:
        async with client(env) as c:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            refused = await c.post("/", content=body)
            assert refused.status_code == 429, refused.text
            assert refused.json()["id"] == "deep"
            env.latches[k].release()
            assert (await holder).status_code == 200

    run(main(), timeout=20)
    assert rejected(gate, "jsonrpc") == 1


def test_refusals_echo_the_id_as_the_sdk_does(env: Any, front: Any) -> None:
    """The refusal's id is the one the SDK itself would answer with: ints of any size and
    strings as sent, null for floats, booleans and a string holding a lone surrogate (the
    SDK cannot encode that one either). Fails before the fix: refusing an id of "\\ud800"
    raised UnicodeEncodeError out of the middleware instead of answering 429; and a body in
    UTF-16 holding a lone surrogate, which the SDK runs, must still be gated."""
    gate = new_gate(1)
    front(gate)
    k = key()
    params = send_params("echo no")
    cases: list[tuple[bytes, Any]] = [
        (json.dumps(jsonrpc("SendMessage", params, 10**30)).encode(), 10**30),
        (json.dumps(jsonrpc("SendMessage", params, -7)).encode(), -7),
        (json.dumps(jsonrpc("SendMessage", params, "a\u00e9")).encode(), "a\u00e9"),
        (json.dumps(jsonrpc("SendMessage", params, 1.0)).encode(), None),
        (json.dumps(jsonrpc("SendMessage", params, True)).encode(), None),
        (json.dumps(jsonrpc("SendMessage", params, "\ud800")).encode(), None),
        (
            json.dumps(
                jsonrpc("SendMessage", {**params, "x": "\udc00"}, 5), ensure_ascii=False
            ).encode("utf-16", "surrogatepass"),
            5,
        ),
    ]

    async def main() -> None:
        async with client(env) as c:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            for body, rpc_id in cases:
                refused = await c.post("/", content=body)
                assert refused.status_code == 429, (body, refused.text)
                answer = refused.json()
                assert answer["error"]["code"] == JSONRPC_REJECTED_CODE
                assert answer["id"] == rpc_id and type(answer["id"]) is type(rpc_id), answer
            env.latches[k].release()
            assert (await holder).status_code == 200

    run(main(), timeout=20)
    assert rejected(gate, "jsonrpc") == len(cases)


def test_sdk_client_sees_the_refusal(env: Any, front: Any) -> None:
    from a2a.client import A2AClientError, ClientConfig, create_client
    from a2a.types import Message, Part, Role, SendMessageRequest

    gate = new_gate(1)
    front(gate)
    k = key()

    def request() -> SendMessageRequest:
        return SendMessageRequest(
            message=Message(
                role=Role.ROLE_USER, message_id=str(uuid.uuid4()), parts=[Part(text="echo hi")]
            )
        )

    async def main() -> None:
        card = agent_card(env.url)
        async with client(env) as c:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            for binding in ("JSONRPC", "HTTP+JSON"):
                for streaming in (False, True):
                    async with httpx.AsyncClient(timeout=10) as http:
                        config = ClientConfig(
                            httpx_client=http,
                            streaming=streaming,
                            supported_protocol_bindings=[binding],
                        )
                        sdk = await create_client(card, client_config=config)
                        with pytest.raises(A2AClientError, match="429") as info:
                            async for _ in sdk.send_message(request()):
                                pass
                        cause = info.value.__cause__
                        assert isinstance(cause, httpx.HTTPStatusError)
                        check_retry_after(cause.response)
                        body = cause.response.json()
                        if binding == "JSONRPC":
                            assert body["error"]["code"] == JSONRPC_REJECTED_CODE
                        else:
                            assert body["error"]["details"][0]["domain"] == ERROR_DOMAIN
            env.latches[k].release()
            assert (await holder).status_code == 200

    run(main(), timeout=20)
    assert rejected(gate, "jsonrpc") == 2 and rejected(gate, "rest") == 2


def test_passthrough_reads_and_cancel_pass_while_saturated(env: Any, front: Any) -> None:
    gate = new_gate(1)
    front(gate)
    k, k2 = key(), key()

    async def main() -> None:
        async with client(env) as c:
            held = await c.post("/", json=rpc_send(k, return_immediately=True))
            assert held.status_code == 200
            task_id = held.json()["result"]["task"]["id"]
            blocking = asyncio.create_task(c.post("/message:send", json=send_params(f"hold {k2}")))
            await started(env, k, k2)
            assert gate.in_flight == 1  # the blocking REST send; the first returned at once
            # Saturated: sends are refused, but the card, custom routes, reads and cancels pass.
            assert (await c.post("/", json=rpc_send(key()))).status_code == 429
            for _ in range(3):
                t0 = time.monotonic()
                card = await c.get("/.well-known/agent-card.json")
                custom = await c.get("/custom")
                assert card.status_code == 200 and card.json()["name"]
                assert custom.json() == {"custom": True}
                assert time.monotonic() - t0 < 2
            get_rpc = await c.post("/", json=jsonrpc("GetTask", {"id": task_id}))
            assert get_rpc.status_code == 200, get_rpc.text
            assert get_rpc.json()["result"]["status"]["state"] == "TASK_STATE_WORKING"
            get_rest = await c.get(f"/tasks/{task_id}")
            assert get_rest.status_code == 200 and get_rest.json()["id"] == task_id
            listed = await c.get("/tasks")
            assert listed.status_code == 200
            cancel = await c.post("/", json=jsonrpc("CancelTask", {"id": task_id}))
            assert cancel.status_code == 200, cancel.text
            assert cancel.json()["result"]["status"]["state"] == "TASK_STATE_CANCELED"
            assert env.latches[k].cancelled.is_set()
            second = (await c.get(f"/tasks/{task_id}")).json()
            assert second["status"]["state"] == "TASK_STATE_CANCELED"
            env.latches[k2].release()
            assert (await blocking).status_code == 200

    run(main(), timeout=20)
    stats = gate.transport_stats()
    assert stats["jsonrpc"]["admitted"] == 1 and stats["rest"]["admitted"] == 1
    assert counted(gate, "passthrough", 6)
    assert counted(gate, "jsonrpc", 4)  # send, refused send, GetTask, CancelTask
    assert counted(gate, "rest", 4)  # blocking send, GET task twice, list
    assert "passthrough" not in stats


def test_gate_methods_all_gates_reads_too(env: Any, front: Any) -> None:
    gate = new_gate(1)
    front(gate, gate_methods="all")
    k = key()

    async def main() -> None:
        async with client(env) as c:
            held = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            get_rpc = await c.post("/", json=jsonrpc("GetTask", {"id": "nope"}, 9))
            assert get_rpc.status_code == 429 and get_rpc.json()["id"] == 9
            assert (await c.get("/tasks/nope")).status_code == 429
            assert (await c.post("/", content=b"not json")).status_code == 429
            assert (await c.get("/.well-known/agent-card.json")).status_code == 200
            env.latches[k].release()
            assert (await held).status_code == 200
            # Free again: a read goes through (and is counted as admitted).
            assert (await c.get("/tasks/nope")).status_code == 404

    run(main(), timeout=20)
    assert rejected(gate, "jsonrpc") == 2 and rejected(gate, "rest") == 1
    assert gate.transport_stats()["rest"]["admitted"] == 1


def test_an_sse_stream_holds_its_slot_until_it_ends(env: Any, front: Any) -> None:
    gate = new_gate(1)
    front(gate)

    async def stream(c: httpx.AsyncClient, path: str, body: Any, k: str) -> None:
        async with c.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = 0
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                events += 1
                if events == 1:
                    await started(env, k)
                    # Mid-stream: the slot is held, a second send is refused.
                    assert gate.in_flight == 1
                    refused = await c.post("/message:send", json=send_params("echo x"))
                    assert refused.status_code == 429
                    env.latches[k].release()
            assert events >= 3  # task, working, completed
        await wait_until(lambda: gate.in_flight == 0)

    async def main() -> None:
        async with client(env) as c:
            k1, k2 = key(), key()
            await stream(c, "/", rpc_send(k1, method="SendStreamingMessage"), k1)
            await stream(c, "/message:stream", send_params(f"hold {k2}"), k2)

    run(main(), timeout=20)
    assert gate.transport_stats()["jsonrpc"]["admitted"] == 1
    assert gate.transport_stats()["rest"]["admitted"] == 1
    assert rejected(gate, "rest") == 2


def test_a_client_leaving_mid_stream_keeps_the_slot_until_the_work_ends(
    env: Any, front: Any
) -> None:
    """Issue 22 item 7 for the in-process door: a client that leaves a stream while the
    agent still works does not free the slot (the A2A SDK runs the task on); it is freed when
    the stream's work ends. It used to be freed as the client left (this test said so)."""
    gate = new_gate(1)
    front(gate)
    k = key()

    async def main() -> None:
        async with client(env) as c:
            async with c.stream(
                "POST", "/", json=rpc_send(k, method="SendStreamingMessage")
            ) as response:
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("data:"):
                        break
                await started(env, k)
                assert gate.in_flight == 1
            # The client closed the stream while the agent still works: the slot is held.
            await asyncio.sleep(0.3)
            assert gate.in_flight == 1
            assert not env.latches[k].finished.is_set()
            busy = await c.post("/", json=jsonrpc("SendMessage", send_params("echo back")))
            assert busy.status_code == 429
            env.latches[k].release()
            await wait_until(lambda: gate.in_flight == 0)
            ok = await c.post("/", json=jsonrpc("SendMessage", send_params("echo back")))
            assert ok.status_code == 200

    run(main(), timeout=20)
    assert counted(gate, "jsonrpc", 3)


def test_a_queued_request_whose_client_leaves_withdraws(env: Any, front: Any) -> None:
    gate = new_gate(1, queue=4)
    front(gate)
    k = key()

    async def main() -> None:
        async with client(env) as c, client(env) as other:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            before = env.executor.executions
            queued = asyncio.create_task(other.post("/", json=rpc_send(key())))
            await wait_until(lambda: gate.queued == 1)
            queued.cancel()  # the client gives up: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await queued
            await wait_until(lambda: gate.queued == 0)
            assert gate.cancelled == 1
            # A queued request whose client stays is admitted when the slot frees.
            waiting = asyncio.create_task(
                c.post("/", json=jsonrpc("SendMessage", send_params("echo w")))
            )
            await wait_until(lambda: gate.queued == 1)
            env.latches[k].release()
            assert (await holder).status_code == 200
            response = await waiting
            assert response.status_code == 200 and response.json()["result"]["message"]
            assert env.executor.executions - before == 1  # only the waiter that stayed ran

    run(main(), timeout=20)
    assert counted(gate, "jsonrpc", 3)


class AppCalls:
    """The SDK app, counting the requests that reach it with an ``x-probe`` header."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.probes: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"x-probe":
                    self.probes.append(value.decode())
        await self.app(scope, receive, send)


async def raw_upload(
    env: Any, path: str, body: bytes, declared: int, probe: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw HTTP/1.1 client that sends the headers and ``body`` of a ``declared``-byte POST
    (so the upload is unfinished); returns the stream, to send more, read or leave."""
    reader, writer = await asyncio.open_connection("127.0.0.1", env.server.port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"A2A-Version: 1.0\r\nx-probe: {probe}\r\nContent-Length: {declared}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("more_while_queued", [0, 600], ids=["left-at-once", "uploaded-then-left"])
def test_a_queued_upload_whose_client_leaves_never_runs(
    env: Any, front: Any, more_while_queued: int
) -> None:
    """Issues 15 items 5 and 15: a JSON-RPC body longer than max_peek_bytes, its client gone
    while queued. Fails before the fix: the ghost kept its queue place (the next request got
    queue_full), then took the slot and called the app with a truncated body."""
    gate = new_gate(1, queue=1)
    app = AppCalls(env.sdk_app)
    front(gate, app=app, max_peek_bytes=1024)
    k = key()
    request = rpc_send(key(), rpc_id="ghost")
    request["params"]["pad"] = "p" * 4000
    body = json.dumps(request).encode()

    async def main() -> None:
        async with client(env) as c:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            before = env.executor.executions
            _, ghost = await raw_upload(env, "/", body[:1500], len(body), "ghost")
            await wait_until(lambda: gate.queued == 1)
            if more_while_queued:  # read while queued, kept for the app
                ghost.write(body[1500 : 1500 + more_while_queued])
                await ghost.drain()
            ghost.close()
            await ghost.wait_closed()
            await wait_until(lambda: gate.queued == 0)
            assert gate.cancelled == 1 and gate.in_flight == 1
            # Its queue place is free: the next request queues instead of getting queue_full.
            waiting = asyncio.create_task(
                c.post("/", json=jsonrpc("SendMessage", send_params("echo w")))
            )
            await wait_until(lambda: gate.queued == 1)
            assert rejected(gate, "jsonrpc") == 0
            env.latches[k].release()
            assert (await holder).status_code == 200
            response = await waiting
            assert response.status_code == 200 and response.json()["result"]["message"]
            assert env.executor.executions - before == 1

    run(main(), timeout=20)
    assert counted(gate, "jsonrpc", 3)  # the ghost's request is recorded too
    assert app.probes == []  # the ghost never reached the app
    assert gate.admitted == 2 and gate.cancelled == 1 and gate.in_flight == 0
    assert rejected(gate, "jsonrpc") == 0


def arrivals_add_up(gate: Any, arrivals: int) -> None:
    """Every arrival counted once, as its client experienced it, and nothing held."""
    s = gate.stats()
    assert s["admitted"] + s["rejected"] + s["shed"] + s["cancelled"] == arrivals, s
    assert (s["in_flight"], s["queued"]) == (0, 0), s


@pytest.mark.parametrize(
    ("sent", "declared", "cancelled"),
    [(12_000, 20_000, 1), (1_500_000, 3_000_000, 0)],
    ids=["tail-seen-at-admission", "tail-larger-than-the-read-at-admission"],
)
def test_an_upload_paused_past_the_queued_allowance_never_reaches_the_app_once_gone(
    env: Any, front: Any, sent: int, declared: int, cancelled: int
) -> None:
    """Issue 15 item 15: a queued request reads at most max_peek_bytes more of its body while
    it waits; past that its upload is paused, so a client leaving then shows only at
    admission. Fails before the fix: the ghost's truncated request reached the app (which
    found the body cut short), counted admitted. Now the app never sees it: a disconnect seen
    by the read at admission withdraws the turn (cancelled, its slot handed on); one that only
    shows after more than that read (uvicorn shows it after every byte sent before it) is seen
    while the rest of the body is read, before the app, and frees the slot (counted admitted:
    the gate had already counted the start)."""
    gate = new_gate(1, queue=1)
    app = AppCalls(env.sdk_app)
    front(gate, app=app, max_peek_bytes=1024)
    k = key()
    request = rpc_send(key(), rpc_id="ghost")
    request["params"]["pad"] = "p" * declared
    body = json.dumps(request).encode()[:declared]

    async def main() -> None:
        async with client(env) as c:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            before = env.executor.executions
            _, ghost = await raw_upload(env, "/", body[:1500], len(body), "ghost")
            await wait_until(lambda: gate.queued == 1)
            # Well past the 1024 bytes read while queued; not drained: the server has stopped
            # reading, the rest waits in buffers and goes out after the close, then the FIN.
            ghost.write(body[1500:sent])
            ghost.close()
            await asyncio.sleep(0.05)
            assert gate.queued == 1  # paused: the client's leaving is not visible yet
            env.latches[k].release()
            assert (await holder).status_code == 200
            await ghost.wait_closed()
            await wait_until(lambda: gate.in_flight == 0 and gate.queued == 0)
            ok = await c.post("/", json=jsonrpc("SendMessage", send_params("echo after")))
            assert ok.status_code == 200
            assert env.executor.executions - before == 1  # only "echo after" ran

    run(main(), timeout=20)
    assert app.probes == []  # the ghost never reached the app
    assert counted(gate, "jsonrpc", 3)
    assert gate.cancelled == cancelled and gate.admitted == 3 - cancelled
    arrivals_add_up(gate, 3)


@pytest.mark.parametrize("stage", ["read-at-admission", "rest-before-the-app"])
def test_a_queued_upload_cancelled_while_its_body_is_read_gives_its_slot_back(
    stage: str,
) -> None:
    """Cancellation races (ASGI level: the server cancels the request's task, as uvicorn does
    at shutdown, while the middleware reads the body of a request the gate has just settled):
    the slot is handed on, the app never runs, the counters add up. Before the claim the turn
    counts as cancelled; after it, as admitted (the gate counted its start)."""
    gate = new_gate(1, queue=1)
    calls: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope)

    middleware = AdmissionMiddleware(app, gate, max_peek_bytes=1024)
    scope = {"type": "http", "method": "POST", "path": "/", "root_path": "", "headers": []}
    # 1500 bytes (the peek), 1100 (the allowance while queued), then at admission 1100 more
    # (the read before the claim), then nothing: the read that follows waits.
    chunks = [b"{" + b" " * 1499, b" " * 1100, b" " * 1100]
    asked = 0
    stalled = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        if chunks:
            return {"type": "http.request", "body": chunks.pop(0), "more_body": True}
        stalled.set()
        await asyncio.Event().wait()  # the client stays, sending nothing
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        raise AssertionError(f"nothing is sent: {message!r}")

    async def main() -> None:
        holder = gate.admit()
        await holder.__aenter__()
        if stage == "read-at-admission":
            chunks.pop()  # the read before the claim is the one that waits
        request = asyncio.create_task(middleware(scope, receive, send))
        await wait_until(lambda: gate.queued == 1 and asked == 2)
        await asyncio.sleep(0.01)
        assert asked == 2  # paused past the allowance: nothing more is asked for
        await holder.__aexit__(None, None, None)
        await asyncio.wait_for(stalled.wait(), 5)
        assert gate.in_flight == 1 and gate.queued == 0  # the slot is the request's
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request

    run(main())
    assert calls == []
    assert gate.cancelled == (1 if stage == "read-at-admission" else 0)
    arrivals_add_up(gate, 2)


@pytest.mark.parametrize("client_stays", [False, True], ids=["gone", "stays"])
def test_an_upload_waiting_for_its_fleet_lease_is_watched_too(
    redis_server: Any, client_stays: bool
) -> None:
    """With a fleet limit the middleware steps the gate's LeaseWait the same way (ASGI level,
    against a real redis-server): a client gone while its request waits for the lease, past
    the allowance, is seen when the lease comes and never reaches the app (its lease and
    slot are handed back, counted cancelled); one that stays gets its whole body to the app."""
    limit = admitgate.FleetLimit(redis_server.url, f"asgi:{key()[:12]}", 1)
    gate = admitgate.build_admission_gate(max_concurrent_runs=4, queue_depth=4, fleet=limit)
    assert gate is not None
    received: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        received.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = AdmissionMiddleware(app, gate, max_peek_bytes=1024)
    scope = {"type": "http", "method": "POST", "path": "/", "root_path": "", "headers": []}
    data = b"{" + bytes(range(256)) * 20
    chunks = [data[i : i + 1500] for i in range(0, len(data), 1500)]
    tail: list[dict[str, Any]] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    if not client_stays:
        tail[2:] = [{"type": "http.disconnect"}]  # seen by the read when the lease comes
    asked = 0
    released = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        if asked > 2:  # paused past the allowance until the lease comes
            await released.wait()
        return tail.pop(0) if tail else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        return None

    async def main() -> None:
        holder = gate.admit()
        await holder.__aenter__()
        request = asyncio.create_task(middleware(scope, receive, send))
        await wait_until(lambda: asked == 2)
        assert gate.in_flight == 2  # the holder, and the request's local slot
        released.set()
        await holder.__aexit__(None, None, None)
        await asyncio.wait_for(request, 10)

    run(main(), timeout=20)
    if client_stays:
        assert received == [data] and (gate.admitted, gate.cancelled) == (2, 0)
    else:
        assert received == [] and (gate.admitted, gate.cancelled) == (1, 1)
    arrivals_add_up(gate, 2)


class BodyEcho:
    """In front of the SDK app: a request with an ``x-echo`` header is answered with the
    SHA-256 and length of the body the app received."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (b"x-echo", b"1") not in scope["headers"]:
            await self.app(scope, receive, send)
            return
        digest, size = hashlib.sha256(), 0
        while True:
            message = await receive()
            assert message["type"] == "http.request", message
            digest.update(message["body"])
            size += len(message["body"])
            if not message.get("more_body"):
                break
        payload = json.dumps({"sha256": digest.hexdigest(), "size": size}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


async def raw_echo_upload(
    env: Any, body: bytes, chunk: int, chunked: bool, queued: asyncio.Event
) -> dict[str, Any]:
    """POST ``body`` to "/" with ``x-echo``, in writes of ``chunk`` bytes (as HTTP chunks when
    ``chunked``), its first 1500 bytes or more before the request queues and the rest once
    ``queued`` is set; returns the echo."""
    reader, writer = await asyncio.open_connection("127.0.0.1", env.server.port)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    writer.write(f"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nx-echo: 1\r\n{framing}\r\n\r\n".encode())

    async def write(piece: bytes) -> None:
        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        await writer.drain()

    # Past the peek (1024 bytes) first, so the request reaches the queue; the rest once queued.
    first = -(-1500 // chunk) * chunk
    for i in range(0, len(body), chunk):
        if i == first:
            await queued.wait()
        await write(body[i : i + chunk])
        if i % (chunk * 64) == 0:
            await asyncio.sleep(0.001)  # let the server take what it has, now and then
    if chunked:
        writer.write(b"0\r\n\r\n")
    response = b""
    while not response.endswith(b"}"):
        piece = await reader.read(65536)
        assert piece, response
        response += piece
    writer.close()
    await writer.wait_closed()
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    result: dict[str, Any] = json.loads(payload)
    return result


def test_a_queued_upload_reaches_the_app_byte_for_byte_whatever_its_chunks(
    env: Any, front: Any
) -> None:
    """Differential: what the app receives is exactly what the client sent, for uploads that
    queue with their bodies in many chunk sizes (one byte to 300 KB, Content-Length and chunked
    framing), read in part while queued, in part at admission and the rest before the app."""
    gate = new_gate(1, queue=16)
    front(gate, app=BodyEcho(env.sdk_app), max_peek_bytes=1024)
    rng = random.Random(15)
    cases = [
        (1, 3_000),
        (7, 5_000),
        (1000, 20_000),
        (1023, 3_071),
        (1024, 4_096),
        (1025, 9_000),
        (4096, 200_000),
        (65536, 600_000),
        (300_000, 1_200_000),
    ]
    bodies = [rng.randbytes(size) for _, size in cases]
    k = key()

    async def main() -> None:
        async with client(env) as c:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            queued = asyncio.Event()
            uploads = [
                asyncio.create_task(raw_echo_upload(env, data, chunk, i % 2 == 1, queued))
                for i, ((chunk, _), data) in enumerate(zip(cases, bodies, strict=True))
            ]
            await wait_until(lambda: gate.queued == len(cases))
            queued.set()
            await asyncio.sleep(0.02)  # some bodies are past the allowance when slots free
            env.latches[k].release()
            assert (await holder).status_code == 200
            echoes = await asyncio.gather(*uploads)
            for data, echo in zip(bodies, echoes, strict=True):
                assert echo == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            await wait_until(lambda: gate.in_flight == 0)  # released just after the response

    run(main(), timeout=30)
    assert gate.admitted == 1 + len(cases)
    arrivals_add_up(gate, 1 + len(cases))


def test_a_queued_client_that_stops_sending_holds_its_slot_and_stalls_nothing(
    env: Any, front: Any
) -> None:
    """A client that stays but stops sending after its slot is granted holds the slot until it
    goes on (as it would in the app, which waits for the body too); the loop serves others
    meanwhile, and the app gets the whole body once it arrives."""
    gate = new_gate(1, queue=2)
    front(gate, app=BodyEcho(env.sdk_app), max_peek_bytes=1024)
    k = key()
    data = random.Random(16).randbytes(200_000)

    async def main() -> None:
        async with client(env) as c:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            reader, writer = await asyncio.open_connection("127.0.0.1", env.server.port)
            writer.write(
                f"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nx-echo: 1\r\n"
                f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data[:150_000]
            )
            await wait_until(lambda: gate.queued == 1)
            env.latches[k].release()
            assert (await holder).status_code == 200
            await wait_until(lambda: gate.queued == 0 and gate.in_flight == 1)
            # Its slot is granted; it has sent nothing more. Others are still served at once.
            card = await c.get("/.well-known/agent-card.json")
            assert card.status_code == 200
            behind = asyncio.create_task(
                c.post("/", json=jsonrpc("SendMessage", send_params("echo x")))
            )
            await wait_until(lambda: gate.queued == 1)  # the slot is still the upload's
            await asyncio.sleep(0.05)
            assert gate.in_flight == 1 and gate.queued == 1 and not behind.done()
            writer.write(data[150_000:])
            response = b""
            while not response.endswith(b"}"):
                piece = await reader.read(65536)
                assert piece, response
                response += piece
            writer.close()
            await writer.wait_closed()
            echo = json.loads(response.partition(b"\r\n\r\n")[2])
            assert echo == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            after = await behind
            assert after.status_code == 200 and after.json()["result"]["message"]
            await wait_until(lambda: gate.in_flight == 0)

    run(main(), timeout=20)
    assert gate.admitted == 3
    arrivals_add_up(gate, 3)


def test_a_queued_stream_with_a_large_body_streams_and_holds_its_slot_to_the_end(
    env: Any, front: Any
) -> None:
    """Streaming responses are unaffected: a SendStreamingMessage that queued with a body past
    the allowance streams its events and holds its slot until the stream ends."""
    gate = new_gate(1, queue=1)
    front(gate, max_peek_bytes=1024)
    k1, k2 = key(), key() + "x" * 20_000  # the latch key is the text after "hold "
    request = json.dumps(rpc_send(k2, method="SendStreamingMessage", rpc_id="s")).encode()

    go, sent = asyncio.Event(), asyncio.Event()

    async def upload() -> AsyncIterator[bytes]:
        yield request[:1500]
        await go.wait()  # queued: the rest goes past the 1024 bytes read while it waits
        for i in range(1500, len(request), 1000):
            yield request[i : i + 1000]
        sent.set()

    async def main() -> None:
        async with client(env) as c, client(env) as other:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k1)))
            await started(env, k1)

            async def stream() -> int:
                events = 0
                async with other.stream("POST", "/", content=upload()) as response:
                    assert response.status_code == 200
                    assert response.headers["content-type"].startswith("text/event-stream")
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        events += 1
                        if events == 1:
                            await started(env, k2)
                            assert gate.in_flight == 1 and gate.queued == 0
                            env.latches[k2].release()
                return events

            streaming = asyncio.create_task(stream())
            await wait_until(lambda: gate.queued == 1)
            go.set()
            await sent.wait()
            await asyncio.sleep(0.02)
            env.latches[k1].release()
            assert (await holder).status_code == 200
            assert await streaming >= 3  # task, working, completed
            await wait_until(lambda: gate.in_flight == 0)

    run(main(), timeout=20)
    assert gate.admitted == 2
    arrivals_add_up(gate, 2)


def test_a_queued_upload_is_read_while_it_waits_and_reaches_the_app_whole(
    env: Any, front: Any
) -> None:
    """A client that stays: what was read while it queued is replayed to the app in order."""
    gate = new_gate(1, queue=1)
    front(gate, max_peek_bytes=1024)
    k = key()
    text = "".join(chr(0x41 + i % 26) for i in range(6000))
    body = json.dumps(jsonrpc("SendMessage", send_params("echo " + text), "slow")).encode()

    async def main() -> None:
        async with client(env) as c:
            holder = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            reader, writer = await raw_upload(env, "/", body[:1500], len(body), "slow")
            await wait_until(lambda: gate.queued == 1)
            for i in range(1500, len(body), 700):  # chunks the waiting request reads
                writer.write(body[i : i + 700])
                await writer.drain()
                await asyncio.sleep(0.005)
            env.latches[k].release()
            assert (await holder).status_code == 200
            response = await reader.read(1 << 20)
            while b'"slow"' not in response or not response.rstrip().endswith(b"}"):
                chunk = await reader.read(1 << 20)
                assert chunk, response
                response += chunk
            writer.close()
            head, _, payload = response.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            assert json.loads(payload)["result"]["message"]["parts"][0]["text"] == text

    run(main(), timeout=20)
    assert gate.admitted == 2 and gate.cancelled == 0
    assert counted(gate, "jsonrpc", 2)


def test_a_body_larger_than_the_peek_streams_through_intact(env: Any, front: Any) -> None:
    gate = new_gate(2)
    front(gate, max_peek_bytes=1024)
    text = "".join(chr(0x41 + i % 26) for i in range(300_000)) + " \u00e9\u4e2d"

    async def chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
        for i in range(0, len(data), size):
            yield data[i : i + size]

    def body(rpc_id: str, words: str) -> bytes:
        request = jsonrpc("SendMessage", send_params("echo " + words), rpc_id)
        return json.dumps(request).encode()

    async def main() -> None:
        async with client(env) as c:
            # 300 KB, chunked (many small receive() messages) and with a Content-Length.
            for content in (chunks(body("big", text), 700), body("big", text)):
                response = await c.post("/", content=content)
                assert response.status_code == 200, response.text
                assert response.json()["id"] == "big"
                assert response.json()["result"]["message"]["parts"][0]["text"] == text
            # Under the peek but split across several messages: parsed whole, then replayed.
            response = await c.post("/", content=chunks(body("small", "tiny"), 50))
            assert response.status_code == 200
            assert response.json()["result"]["message"]["parts"][0]["text"] == "tiny"
            # Passthrough bodies are never touched either.
            upload = b"\x00\xff" * 200_000
            response = await c.post("/upload", content=chunks(upload, 4096))
            assert response.json()["size"] == len(upload)

    run(main(), timeout=20)
    assert gate.transport_stats()["jsonrpc"]["admitted"] == 3
    assert counted(gate, "passthrough", 1)


def test_a_large_request_is_refused_with_the_id_from_its_head(env: Any, front: Any) -> None:
    gate = new_gate(1)
    front(gate, max_peek_bytes=1024)
    k = key()
    padding = "p" * 100_000

    async def main() -> None:
        async with client(env) as c:
            held = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            head_id = {
                "jsonrpc": "2.0",
                "id": "head",
                "method": "GetTask",
                "params": {"id": "t", "pad": padding},
            }
            response = await c.post("/", json=head_id)
            assert response.status_code == 429
            assert response.json()["id"] == "head"
            tail_id = {"jsonrpc": "2.0", "method": "GetTask", "params": {"pad": padding}, "id": 5}
            response = await c.post("/", json=tail_id)
            assert response.status_code == 429
            assert response.json()["id"] is None  # past the prefix: unknown, as JSON-RPC says
            # The connection is still usable after an early refusal.
            assert (await c.get("/custom")).status_code == 200
            env.latches[k].release()
            assert (await held).status_code == 200

    run(main(), timeout=20)
    assert rejected(gate, "jsonrpc") == 2


def test_tenant_key_from_the_scope(env: Any, front: Any) -> None:
    gate = new_gate(4, max_concurrent_runs_per_scope=1)

    def tenant(scope: Any) -> str:
        return dict(scope["headers"]).get(b"x-tenant", b"").decode()

    front(gate, session_id=tenant)
    k1, k2 = key(), key()

    async def main() -> None:
        async with client(env) as c:
            a = asyncio.create_task(c.post("/", json=rpc_send(k1), headers={"x-tenant": "a"}))
            await started(env, k1)
            refused = await c.post("/", json=rpc_send(key()), headers={"x-tenant": "a"})
            assert refused.status_code == 429
            b = asyncio.create_task(c.post("/", json=rpc_send(k2), headers={"x-tenant": "b"}))
            await started(env, k2)
            assert gate.in_flight == 2
            env.latches[k1].release()
            env.latches[k2].release()
            assert (await a).status_code == 200 and (await b).status_code == 200

    run(main(), timeout=20)


def test_a_bad_tenant_key_function_fails_the_request(env: Any, front: Any) -> None:
    gate = new_gate(1)
    front(gate, session_id=lambda scope: 42)

    async def main() -> None:
        async with client(env) as c:
            response = await c.post("/", json=jsonrpc("SendMessage", send_params("echo")))
            assert response.status_code == 500

    run(main())
    assert counted(gate, "jsonrpc", 1) and gate.in_flight == 0


def test_memory_pressure_is_503_and_policy_has_no_retry_after(env: Any, front: Any) -> None:
    class Sampler:
        def read(self) -> Any:
            return admitgate.ResourceSample(rss_mb=500.0)

    hot = admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=4),
        resource_policy=admitgate.build_memory_pressure_policy(100),
        resource_sampler=Sampler(),
    )

    class Refuse:
        max_concurrent_runs = 4
        queue_depth = 0
        overflow_policy = "reject"
        max_concurrent_runs_per_scope = 0

        def decide(self, **facts: Any) -> str:
            return "reject"

    picky = admitgate.AdmissionGate(Refuse())

    async def main() -> None:
        async with client(env) as c:
            front(hot)
            response = await c.post("/", json=jsonrpc("SendMessage", send_params("echo"), 3))
            assert response.status_code == 503
            check_retry_after(response)
            assert response.json()["error"]["data"]["reason"] == "memory_pressure"
            assert response.headers["admitgate-reason"] == "memory_pressure"
            response = await c.post("/message:send", json=send_params("echo"))
            assert response.status_code == 503
            assert response.json()["error"]["status"] == "UNAVAILABLE"
            front(picky)
            response = await c.post("/", json=jsonrpc("SendMessage", send_params("echo"), 4))
            assert response.status_code == 429 and "retry-after" not in response.headers
            assert response.headers["admitgate-reason"] == "policy"
            assert response.json()["error"]["data"] == {"reason": "policy", "retryAfter": None}
            response = await c.post("/message:send", json=send_params("echo"))
            assert response.status_code == 429 and "retry-after" not in response.headers
            details = response.json()["error"]["details"]
            assert [d["@type"].rsplit(".", 1)[1] for d in details] == ["ErrorInfo"]
            assert details[0]["reason"] == "POLICY"

    run(main())
    assert rejected(hot, "jsonrpc", "memory_pressure") == 1
    assert rejected(picky, "rest", "policy") == 1


def test_the_retrying_client_gets_through_once_capacity_frees(env: Any, front: Any) -> None:
    from a2a.client import ClientConfig, create_client
    from a2a.types import Message, Part, Role, SendMessageRequest

    gate = new_gate(1)
    front(gate, retry_after=1)
    k = key()

    async def main() -> None:
        async with client(env) as c:
            held = asyncio.create_task(c.post("/", json=rpc_send(k)))
            await started(env, k)
            transport = RetryingTransport(jitter=0.0)
            async with httpx.AsyncClient(transport=transport, timeout=10) as http:
                sdk = await create_client(
                    agent_card(env.url),
                    client_config=ClientConfig(httpx_client=http, streaming=False),
                )
                request = SendMessageRequest(
                    message=Message(
                        role=Role.ROLE_USER,
                        message_id=str(uuid.uuid4()),
                        parts=[Part(text="echo through")],
                    )
                )

                async def release_after_refusal() -> None:
                    await wait_until(lambda: rejected(gate, "jsonrpc") == 1)
                    env.latches[k].release()

                releaser = asyncio.create_task(release_after_refusal())
                t0 = time.monotonic()
                events = [event async for event in sdk.send_message(request)]
                elapsed = time.monotonic() - t0
                await releaser
                assert events[0].message.parts[0].text == "through"
                assert transport.retries == 1
                assert 1.0 <= elapsed < 5
            assert (await held).status_code == 200

    run(main(), timeout=20)
    assert gate.transport_stats()["jsonrpc"]["admitted"] == 2
    assert rejected(gate, "jsonrpc") == 1


def test_under_a_path_prefix(env: Any, front: Any) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    gate = new_gate(1)
    front(gate, app=Starlette(routes=[Mount("/a2a", app=env.sdk_app)]), path_prefix="/a2a")
    k = key()

    async def main() -> None:
        async with client(env) as c:
            held = asyncio.create_task(c.post("/a2a/", json=rpc_send(k)))
            await started(env, k)
            assert in_flight(gate, "jsonrpc") == 1
            assert (await c.post("/a2a/message:send", json=send_params("echo"))).status_code == 429
            assert (await c.get("/a2a/custom")).status_code == 200
            env.latches[k].release()
            assert (await held).status_code == 200

    run(main(), timeout=20)
    assert counted(gate, "passthrough", 1) and rejected(gate, "rest") == 1
