"""``--tenant-from path``: the broker's tenant is the one the A2A SDK's router takes from the
path (``Mount("/{tenant}", ...)``, the call context's ``tenant``), as ``crates/classify``
computes it for both front doors. A differential test on generated paths against the real
SDK app on uvicorn, observed through the broker's per-tenant cap.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from _a2a_app import (
    A2A_HEADERS,
    ControlledExecutor,
    Latches,
    ServerThread,
    build_sdk_app,
    send_params,
)
from _broker import BrokerProcess, build_broker
from a2a.helpers.proto_helpers import get_message_text
from a2a.server.agent_execution import RequestContext
from a2a.server.events import EventQueue


class TenantRecordingExecutor(ControlledExecutor):
    """The test agent, remembering the tenant the SDK handed each message's call."""

    def __init__(self, latches: Latches) -> None:
        super().__init__(latches)
        self.tenants: dict[str, str] = {}

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        self.tenants[get_message_text(context.message)] = context.tenant
        await super().execute(context, event_queue)


@pytest.fixture(scope="module")
def env() -> Iterator[Any]:
    latches = Latches()
    executor = TenantRecordingExecutor(latches)
    agent = ServerThread()
    agent.start(build_sdk_app(executor, agent.url))
    broker = BrokerProcess(
        build_broker(),
        "--upstream",
        agent.url,
        "--max-in-flight",
        "1000",
        "--max-in-flight-per-tenant",
        "1",
        "--tenant-from",
        "path",
    )
    # One client for the module: a client per request costs more than the request.
    client = httpx.Client(headers=A2A_HEADERS, timeout=30, limits=httpx.Limits(max_connections=100))
    yield latches, executor, agent, broker, client
    client.close()
    latches.release_all()
    assert broker.stop() == 0
    agent.stop()


#: Segments that are route words elsewhere in the SDK's table: each is a tenant below the
#: mount, as Starlette routes it.
ROUTE_WORDS = ["tasks", "message:send", "message:stream", "extendedAgentCard", "card"]
ALPHABET = "abcxyz019:._-~@!$&'()*+,;= \u00e9\u4e2d%\n"


def _segment(rng: random.Random, index: int) -> str:
    """A tenant segment, percent-encoded as a client sends it, unique by ``index``."""
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 8)))
    return quote(f"{text}{index}", safe=":@!$&'()*+,;=~")


def _generated_paths(rng: random.Random) -> list[str]:
    # (The v0.3 routes, /v1/..., want v0.3 bodies; crates/classify's tests cover them.)
    paths = ["/message:send", "/message:send%0A"]
    paths += [f"/{word}/message:send" for word in ROUTE_WORDS]
    for i in range(24):
        segment = _segment(rng, i)
        paths.append(
            rng.choice(
                [
                    f"/{segment}/message:send",
                    f"/{segment}/message:send",
                    f"/{segment}%2Fx/message:send",  # decoded: two segments, a 404
                    f"/{segment}/v1/message:send",  # below the mount only 1.0 routes: 404
                    f"/{segment}/message:send%0A",
                ]
            )
        )
    return paths


def post(client: httpx.Client, url: str, path: str, text: str) -> httpx.Response:
    return client.post(url + path, json=send_params(text))


def test_the_path_tenant_is_the_sdk_routers_tenant(env: Any) -> None:
    """Fails before the fix: the broker took the first path segment, except route words, so
    ``/tasks/message:send`` (tenant ``tasks`` for the SDK) had none."""
    latches, executor, agent, broker, client = env
    paths = _generated_paths(random.Random(1201))
    # The truth: what the SDK's router makes of each path, asked directly.
    truth: dict[str, str | None] = {}
    for i, path in enumerate(paths):
        text = f"echo truth-{i}-{uuid.uuid4().hex[:6]}"
        answer = post(client, agent.url, path, text)
        truth[path] = executor.tenants[text] if answer.status_code == 200 else None
        assert answer.status_code in (200, 404), (path, answer.status_code)
    routed = [p for p in paths if truth[p] is not None]
    assert any(truth[p] for p in routed) and any(truth[p] == "" for p in routed)
    assert truth["/tasks/message:send"] == "tasks"
    # Through the broker, one held turn per routed path: its tenant is at its cap of 1.
    keys = {path: uuid.uuid4().hex[:10] for path in routed}
    results: dict[str, int] = {}

    def hold(path: str) -> None:
        results[path] = post(client, broker.url, path, f"hold {keys[path]}").status_code

    threads = [threading.Thread(target=hold, args=(p,), daemon=True) for p in routed]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 15
        while not all(latches[keys[p]].started.is_set() for p in routed):
            assert time.monotonic() < deadline, "not every held turn started"
            assert not results, results  # none may be refused: tenants are unique
            time.sleep(0.01)
        mismatches = []
        for path in routed:
            tenant = truth[path]
            if tenant:
                # The same tenant by its plainest path: refused at the tenant's cap.
                probe = post(
                    client, broker.url, f"/{quote(tenant, safe='')}/message:send", "echo p"
                )
                expected = (429, "queue_full")
            else:
                # No tenant: no per-tenant cap, so the same path again runs.
                probe = post(client, broker.url, path, "echo p")
                expected = (200, None)
            seen = (probe.status_code, probe.headers.get("admitgate-reason"))
            if seen != expected:
                mismatches.append((path, tenant, seen))
        assert not mismatches, mismatches
        # Paths the SDK does not route pass through, ungated, to the agent's 404.
        for path in paths:
            if truth[path] is None:
                assert post(client, broker.url, path, "echo p").status_code == 404, path
    finally:
        for path in routed:
            latches[keys[path]].release()
        for thread in threads:
            thread.join(10)
    assert all(code == 200 for code in results.values()), results
