"""``priority=`` on the in-process front doors: the ASGI middleware in front of the real A2A
SDK app on uvicorn, and the gRPC interceptor on a real grpc.aio server. Where the class comes
from (a header / metadata spec, a callable), that a missing or unknown class runs in the
default class and is counted (and exported by the Prometheus collector), that refusals name
the class, that a gate without classes answers exactly as before, and the argument checks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import admitgate
import admitgate.metrics
import grpc
import grpc.aio
import httpx
import pytest
from _a2a_app import A2A_HEADERS, ControlledExecutor, Latches, ServerThread, build_sdk_app
from _a2a_app import send_params as params
from _a2a_app import wait_until as wait_until_async
from _broker import key, wait_until
from admitgate._priority_door import defaulted
from admitgate.asgi import AdmissionMiddleware
from admitgate.grpc import AdmissionInterceptor
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import CollectorRegistry, generate_latest

CLASSES = [admitgate.PriorityClass("interactive", min_share=0.5), admitgate.PriorityClass("batch")]


def classed_gate(**kw: Any) -> admitgate.AdmissionGate:
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=2, queue_depth=2, priorities=CLASSES, **kw
    )
    assert gate is not None
    return gate


@pytest.fixture(scope="module")
def asgi() -> Iterator[Any]:
    latches = Latches()
    executor = ControlledExecutor(latches)
    server = ServerThread()
    gate = classed_gate()
    server.start(
        AdmissionMiddleware(
            build_sdk_app(executor, server.url),
            gate,
            priority="header:x-priority",
            session_id=lambda scope: dict(scope["headers"]).get(b"x-tenant", b"").decode(),
        )
    )
    client = httpx.Client(headers=A2A_HEADERS, timeout=30, limits=httpx.Limits(max_connections=32))
    yield gate, latches, executor, server, client
    client.close()
    latches.release_all()
    server.stop()


def post(client: httpx.Client, url: str, text: str, priority: Any, jsonrpc: bool = False) -> Any:
    headers = {} if priority is None else {"x-priority": priority}
    if jsonrpc:
        body = {"jsonrpc": "2.0", "id": "j", "method": "SendMessage", "params": params(text)}
        return client.post(url + "/", json=body, headers=headers)
    return client.post(url + "/message:send", json=params(text), headers=headers)


def test_asgi_interactive_first_refusals_name_the_class_and_defaults_are_counted(
    asgi: Any,
) -> None:
    gate, latches, executor, server, client = asgi
    runs, waiting, chat = [key(), key()], [key(), key()], key()
    results: dict[str, Any] = {}

    def hold(name: str, priority: str) -> None:
        results[name] = post(client, server.url, f"hold {name}", priority)

    threads = [threading.Thread(target=hold, args=(n, "batch")) for n in runs]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: all(latches[n].started.is_set() for n in runs))
        more = [threading.Thread(target=hold, args=(n, "batch")) for n in waiting]
        for thread in more:
            thread.start()
        threads += more
        wait_until(lambda: gate.stats()["classes"]["batch"]["queued"] == 2)
        # The queue is full (depth 2): an interactive turn sheds the oldest batch waiter.
        threads.append(threading.Thread(target=hold, args=(chat, "interactive")))
        threads[-1].start()
        wait_until(lambda: len(results) == 1)
        (shed,) = results.values()
        assert shed.status_code == 429
        assert shed.json()["error"]["details"][0]["metadata"]["priority"] == "batch"
        refused = post(client, server.url, "echo x", "batch", jsonrpc=True)
        assert refused.status_code == 429
        assert refused.json()["error"]["data"]["priority"] == "batch"
        latches[runs[0]].release()
        wait_until(lambda: latches[chat].started.is_set())
        assert not any(latches[n].started.is_set() for n in waiting)
        assert executor.peak_running <= 2
    finally:
        latches.release_all()
        for thread in threads:
            thread.join(15)
    before = defaulted(gate)
    admitted = dict(gate.stats()["classes"]["batch"])
    for value in (None, "", "urgent", b"\xe9"):
        assert post(client, server.url, "echo y", value).status_code == 200
    after = defaulted(gate)
    assert after["missing"] - before["missing"] == 2
    assert after["unknown"] - before["unknown"] == 2
    assert gate.stats()["classes"]["batch"]["admitted"] - admitted["admitted"] == 4
    registry = CollectorRegistry()
    admitgate.metrics.register(gate, registry)
    text = generate_latest(registry).decode()
    assert f'admitgate_priority_defaulted_total{{cause="unknown"}} {after["unknown"]:.1f}' in text
    assert 'admitgate_class_inflight_requests{class="interactive"}' in text


async def _refusal_without_classes() -> tuple[dict[str, Any], dict[str, Any]]:
    """A JSON-RPC and a REST refusal from a gate without classes, through the middleware."""
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    assert gate is not None
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    door = AdmissionMiddleware(app, gate)
    transport = httpx.ASGITransport(app=door)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        first = asyncio.ensure_future(c.post("/message:send", json=params("hold")))
        await asyncio.sleep(0.05)
        rest = (await c.post("/message:send", json=params("x"))).json()
        body = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": params("x")}
        rpc = (await c.post("/", json=body)).json()
        release.set()
        await first
    return rest, rpc


def test_a_gate_without_classes_refuses_exactly_as_before() -> None:
    rest, rpc = asyncio.run(_refusal_without_classes())
    assert set(rest["error"]["details"][0]["metadata"]) == {"reason", "retryAfter"}
    assert set(rpc["error"]["data"]) == {"reason", "retryAfter"}


def test_priority_arguments_are_checked() -> None:
    plain = admitgate.build_admission_gate(max_concurrent_runs=1)

    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    with pytest.raises(ValueError, match=r"priority='header:x-priority' needs a gate built"):
        AdmissionMiddleware(app, plain, priority="header:x-priority")
    gate = classed_gate()
    for bad in ("x-priority", "header:", "header:X-Priority", "metadata:key-bin", "cookie:a"):
        with pytest.raises(ValueError, match=r"priority must be 'header:NAME'.*got '"):
            AdmissionMiddleware(app, gate, priority=bad)
    with pytest.raises(TypeError, match=r"priority must be None, .* got 3"):
        AdmissionInterceptor(gate, priority=3)  # type: ignore[arg-type]


# -- gRPC -----------------------------------------------------------------------------------

METHOD = "/lf.a2a.v1.A2AService/SendMessage"


async def _grpc_scenario(priority: Any) -> dict[str, Any]:
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, priorities=CLASSES)
    assert gate is not None
    release = asyncio.Event()

    async def send_message(request: bytes, context: Any) -> bytes:
        if request == b"hold":
            await release.wait()
        return request

    handler = grpc.method_handlers_generic_handler(
        "lf.a2a.v1.A2AService", {"SendMessage": grpc.unary_unary_rpc_method_handler(send_message)}
    )
    server = grpc.aio.server(interceptors=[AdmissionInterceptor(gate, priority=priority)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out: dict[str, Any] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(METHOD)
            held = asyncio.ensure_future(call(b"hold", metadata=(("x-priority", "interactive"),)))
            await wait_until_async(lambda: gate.stats()["in_flight"] == 1)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(b"x", metadata=(("x-priority", "batch"),))
            out["trailers"] = dict(refused.value.trailing_metadata() or ())
            out["code"] = refused.value.code()
            release.set()
            assert await held == b"hold"
            for value in ("", "nope"):
                assert await call(b"y", metadata=(("x-priority", value),)) == b"y"
            assert await call(b"z") == b"z"
    finally:
        await server.stop(None)
    out["classes"] = gate.stats()["classes"]
    out["defaulted"] = defaulted(gate)
    return out


@pytest.mark.parametrize(
    "priority",
    [
        "metadata:x-priority",
        lambda details: dict(details.invocation_metadata).get("x-priority"),
    ],
    ids=["metadata", "callable"],
)
def test_grpc_class_from_metadata_refusal_names_it_and_defaults_are_counted(
    priority: Any,
) -> None:
    out = asyncio.run(_grpc_scenario(priority))
    assert out["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert out["trailers"]["admitgate-priority"] == "batch"
    status = status_pb2.Status.FromString(out["trailers"]["grpc-status-details-bin"])
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    assert dict(info.metadata) == {"reason": "queue_full", "priority": "batch"}
    assert out["classes"]["interactive"]["admitted"] == 1
    # "", "nope" and no metadata at all: three turns in the default class.
    assert out["classes"]["batch"]["admitted"] == 3
    assert out["classes"]["batch"]["rejected"] == 1
    assert out["defaulted"] == {"missing": 2, "unknown": 1}
