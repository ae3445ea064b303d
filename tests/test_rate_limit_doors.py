"""Budgets at the in-process front doors: ``AdmissionMiddleware`` on uvicorn in front of the
A2A SDK app, and ``AdmissionInterceptor`` on a grpc.aio A2A server, both on a gate built with
``rate_limit=RateLimit(...)`` and keyed by ``rate_key=``.

As for the broker (tests/test_broker_rate_limit.py): every refusal the documented 429 with
the exact ``Retry-After`` and the RateLimit fields, identities never shown, usage reports
settled and removed before the client, and an invariant suite on generated keys and bursts
counting what reached the agent.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import admitgate
import grpc
import grpc.aio
import httpx
import pytest
from _a2a_app import A2A_HEADERS, ControlledExecutor, Latches, ServerThread, build_sdk_app, jsonrpc
from _a2a_app import send_params as _send_params
from _grpc_a2a import A2AServer, LoopThread, user_message
from _usage_agent import USAGE, UsageReportingAgent, UsageTrailer
from a2a.types import a2a_pb2_grpc
from admitgate.asgi import AdmissionMiddleware
from admitgate.grpc import AdmissionInterceptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

LIMIT = 5
POLICY = '"requests-per-min";q=5;w=60, "tokens-per-min";q=1000;w=60;qu="tokens"'


def budget_gate() -> Any:
    limit = admitgate.RateLimit(requests=f"{LIMIT}/min", tokens="1000/min")
    return admitgate.build_admission_gate(rate_limit=limit)


@pytest.fixture(scope="module")
def http() -> Iterator[Any]:
    latches = Latches()
    server = ServerThread()
    agent = UsageReportingAgent(build_sdk_app(ControlledExecutor(latches), server.url))
    gate = budget_gate()
    door = AdmissionMiddleware(
        agent, gate, rate_key="header:x-api-key|header:authorization", cost=100
    )
    server.start(door)
    client = httpx.Client(headers=A2A_HEADERS, timeout=30, limits=httpx.Limits(max_connections=64))
    yield agent, door, gate, server, client
    client.close()
    latches.release_all()
    server.stop()


def send(client: httpx.Client, url: str, headers: dict[str, str], rpc_id: str) -> httpx.Response:
    body = jsonrpc("SendMessage", _send_params(f"echo {rpc_id}"), rpc_id)
    return client.post(url + "/", json=body, headers=headers)


def check_refusal(response: httpx.Response, rpc_id: str, policy: str) -> int:
    assert response.status_code == 429, response.text
    assert response.headers["admitgate-reason"] == "rate_limited"
    retry_after = int(response.headers["retry-after"])
    assert response.headers["ratelimit-policy"] == POLICY
    assert response.headers["ratelimit"] == f'"{policy}";r=0;t={retry_after}'
    body = response.json()
    assert body["id"] == rpc_id and body["error"]["code"] == -32029
    assert body["error"]["data"] == {"reason": "rate_limited", "retryAfter": retry_after}
    return retry_after


def test_http_refusals_carry_the_exact_retry_time_and_the_fields(
    http: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    agent, door, gate, server, client = http
    api_key = f"sk-{uuid.uuid4().hex}"
    sent = []
    for i in range(LIMIT + 2):
        before = time.monotonic()
        response = send(client, server.url, {"x-api-key": api_key}, f"r{i}")
        sent.append((before, time.monotonic(), response))
    assert [s[2].status_code for s in sent] == [200] * LIMIT + [429, 429]
    assert agent.reached[api_key] == LIMIT
    first_sent, first_answered = sent[0][0], sent[0][1]
    for before, after, response in sent[LIMIT:]:
        retry_after = check_refusal(response, response.json()["id"], "requests-per-min")
        assert math.ceil(first_sent + 60 - after) <= retry_after
        assert retry_after <= math.ceil(first_answered + 60 - before)
    assert gate.stats()["rate_limits"]["default"]["limited"] >= 2
    shown = repr(gate.stats()) + "".join(s[2].text + repr(s[2].headers) for s in sent)
    # admitgate's own log lines, at every level (the A2A SDK logs request headers at DEBUG:
    # that is the app's business, not the door's).
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("admitgate")]
    assert api_key not in shown + "".join(ours)


def test_http_usage_is_settled_and_removed(http: Any) -> None:
    agent, door, gate, server, client = http
    api_key = f"u-{uuid.uuid4().hex}"
    reported = dict(door.usage_reports)
    response = send(client, server.url, {"x-api-key": api_key, "x-test-usage": "950"}, "u1")
    assert response.status_code == 200 and USAGE not in response.headers
    # 950 used against an estimate of 100: the next 100 does not fit 1000 tokens/min.
    check_refusal(send(client, server.url, {"x-api-key": api_key}, "u2"), "u2", "tokens-per-min")
    other = f"u-{uuid.uuid4().hex}"
    response = send(client, server.url, {"x-api-key": other, "x-test-usage": "lots"}, "u3")
    assert response.status_code == 200 and USAGE not in response.headers
    assert door.usage_reports["reported"] == reported["reported"] + 1
    assert door.usage_reports["malformed"] == reported["malformed"] + 1
    # A passthrough answer (the agent card) never carries it either.
    card = client.get(server.url + "/.well-known/agent-card.json", headers={"x-test-usage": "1"})
    assert card.status_code == 200 and USAGE not in card.headers


@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    bursts=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 9), st.booleans()), min_size=1, max_size=5
    )
)
def test_http_invariants_under_generated_keys_and_bursts(http: Any, bursts: list[Any]) -> None:
    agent, door, gate, server, client = http
    run = uuid.uuid4().hex[:10]
    sent: Counter[str] = Counter()
    admitted: Counter[str] = Counter()

    def one(index: int, header: str, key: str, report: bool) -> None:
        headers = {header: key, **({"x-test-usage": "0"} if report else {})}
        response = send(client, server.url, headers, f"{run}-{index}")
        assert USAGE not in response.headers
        if response.status_code == 200:
            admitted[key] += 1
        else:
            check_refusal(response, f"{run}-{index}", "requests-per-min")

    jobs = []
    for which, size, report in bursts:
        key = f"{run}-{which}"
        header = "authorization" if which % 2 else "x-api-key"
        for _ in range(size):
            jobs.append((len(jobs), header, key, report))
            sent[key] += 1
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda job: one(*job), jobs))
    for key, count in sent.items():
        assert agent.reached[key] == admitted[key] == min(count, LIMIT)


def test_bad_arguments_name_the_argument_and_the_value() -> None:
    gate = budget_gate()
    app = build_sdk_app(ControlledExecutor(Latches()), "http://127.0.0.1:1")
    for rate_key, cost, expected in [
        ("cookie:sid", 0, "rate_key='cookie:sid': each source"),
        ("header:X-Key", 0, "rate_key='header:X-Key': 'X-Key' is not"),
        ("tenant", 0, "rate_key='tenant' reads the tenant: it needs session_id"),
        ("header:x-api-key", -1, "cost must be an int >= 0 (tokens), got -1"),
    ]:
        with pytest.raises(
            ValueError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")
        ):
            AdmissionMiddleware(app, gate, rate_key=rate_key, cost=cost)
        with pytest.raises(ValueError):
            AdmissionInterceptor(gate, rate_key=rate_key.replace("header", "metadata"), cost=cost)
    with pytest.raises(TypeError, match="rate_key must be a str or None, got 5"):
        AdmissionMiddleware(app, gate, rate_key=5)  # type: ignore[arg-type]


def test_grpc_calls_spend_the_metadata_keys_budget_and_usage_is_removed() -> None:
    loop = LoopThread()
    gate = budget_gate()
    door = AdmissionInterceptor(gate, rate_key="metadata:x-api-key", cost=100)
    server = A2AServer([door, UsageTrailer()])
    loop.run(server.start())
    api_key = f"g-{uuid.uuid4().hex}"

    async def main() -> tuple[Any, list[Any]]:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            call = stub.SendMessage(
                user_message("echo-u"), metadata=(("x-api-key", api_key), ("x-test-usage", "7"))
            )
            await call
            trailers = await call.trailing_metadata()
            outcomes = []
            for i in range(LIMIT + 1):
                try:
                    await stub.SendMessage(
                        user_message(f"echo-{i}"), metadata=(("x-api-key", api_key),)
                    )
                    outcomes.append("ok")
                except grpc.aio.AioRpcError as refused:
                    outcomes.append(refused)
            return trailers, outcomes

    try:
        trailers, outcomes = loop.run(main())
    finally:
        loop.run(server.stop())
        loop.close()
    assert USAGE not in dict(trailers) and dict(trailers)["x-kept"] == "1"
    assert outcomes[: LIMIT - 1] == ["ok"] * (LIMIT - 1)
    refused = outcomes[-1]
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    metadata = dict(refused.trailing_metadata())
    assert metadata["admitgate-reason"] == "rate_limited"
    assert 50_000 < int(metadata["grpc-retry-pushback-ms"]) <= 60_000
    assert door.usage_reports == {"reported": 1, "malformed": 0}
    assert gate.stats()["rate_limits"]["default"]["tokens_settled"] == 7
