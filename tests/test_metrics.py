"""admitgate.metrics, scraped from live endpoints after real traffic.

One A2A gRPC server (the SDK's handlers behind :class:`admitgate.grpc.AdmissionInterceptor`,
ceiling 2, queue 1) and a second gate used directly (``gate.admit()``) are exported on one
registry under the mesh broker's prefix, each with its ``gate`` label, and served by
``prometheus_client.start_http_server`` on 127.0.0.1; the test reads the text with httpx and
checks the names, labels and values the traffic implies.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import admitgate
import admitgate.metrics
import grpc
import grpc.aio
import httpx
import pytest
from _grpc_a2a import A2AServer, LoopThread, until, user_message
from a2a.types import a2a_pb2_grpc
from admitgate.grpc import AdmissionInterceptor
from admitgate.metrics import FLEET_METRICS, GateCollector, register, unregister
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY, CollectorRegistry, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Scraped:
    text: str
    types: dict[str, str]  # family name -> type
    samples: Samples

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]

    def has(self, name: str, **labels: str) -> bool:
        return (name, frozenset(labels.items())) in self.samples

    def names(self, prefix: str) -> set[str]:
        return {name for name, _ in self.samples if name.startswith(prefix)}


def scrape(url: str) -> Scraped:
    response = httpx.get(url, timeout=5.0)
    assert response.status_code == 200
    text = response.text
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return Scraped(text, types, samples)


@dataclass
class Endpoint:
    loop: LoopThread
    server: A2AServer
    a2a_gate: Any
    chat_gate: Any
    registry: CollectorRegistry
    url: str

    def scrape(self) -> Scraped:
        return scrape(self.url)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Endpoint]:
    loop = LoopThread()
    a2a_gate = admitgate.build_admission_gate(max_concurrent_runs=2, queue_depth=1)
    chat_gate = admitgate.build_admission_gate(max_concurrent_runs=3, queue_depth=0)
    server = A2AServer([AdmissionInterceptor(a2a_gate)])
    loop.run(server.start())
    registry = CollectorRegistry()
    register(a2a_gate, registry, prefix="broker", name="a2a")
    register(chat_gate, registry, prefix="broker", name="chat")
    http, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield Endpoint(
            loop,
            server,
            a2a_gate,
            chat_gate,
            registry,
            f"http://127.0.0.1:{http.server_port}/metrics",
        )
    finally:
        http.shutdown()
        http.server_close()
        thread.join(5.0)
        server.executor.release_all()
        loop.run(server.stop())
        loop.close()


def test_broker_names_after_traffic_through_grpc_and_the_gate(endpoint: Endpoint) -> None:
    e = endpoint
    executor = e.server.executor
    a2a = {"gate": "a2a"}

    async def saturate() -> list[Any]:
        ch = grpc.aio.insecure_channel(e.server.target)
        stub = a2a_pb2_grpc.A2AServiceStub(ch)
        held = [stub.SendMessage(user_message(f"hold:m{i}")) for i in range(2)]
        await executor.started("m0")
        await executor.started("m1")
        queued = stub.SendMessage(user_message("hold:m2"))
        await until(lambda: e.a2a_gate.queued == 1)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SendMessage(user_message("over"))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        return [ch, *held, queued]

    async def chat_turn(entered: asyncio.Event, leave: asyncio.Event) -> None:
        async with e.chat_gate.admit(session_id="u1"):
            entered.set()
            await leave.wait()

    channel, *calls = e.loop.run(saturate())
    entered, leave = asyncio.Event(), asyncio.Event()

    async def start_chat() -> asyncio.Task[None]:
        task = asyncio.ensure_future(chat_turn(entered, leave))
        await entered.wait()
        return task

    chat = e.loop.run(start_chat())

    busy = e.scrape()
    assert busy.types["broker_inflight_requests"] == "gauge"
    assert busy.types["broker_rejected"] == "counter"
    assert "# TYPE broker_rejected_total counter" in busy.text
    assert busy.value("broker_inflight_requests", transport="grpc", **a2a) == 2
    assert busy.value("broker_inflight_requests", transport="direct", gate="chat") == 1
    assert busy.value("broker_queued_requests", **a2a) == 1
    assert busy.value("broker_rejected_total", transport="grpc", reason="queue_full", **a2a) == 1
    assert busy.value("broker_rejected_total", transport="grpc", reason="shed", **a2a) == 0
    assert busy.value("broker_admitted_total", transport="grpc", **a2a) == 2
    assert busy.value("broker_limit", **a2a) == 2
    assert busy.value("broker_limit", gate="chat") == 3
    assert busy.value("broker_saturated", **a2a) == 1
    assert busy.value("broker_saturated", gate="chat") == 0
    # Only the finished calls are counted so far: the refusal and the health check.
    assert busy.value("broker_requests_total", transport="grpc", **a2a) == 1
    assert busy.value("broker_requests_total", transport="passthrough", **a2a) == 1
    # Every series carries its gate.
    assert all(dict(labels).get("gate") in ("a2a", "chat") for _, labels in busy.samples)
    assert not busy.names("broker_fleet")  # no fleet limit, no fleet series

    async def finish() -> None:
        executor.release("m0")
        executor.release("m1")
        await executor.started("m2")  # the queued call got the freed slot
        executor.release("m2")
        await asyncio.gather(*calls)
        await channel.close()
        leave.set()
        await chat

    e.loop.run(finish())

    done = e.scrape()
    assert done.value("broker_inflight_requests", transport="grpc", **a2a) == 0
    assert done.value("broker_queued_requests", **a2a) == 0
    assert done.value("broker_saturated", **a2a) == 0
    assert done.value("broker_admitted_total", transport="grpc", **a2a) == 3
    assert done.value("broker_admitted_total", transport="direct", gate="chat") == 1
    assert done.value("broker_requests_total", transport="grpc", **a2a) == 4
    assert not done.has("broker_requests_total", transport="direct", gate="chat")  # plain admit()
    hist = "broker_request_duration_seconds"
    assert done.value(f"{hist}_count", transport="grpc", **a2a) == 4
    assert done.value(f"{hist}_bucket", transport="grpc", le="+Inf", **a2a) == 4
    assert done.value(f"{hist}_sum", transport="grpc", **a2a) > 0
    assert done.value("broker_queue_wait_seconds_count", **a2a) == 1
    assert done.value("broker_queue_wait_seconds_bucket", le="+Inf", **a2a) == 1
    # The exposition is exactly the gate's figures, bucket by bucket.
    native = e.a2a_gate.request_stats()["grpc"]
    for bound, count in native["buckets"]:
        le = "+Inf" if math.isinf(bound) else repr(float(bound))
        assert done.value(f"{hist}_bucket", transport="grpc", le=le, **a2a) == count
    assert done.value(f"{hist}_sum", transport="grpc", **a2a) == pytest.approx(native["sum"])


def test_default_registry_and_prefix_then_unregister() -> None:
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=0)
    collector = register(gate)
    http, thread = start_http_server(0, addr="127.0.0.1")
    url = f"http://127.0.0.1:{http.server_port}/metrics"
    try:

        async def one_turn() -> None:
            async with gate.admit(transport="jsonrpc"):
                with pytest.raises(admitgate.AdmissionRejected):
                    async with gate.admit(transport="jsonrpc"):
                        pass
                assert scrape(url).value("admitgate_saturated") == 1

        asyncio.run(one_turn())
        got = scrape(url)
        assert got.value("admitgate_limit") == 1
        assert got.value("admitgate_admitted_total", transport="jsonrpc") == 1
        assert got.value("admitgate_rejected_total", transport="jsonrpc", reason="queue_full") == 1
        assert got.value("admitgate_inflight_requests", transport="jsonrpc") == 0
        assert got.value("admitgate_saturated") == 0
        assert all(
            "gate" not in dict(labels)
            for name, labels in got.samples
            if name.startswith("admitgate_")
        )
        unregister(gate)
        assert not scrape(url).names("admitgate_")
        # registry.unregister(collector) works as well, for every gate of the prefix.
        fresh = register(gate)
        assert fresh is not collector and scrape(url).value("admitgate_limit") == 1
        other = register(admitgate.build_admission_gate(max_concurrent_runs=5), prefix="other")
        assert scrape(url).value("other_limit") == 5
        REGISTRY.unregister(other)
        REGISTRY.unregister(fresh)
        assert not scrape(url).names("admitgate_") and not scrape(url).names("other_")
        assert register(gate) is not fresh  # the prefix is free again
        unregister(gate)
    finally:
        http.shutdown()
        http.server_close()
        thread.join(5.0)


class _FleetStatsGate(admitgate.AdmissionGate):
    """A local gate whose stats() also carries the keys a fleet limit adds (issue 10), with
    fixed figures: the export of those keys is tested before the fleet limit exists."""

    fleet: dict[str, float] = {}

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), **self.fleet}


def test_fleet_figures_are_exported_when_present() -> None:
    registry = CollectorRegistry()
    gate = _FleetStatsGate(admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=4))
    gate.fleet = {
        "fleet_in_flight": 7,
        "fleet_max_in_flight": 20,
        "fleet_backend_up": 1,
        "fleet_lease_lost": 2,
        "fleet_borrowed": 1,
        "fleet_outages": 3,
        "fleet_failovers": 1,
    }
    register(gate, registry, prefix="broker")
    http, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{http.server_port}/metrics"
    try:
        got = scrape(url)
        assert got.value("broker_limit") == 20  # the fleet cap bounds the agent
        assert got.value("broker_fleet_in_flight") == 7
        assert got.value("broker_fleet_max_in_flight") == 20
        assert got.value("broker_fleet_backend_up") == 1
        assert got.value("broker_fleet_lease_lost_total") == 2
        assert got.value("broker_fleet_borrowed") == 1
        assert got.value("broker_fleet_outages_total") == 3
        assert got.value("broker_fleet_failovers_total") == 1
        for key, (kind, _) in FLEET_METRICS.items():
            assert got.types[f"broker_{key}"] == kind
        gate.fleet = {"fleet_max_in_flight": 0, "fleet_backend_up": 0}
        got = scrape(url)
        assert got.value("broker_limit") == 4  # no fleet cap: the local ceiling
        assert got.value("broker_fleet_backend_up") == 0
        assert not got.has("broker_fleet_in_flight")
    finally:
        http.shutdown()
        http.server_close()
        thread.join(5.0)


def test_registration_rules() -> None:
    registry = CollectorRegistry()
    a = admitgate.build_admission_gate(max_concurrent_runs=1)
    b = admitgate.build_admission_gate(max_concurrent_runs=2)
    collector = register(a, registry, prefix="x", name="a")
    assert isinstance(collector, GateCollector) and collector.prefix == "x"
    assert register(b, registry, prefix="x", name="b") is collector
    assert collector.gates == {"a": a, "b": b}
    with pytest.raises(ValueError, match="already exported"):
        register(a, registry, prefix="x", name="c")
    with pytest.raises(ValueError, match="a gate named 'b' is already exported"):
        register(
            admitgate.build_admission_gate(max_concurrent_runs=1), registry, prefix="x", name="b"
        )
    with pytest.raises(ValueError, match="give each a distinct name="):
        register(admitgate.build_admission_gate(max_concurrent_runs=1), registry, prefix="x")
    # The same gate under another prefix is a separate collector.
    assert register(a, registry, prefix="y") is not collector
    with pytest.raises(ValueError, match="give each a distinct name="):
        register(b, registry, prefix="y", name="b")
    # Names another collector owns are refused.
    Gauge("z_limit", "someone else's", registry=registry)
    with pytest.raises(ValueError, match="z_limit is already registered"):
        register(a, registry, prefix="z")
    unregister(a, registry, prefix="x")
    assert collector.gates == {"b": b}
    with pytest.raises(ValueError, match="is not exported"):
        unregister(a, registry, prefix="x")
    unregister(b, registry, prefix="x")
    with pytest.raises(ValueError, match="no admitgate metrics with prefix 'x'"):
        unregister(b, registry, prefix="x")
    # Names are free again: a plain gate may take the prefix.
    register(b, registry, prefix="x")


def test_arguments_are_validated() -> None:
    registry = CollectorRegistry()
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    with pytest.raises(TypeError, match="gate must be an admitgate.AdmissionGate, got None"):
        register(None, registry)
    with pytest.raises(TypeError, match="gate must be"):
        register(object(), registry)
    for prefix in ("", "1x", "a-b", "a:b", "a b", "__x", "x_", "x" * 65, None, 3):
        with pytest.raises(ValueError, match="prefix must"):
            register(gate, registry, prefix=prefix)  # type: ignore[arg-type]
    for name in ("", "a\nb", 3, "x" * 129):
        with pytest.raises(ValueError, match="name must be None or a non-empty printable str"):
            register(gate, registry, name=name)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="registry must be a prometheus_client.CollectorRegistry"):
        register(gate, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix must"):
        GateCollector("bad-prefix")
    assert not list(registry.collect())  # nothing was registered by the failed calls
    assert admitgate.metrics.register is register
