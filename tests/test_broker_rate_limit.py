"""The broker's budgets (``--rate-limit``, ``--rate-key``) against the real broker binary, a
real A2A SDK agent on uvicorn and a grpc.aio A2A server.

The agent reports each turn's token use as an ``admitgate-usage-tokens`` response header
(an ASGI wrapper around the SDK app, as an agent reading its provider's usage would) or a
gRPC trailer (a server interceptor); the test chooses the value per request.

The invariant suite generates clients, keys and bursts and checks at the agent what the docs
promise: admitted per identity per window <= the limit, every refusal the documented 429
(JSON-RPC body, ``Retry-After`` within the exact retry time's bounds, the RateLimit fields),
and no usage report ever reaching a client.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from _a2a_app import A2A_HEADERS, ControlledExecutor, Latches, ServerThread, build_sdk_app, jsonrpc
from _a2a_app import send_params as _send_params
from _broker import BrokerProcess, build_broker
from _grpc_a2a import A2AServer, LoopThread, user_message
from _usage_agent import USAGE, UsageReportingAgent, UsageTrailer
from a2a.types import a2a_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REQUESTS_PER_MIN = 5
POLICY = '"requests-per-min";q=5;w=60, "tokens-per-min";q=1000;w=60;qu="tokens"'
FLEET_POLICY = '"requests-per-min";q=5;w=60'


@pytest.fixture(scope="module")
def env() -> Iterator[Any]:
    latches = Latches()
    executor = ControlledExecutor(latches)
    server = ServerThread()
    agent = UsageReportingAgent(build_sdk_app(executor, server.url))
    agent.url = server.url
    server.start(agent)
    loop = LoopThread()
    grpc_server = A2AServer([UsageTrailer()])
    loop.run(grpc_server.start())
    broker = BrokerProcess(
        build_broker(),
        "--upstream",
        server.url,
        "--grpc-upstream",
        f"http://{grpc_server.target}",
        "--max-in-flight",
        "1000",
        "--rate-limit",
        f"requests={REQUESTS_PER_MIN}/min,tokens=1000/min,cost=100",
        "--rate-key",
        "header:x-api-key|header:authorization",
    )
    client = httpx.Client(headers=A2A_HEADERS, timeout=30, limits=httpx.Limits(max_connections=64))
    yield agent, broker, client, grpc_server, loop
    client.close()
    latches.release_all()
    assert broker.stop() == 0
    loop.run(grpc_server.stop())
    loop.close()
    server.stop()


def send(client: httpx.Client, url: str, headers: dict[str, str], rpc_id: str) -> httpx.Response:
    body = jsonrpc("SendMessage", _send_params(f"echo {rpc_id}"), rpc_id)
    return client.post(url + "/", json=body, headers=headers)


def check_refusal(
    response: httpx.Response, rpc_id: str, refused_by: str, policy: str = POLICY
) -> int:
    """The documented rate_limited refusal by policy ``refused_by``; returns its
    Retry-After."""
    assert response.status_code == 429, response.text
    assert response.headers["admitgate-reason"] == "rate_limited"
    retry_after = int(response.headers["retry-after"])
    assert retry_after >= 1
    assert response.headers["ratelimit-policy"] == policy
    assert response.headers["ratelimit"] == f'"{refused_by}";r=0;t={retry_after}'
    body = response.json()
    assert body["id"] == rpc_id
    assert body["error"]["code"] == -32029
    assert body["error"]["data"] == {"reason": "rate_limited", "retryAfter": retry_after}
    return retry_after


def test_a_key_over_its_budget_is_refused_with_the_exact_retry_time(env: Any) -> None:
    agent, broker, client, _, _ = env
    api_key = f"sk-{uuid.uuid4().hex}"
    sent: list[tuple[float, float, httpx.Response]] = []
    for i in range(REQUESTS_PER_MIN + 3):
        before = time.monotonic()
        response = send(client, broker.url, {"x-api-key": api_key}, f"r{i}")
        sent.append((before, time.monotonic(), response))
    admitted = [s for s in sent if s[2].status_code == 200]
    assert len(admitted) == REQUESTS_PER_MIN
    assert agent.reached[api_key] == REQUESTS_PER_MIN
    first_sent, first_answered = admitted[0][0], admitted[0][1]
    for i, (before, after, response) in enumerate(sent[REQUESTS_PER_MIN:]):
        retry_after = check_refusal(response, f"r{REQUESTS_PER_MIN + i}", "requests-per-min")
        # The exact retry time is the first admission's plus the window: between these.
        assert math.ceil(first_sent + 60 - after) <= retry_after
        assert retry_after <= math.ceil(first_answered + 60 - before)
    # Another key, and the same key as an Authorization header instead, are other budgets.
    assert send(client, broker.url, {"x-api-key": "other-" + api_key}, "o").status_code == 200
    assert send(client, broker.url, {"authorization": api_key}, "a").status_code == 200


def test_key_values_are_never_shown(env: Any) -> None:
    agent, broker, client, _, _ = env
    secret = f"sk-live-{uuid.uuid4().hex}"
    seen = []
    for i in range(REQUESTS_PER_MIN + 1):
        response = send(client, broker.url, {"authorization": f"Bearer {secret}"}, f"s{i}")
        seen.append(response.text + json.dumps(dict(response.headers)))
    assert "rate_limited" in seen[-1]
    metrics = httpx.get(broker.metrics_url + "/metrics", timeout=5).text
    assert 'broker_rate_limit_limited_total{limit="agent:default"}' in metrics
    shown = "\n".join([*seen, metrics, *broker.raw])
    assert secret not in shown and secret[:16] not in shown


def test_usage_reports_are_settled_and_never_reach_the_client(env: Any) -> None:
    agent, broker, client, _, _ = env
    before = broker.metrics()
    api_key = f"k-{uuid.uuid4().hex}"
    # Reported 950 against an estimate of 100: a debt of 850, so the next (100 more) does
    # not fit the 1000 tokens/min, while the requests limit still would.
    response = send(client, broker.url, {"x-api-key": api_key, "x-test-usage": "950"}, "u1")
    assert response.status_code == 200 and USAGE not in response.headers
    check_refusal(send(client, broker.url, {"x-api-key": api_key}, "u2"), "u2", "tokens-per-min")
    # A malformed report is ignored (the estimate stays), counted, and still stripped.
    other = f"k-{uuid.uuid4().hex}"
    for value in ["-1", "12x", "1.5", "0x10"]:
        response = send(client, broker.url, {"x-api-key": other, "x-test-usage": value}, "m")
        assert response.status_code == 200 and USAGE not in response.headers
    after = broker.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    # A passthrough answer (the agent card) is stripped too: counted as unmatched.
    card = client.get(broker.url + "/.well-known/agent-card.json", headers={"x-test-usage": "3"})
    assert card.status_code == 200 and USAGE not in card.headers
    after = broker.metrics()
    assert grew('broker_rate_limit_usage_reports_total{outcome="unmatched"}') == 1
    assert grew('broker_rate_limit_usage_reports_total{outcome="settled"}') == 1
    assert grew('broker_rate_limit_usage_reports_total{outcome="malformed"}') == 4
    assert grew('broker_rate_limit_tokens_settled_total{limit="agent:default"}') == 950
    assert grew('broker_rate_limit_refused_total{policy="tokens-per-min"}') == 1


def test_a_grpc_usage_trailer_is_settled_and_stripped(env: Any) -> None:
    agent, broker, client, grpc_server, loop = env
    before = broker.metrics()
    api_key = f"g-{uuid.uuid4().hex}"

    async def main() -> tuple[Any, Any]:
        async with grpc.aio.insecure_channel(broker.address) as channel:
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            metadata = (("x-api-key", api_key), ("x-test-usage", "40"))
            call = stub.SendMessage(user_message("echo-usage"), metadata=metadata)
            await call
            first = await call.trailing_metadata()
            for _ in range(REQUESTS_PER_MIN):
                try:
                    await stub.SendMessage(user_message("echo"), metadata=(("x-api-key", api_key),))
                except grpc.aio.AioRpcError as refused:
                    return first, refused
            raise AssertionError("never refused")

    trailers, refused = loop.run(main())
    assert USAGE not in dict(trailers) and dict(trailers).get("x-kept") == "1"
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    refusal = dict(refused.trailing_metadata())
    assert refusal["admitgate-reason"] == "rate_limited"
    assert int(refusal["grpc-retry-pushback-ms"]) > 1000
    after = broker.metrics()
    assert (
        after['broker_rate_limit_usage_reports_total{outcome="settled"}']
        - before['broker_rate_limit_usage_reports_total{outcome="settled"}']
        == 1
    )


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    bursts=st.lists(
        st.tuples(
            st.integers(0, 3),  # which of the example's keys (odd ones as Authorization)
            st.integers(1, 9),  # burst size, sent at once
            st.booleans(),  # the agent reports a usage (which must never reach the client)
        ),
        min_size=1,
        max_size=6,
    )
)
def test_invariants_under_generated_keys_and_bursts(env: Any, bursts: list[Any]) -> None:
    agent, broker, client, _, _ = env
    run = uuid.uuid4().hex[:10]  # fresh identities per example: each starts a fresh window
    sent: Counter[str] = Counter()
    admitted: Counter[str] = Counter()

    def one(index: int, header: str, key: str, report: bool) -> None:
        headers = {header: key}
        if report:
            headers["x-test-usage"] = "0"
        response = send(client, broker.url, headers, f"{run}-{index}")
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
        # At most the limit per identity per window, counted where it matters: the agent.
        assert agent.reached[key] == admitted[key] <= REQUESTS_PER_MIN
        # Nothing else refused them: each key got its whole limit while it asked for it.
        assert admitted[key] == min(count, REQUESTS_PER_MIN)


def test_requests_without_a_key_share_the_anonymous_budget(env: Any) -> None:
    """Leaving the key header out escapes nothing: every such request spends one budget."""
    agent, broker, client, _, _ = env
    codes = [send(client, broker.url, {}, f"n{i}").status_code for i in range(REQUESTS_PER_MIN + 2)]
    assert codes.count(200) <= REQUESTS_PER_MIN and codes[-1] == 429


def test_bad_flags_are_one_line_naming_the_flag() -> None:
    binary = build_broker()
    for args, expected in [
        (["--rate-limit", "requests=60/fortnight"], '--rate-limit "requests=60/fortnight": '),
        (["--rate-limit", "requests=1/s", "--rate-key", "cookie:sid"], '--rate-key "cookie:sid": '),
        (["--rate-key", "header:x-api-key"], "--rate-key needs --rate-limit"),
    ]:
        done = subprocess.run(
            [str(binary), "--upstream", "http://127.0.0.1:9", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2, done
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], done.stderr


def test_two_brokers_on_one_redis_share_each_budget_exactly(env: Any, redis_server: Any) -> None:
    """Fleet-wide: a burst spread over two brokers (the binary and ``python -m admitgate
    broker``) on one redis-server admits at most the limit per key, exactly the limit when
    asked for more; Redis holds no key value, only its hash."""
    agent, _, client, _, _ = env
    fleet_key = f"rl-{uuid.uuid4().hex[:8]}"
    common = (
        "--upstream",
        agent.url,
        "--max-in-flight",
        "1000",
        "--fleet",
        redis_server.url,
        "--fleet-key",
        fleet_key,
        "--rate-limit",
        f"requests={REQUESTS_PER_MIN}/min",
        "--rate-key",
        "header:x-api-key",
    )
    a = BrokerProcess(build_broker(), *common)
    b = BrokerProcess(sys.executable, *common, prefix=["-m", "admitgate", "broker"])
    try:
        keys = [f"sk-fleet-{uuid.uuid4().hex}" for _ in range(4)]
        jobs = [(i, keys[i % 4], (a, b)[i % 3 % 2]) for i in range(4 * (REQUESTS_PER_MIN + 4))]
        codes: Counter[str] = Counter()

        def one(job: tuple[int, str, BrokerProcess]) -> None:
            i, key, broker = job
            response = send(client, broker.url, {"x-api-key": key}, f"f{i}")
            if response.status_code == 200:
                codes[key] += 1
            else:
                check_refusal(response, f"f{i}", "requests-per-min", policy=FLEET_POLICY)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, jobs))
        for key in keys:
            assert agent.reached[key] == codes[key] == REQUESTS_PER_MIN
        stored = [name for name in redis_server.client().keys("*") if fleet_key in name]
        assert stored and not any(key in name for key in keys for name in stored)
    finally:
        assert a.stop() == 0
        assert b.stop() == 0


def test_on_limit_wait_holds_the_request_until_the_budget_allows(env: Any) -> None:
    """``on_limit=wait``: over the budget, a request waits (within --queue-timeout) for the
    exact time its budget allows it, then runs; nothing is refused."""
    agent = env[0]
    broker = BrokerProcess(
        build_broker(),
        "--upstream",
        agent.url,
        "--max-in-flight",
        "10",
        "--queue-timeout",
        "10",
        "--rate-limit",
        "requests=2/s,on_limit=wait",
        "--rate-key",
        "header:x-api-key",
    )
    try:
        with httpx.Client(headers=A2A_HEADERS, timeout=30) as client:
            started = time.monotonic()
            codes = [
                send(client, broker.url, {"x-api-key": "w"}, f"w{i}").status_code for i in range(5)
            ]
            took = time.monotonic() - started
        assert codes == [200] * 5
        # 5 at 2 per second: the 5th fits 2 s after the 1st (and never sooner).
        assert took >= 1.9, took
        waited = broker.gauge('broker_rate_limit_waited_total{limit="agent:default"}')
        assert waited >= 1
    finally:
        assert broker.stop() == 0


def test_with_redis_down_on_backend_error_decides(env: Any) -> None:
    """The fleet's Redis unreachable: ``on_backend_error=reject`` refuses
    ``fleet_unavailable`` (503, never over the limit); ``local`` decides with this broker's
    own budget (the limit still holds per broker)."""
    agent, _, client, _, _ = env
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}"
    for mode, expected in [("reject", [503] * 3), ("local", [200, 200, 429])]:
        broker = BrokerProcess(
            build_broker(),
            "--upstream",
            agent.url,
            "--max-in-flight",
            "10",
            "--fleet",
            dead,
            "--rate-limit",
            f"requests=2/min,on_backend_error={mode}",
            "--rate-key",
            "header:x-api-key",
        )
        try:
            answers = [send(client, broker.url, {"x-api-key": mode}, f"d{i}") for i in range(3)]
            assert [a.status_code for a in answers] == expected, [a.text for a in answers]
            if mode == "reject":
                assert {a.headers["admitgate-reason"] for a in answers} == {"fleet_unavailable"}
            else:
                check_refusal(
                    answers[2], "d2", "requests-per-min", policy='"requests-per-min";q=2;w=60'
                )
        finally:
            assert broker.stop() == 0
