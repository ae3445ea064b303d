"""admitgate.grpc against a real grpc.aio server on loopback serving the A2A SDK's gRPC handlers
(v1 and v0.3), the standard health service and reflection.

Two servers share one event loop (in a background thread, started once for the module):

- ``work``: the default method rule (only calls that start or continue agent work are gated),
  a gate with ceiling 2, no queue, ``reject``, 1 per tenant, the tenant read from the
  ``x-tenant`` metadata, and the gate's own retry hint;
- ``every``: ``gate_methods="all"``, ceiling 1, and a fixed ``retry_after=0.1``.

The agent holds a turn sent as ``"hold:<key>"`` until the test releases ``key``; no sleeps
control timing.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import admitgate
import grpc
import grpc.aio
import pytest
from _grpc_a2a import A2AServer, LoopThread, agent_card, until, user_message
from a2a.client import ClientConfig, ClientFactory
from a2a.client.errors import A2AClientError
from a2a.compat.v0_3 import a2a_v0_3_pb2, a2a_v0_3_pb2_grpc
from a2a.types import a2a_pb2, a2a_pb2_grpc
from admitgate.a2a import GatedAgentExecutor
from admitgate.grpc import (
    A2A_SERVICES,
    PUSHBACK_TRAILER,
    REASON_TRAILER,
    WORK_METHODS,
    AdmissionInterceptor,
    RetryPushbackInterceptor,
    RetryPushbackStreamInterceptor,
    _pushback,
    retry_pushback_interceptors,
    session_from_metadata,
)
from google.protobuf import message_factory
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

# -- servers -------------------------------------------------------------------------------


@dataclass
class Served:
    """One server under test, with its gate."""

    server: A2AServer
    gate: Any
    interceptor: AdmissionInterceptor

    @property
    def executor(self) -> Any:
        return self.server.executor

    def grpc_stats(self) -> dict[str, Any]:
        return self.gate.transport_stats().get(
            "grpc", {"in_flight": 0, "admitted": 0, "rejected": {}}
        )

    def rejected(self) -> int:
        return sum(self.grpc_stats()["rejected"].values())

    def requests(self, transport: str) -> int:
        return self.gate.request_stats().get(transport, {"count": 0})["count"]


class _Sampler:
    """The gate's resource sampler: reads the RSS the test sets (MiB)."""

    rss_mb = 100.0

    def read(self) -> Any:
        return admitgate.ResourceSample(rss_mb=self.rss_mb)


@dataclass
class Servers:
    loop: LoopThread
    work: Served
    every: Served
    shared: Served  # a GatedAgentExecutor on the interceptor's gate
    bad_tenant: Served  # a session_id callable that returns an int
    memory: Served  # memory-aware gate; the test sets the RSS its sampler reads
    sampler: _Sampler


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    loop = LoopThread()
    work_gate = admitgate.build_admission_gate(
        max_concurrent_runs=2,
        queue_depth=0,
        overflow_policy="reject",
        max_concurrent_runs_per_scope=1,
    )
    every_gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=0)
    work_icp = AdmissionInterceptor(work_gate, session_id=session_from_metadata("x-tenant"))
    every_icp = AdmissionInterceptor(every_gate, gate_methods="all", retry_after=0.1)
    work = Served(A2AServer([work_icp]), work_gate, work_icp)
    every = Served(A2AServer([every_icp]), every_gate, every_icp)
    shared_gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=0)
    shared_icp = AdmissionInterceptor(shared_gate, retry_after=0.1)
    shared = Served(
        A2AServer([shared_icp], wrap=lambda ex: GatedAgentExecutor(ex, shared_gate)),
        shared_gate,
        shared_icp,
    )
    bad_gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=0)
    bad_icp = AdmissionInterceptor(bad_gate, session_id=lambda details: len(details.method))
    bad_tenant = Served(A2AServer([bad_icp]), bad_gate, bad_icp)
    sampler = _Sampler()
    memory_gate = admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=4),
        resource_policy=admitgate.build_memory_pressure_policy(1024),
        resource_sampler=sampler,
    )
    memory_icp = AdmissionInterceptor(memory_gate)
    memory = Served(A2AServer([memory_icp]), memory_gate, memory_icp)
    all_served = (work, every, shared, bad_tenant, memory)

    async def start() -> None:
        for served in all_served:
            await served.server.start()

    loop.run(start())
    yield Servers(loop, work, every, shared, bad_tenant, memory, sampler)

    async def stop() -> None:
        for served in all_served:
            served.executor.release_all()
            await served.server.stop()

    loop.run(stop())
    loop.close()


@pytest.fixture
def run(servers: Servers) -> Iterator[Any]:
    """Run a coroutine on the servers' loop; afterwards every gate must be empty again."""
    yield servers.loop.run

    async def settled() -> None:
        for served in (
            servers.work,
            servers.every,
            servers.shared,
            servers.bad_tenant,
            servers.memory,
        ):
            await until(lambda s=served: s.gate.in_flight == 0 and s.gate.queued == 0)

    servers.loop.run(settled())


@asynccontextmanager
async def channel(
    served: Served, *interceptors: grpc.aio.ClientInterceptor
) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(
        served.server.target, interceptors=list(interceptors) or None
    ) as ch:
        yield ch


def trailers(err: grpc.aio.AioRpcError) -> dict[str, Any]:
    return {k: v for k, v in err.trailing_metadata() or ()}


async def held_stream(stub: Any, key: str, executor: Any, **kw: Any) -> tuple[Any, a2a_pb2.Task]:
    """Start a streaming SendMessage that the agent holds; return the call and its task."""
    call = stub.SendStreamingMessage(user_message(f"hold:{key}"), **kw)
    first = await call.read()
    await executor.started(key)
    assert first.HasField("task"), first
    return call, first.task


async def drain(call: Any) -> list[Any]:
    items = []
    while (item := await call.read()) is not grpc.aio.EOF:
        items.append(item)
    return items


def assert_refused(
    err: grpc.aio.AioRpcError, *, reason: str = "queue_full", pushback: str | None = None
) -> int:
    """The refusal's status and trailers; returns the pushback in ms."""
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert err.details() == "Busy right now \u2014 please resend in a moment."
    found = trailers(err)
    assert found[REASON_TRAILER] == reason
    assert found[PUSHBACK_TRAILER].isdigit()
    if pushback is not None:
        assert found[PUSHBACK_TRAILER] == pushback
    ms = int(found[PUSHBACK_TRAILER])
    # The rich error model carries the same: ErrorInfo (reason) and RetryInfo (delay).
    status = status_pb2.Status.FromString(found["grpc-status-details-bin"])
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and info.metadata["reason"] == reason
    assert status.details[1].Unpack(retry) and retry.retry_delay.ToMilliseconds() == ms
    return ms


# -- method rule ---------------------------------------------------------------------------


def _sdk_methods() -> set[str]:
    services = [
        a2a_pb2.DESCRIPTOR.services_by_name["A2AService"],
        a2a_v0_3_pb2.DESCRIPTOR.services_by_name["A2AService"],
    ]
    return {f"/{s.full_name}/{m.name}" for s in services for m in s.methods}


def test_services_and_work_methods_are_the_sdks() -> None:
    methods = _sdk_methods()
    assert {m[1:].partition("/")[0] for m in methods} == A2A_SERVICES
    assert WORK_METHODS <= methods  # no typo, no method the SDK renamed


def test_default_rule_gates_only_work() -> None:
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    icp = AdmissionInterceptor(gate)
    gated = {m for m in _sdk_methods() if icp.gates(m)}
    assert gated == {
        "/lf.a2a.v1.A2AService/SendMessage",
        "/lf.a2a.v1.A2AService/SendStreamingMessage",
        "/lf.a2a.v1.A2AService/SubscribeToTask",
        "/a2a.v1.A2AService/SendMessage",
        "/a2a.v1.A2AService/SendStreamingMessage",
        "/a2a.v1.A2AService/TaskSubscription",
    }
    for passing in ("GetTask", "ListTasks", "CancelTask", "GetExtendedAgentCard"):
        assert not icp.gates(f"/lf.a2a.v1.A2AService/{passing}")


def test_all_gates_every_a2a_method_and_nothing_else() -> None:
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    icp = AdmissionInterceptor(gate, gate_methods="all")
    assert all(icp.gates(m) for m in _sdk_methods())
    for other in (
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/lf.a2a.v1.A2AServiceX/SendMessage",
        "/x.lf.a2a.v1.A2AService/SendMessage",
        "/custom.Agent/SendMessage",
    ):
        assert not icp.gates(other), other


# The documented rule (AdmissionInterceptor, WORK_METHODS), method by method, for every method
# of the SDK's two A2A services, written out so that a method the SDK adds or renames fails
# the differential tests below instead of being gated (or not) by accident.
DOCUMENTED_KINDS: dict[str, str] = {
    "/lf.a2a.v1.A2AService/SendMessage": "work",
    "/lf.a2a.v1.A2AService/SendStreamingMessage": "work",
    "/lf.a2a.v1.A2AService/SubscribeToTask": "work",
    "/lf.a2a.v1.A2AService/GetTask": "read",
    "/lf.a2a.v1.A2AService/ListTasks": "read",
    "/lf.a2a.v1.A2AService/GetExtendedAgentCard": "read",
    "/lf.a2a.v1.A2AService/CancelTask": "cancel",
    "/lf.a2a.v1.A2AService/CreateTaskPushNotificationConfig": "push-config",
    "/lf.a2a.v1.A2AService/GetTaskPushNotificationConfig": "push-config",
    "/lf.a2a.v1.A2AService/ListTaskPushNotificationConfigs": "push-config",
    "/lf.a2a.v1.A2AService/DeleteTaskPushNotificationConfig": "push-config",
    "/a2a.v1.A2AService/SendMessage": "work",
    "/a2a.v1.A2AService/SendStreamingMessage": "work",
    "/a2a.v1.A2AService/TaskSubscription": "work",  # v0.3's name for SubscribeToTask
    "/a2a.v1.A2AService/GetTask": "read",
    "/a2a.v1.A2AService/GetAgentCard": "read",
    "/a2a.v1.A2AService/CancelTask": "cancel",
    "/a2a.v1.A2AService/CreateTaskPushNotificationConfig": "push-config",
    "/a2a.v1.A2AService/GetTaskPushNotificationConfig": "push-config",
    "/a2a.v1.A2AService/ListTaskPushNotificationConfig": "push-config",
    "/a2a.v1.A2AService/DeleteTaskPushNotificationConfig": "push-config",
}
_DOCUMENTED_SERVICES = ("lf.a2a.v1.A2AService", "a2a.v1.A2AService")


def documented_gated(method: str, gate_methods: str) -> bool:
    """The rule as the docs state it: ``"work"`` gates the work methods of the A2A services,
    ``"all"`` every method of theirs; any other service (or a name that is not
    ``/service/method``) passes."""
    service, slash, _ = method[1:].partition("/")
    if not method.startswith("/") or not slash or service not in _DOCUMENTED_SERVICES:
        return False
    return gate_methods == "all" or DOCUMENTED_KINDS.get(method) == "work"


def _sdk_method_descriptors() -> dict[str, Any]:
    services = [
        a2a_pb2.DESCRIPTOR.services_by_name["A2AService"],
        a2a_v0_3_pb2.DESCRIPTOR.services_by_name["A2AService"],
    ]
    return {f"/{s.full_name}/{m.name}": m for s in services for m in s.methods}


def test_every_sdk_method_is_classified_and_decided_as_documented() -> None:
    """Differential, from the SDK's service descriptors: each of its methods is in the
    documented table, and the interceptor decides it as the table says, in both modes."""
    methods = _sdk_method_descriptors()
    assert set(methods) == set(DOCUMENTED_KINDS), (
        "the SDK's A2A methods changed: classify "
        f"{sorted(set(methods) ^ set(DOCUMENTED_KINDS))} in DOCUMENTED_KINDS and the docs"
    )
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    for mode in ("work", "all"):
        icp = AdmissionInterceptor(gate, gate_methods=mode)  # type: ignore[arg-type]
        for method in methods:
            assert icp.gates(method) == documented_gated(method, mode), (mode, method)
    assert {m for m, kind in DOCUMENTED_KINDS.items() if kind == "work"} == WORK_METHODS


@given(
    method=st.text(max_size=60)
    | st.builds(
        lambda service, name: f"/{service}/{name}",
        st.sampled_from([*_DOCUMENTED_SERVICES, "grpc.health.v1.Health", "lf.a2a.v1.A2AServiceX"])
        | st.text(max_size=30),
        st.sampled_from(["SendMessage", "GetTask", "Nope", "SendMessage/x", ""])
        | st.text(max_size=30),
    ),
    mode=st.sampled_from(["work", "all"]),
)
@settings(max_examples=300, deadline=None)
def test_junk_method_names_are_decided_as_documented(method: str, mode: str) -> None:
    """Names no SDK serves: not A2A (pass), or an unknown method of an A2A service (gated
    only by ``"all"``)."""
    icp = AdmissionInterceptor(_JUNK_GATE, gate_methods=mode)  # type: ignore[arg-type]
    assert icp.gates(method) == documented_gated(method, mode)


_JUNK_GATE = admitgate.build_admission_gate(max_concurrent_runs=1)


def test_a_saturated_server_decides_every_sdk_method_as_documented(
    servers: Servers, run: Any
) -> None:
    """Differential through the real server: with each gate full, every SDK method is called
    with an empty request of its input type; a gated one is refused by admitgate before its
    handler, a passing one reaches the SDK's handler (whatever it answers) and is counted
    as passthrough."""
    methods = _sdk_method_descriptors()

    async def probe(served: Served, mode: str) -> None:
        async with channel(served) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            keys = [f"diff-{mode}-{i}" for i in range(served.gate.max_concurrent_runs)]
            held = [
                await held_stream(stub, k, served.executor, metadata=(("x-tenant", k),))
                for k in keys
            ]
            assert served.gate.saturated
            for method, descriptor in methods.items():
                request = message_factory.GetMessageClass(descriptor.input_type)()
                payload = request.SerializeToString()
                before = served.requests("passthrough")
                refusal = None
                try:
                    if descriptor.server_streaming:
                        call = ch.unary_stream(method)(payload, metadata=(("x-tenant", "p"),))
                        await call.read()
                        call.cancel()
                    else:
                        await ch.unary_unary(method)(payload, metadata=(("x-tenant", "p"),))
                except grpc.aio.AioRpcError as err:
                    refusal = trailers(err).get(REASON_TRAILER)
                gated = documented_gated(method, mode)
                assert (refusal is not None) == gated, (mode, method, refusal)
                if not gated:
                    await until(lambda s=served, b=before: s.requests("passthrough") == b + 1)
            for k, (call, _) in zip(keys, held, strict=True):
                served.executor.release(k)
                await drain(call)

    async def scenario() -> None:
        await probe(servers.work, "work")
        await probe(servers.every, "all")

    run(scenario(), timeout=30)


def test_a_synchronous_handler_of_a_gated_method_is_refused_not_run_ungated() -> None:
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    icp = AdmissionInterceptor(gate)

    def send_message(request: bytes, context: Any) -> bytes:
        return request

    async def served(details: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(send_message)

    class Details:
        method = "/lf.a2a.v1.A2AService/SendMessage"
        invocation_metadata = ()

    with pytest.raises(TypeError, match="gates only async handlers"):
        asyncio.run(icp.intercept_service(served, Details()))
    Details.method = "/lf.a2a.v1.A2AService/GetTask"  # ungated: wrapped, stays synchronous
    handler = asyncio.run(icp.intercept_service(served, Details()))
    assert handler is not None and handler.unary_unary is not None
    assert handler.unary_unary(b"abc", None) == b"abc"
    assert gate.request_stats()["passthrough"]["count"] == 1


# -- refusals ------------------------------------------------------------------------------


def test_unary_refused_past_the_cap(servers: Servers, run: Any) -> None:
    s = servers.work

    async def scenario() -> None:
        async with channel(s) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            held = [stub.SendMessage(user_message(f"hold:u{i}")) for i in range(2)]
            await s.executor.started("u0")
            await s.executor.started("u1")
            assert s.gate.in_flight == 2 and s.grpc_stats()["in_flight"] == 2
            before = s.grpc_stats()["rejected"]["queue_full"]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SendMessage(user_message("over"))
            ms = assert_refused(refused.value)
            assert 1000 <= ms <= 30000  # the gate's hint: clamp(.., 1 s, 30 s)
            # The v0.3 service is gated by the same rule.
            old = a2a_v0_3_pb2_grpc.A2AServiceStub(ch)
            m3 = a2a_v0_3_pb2.Message(
                message_id="v03", role=a2a_v0_3_pb2.ROLE_USER, content=[a2a_v0_3_pb2.Part(text="x")]
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused_v03:
                await old.SendMessage(a2a_v0_3_pb2.SendMessageRequest(request=m3))
            assert_refused(refused_v03.value)
            assert s.grpc_stats()["rejected"]["queue_full"] == before + 2
            s.executor.release("u0")
            s.executor.release("u1")
            for response in await asyncio.gather(*held):
                assert response.task.status.state == a2a_pb2.TaskState.TASK_STATE_COMPLETED
            assert s.gate.in_flight == 0
            # Capacity is back: the same request now runs.
            reply = await stub.SendMessage(user_message("again"))
            assert reply.message.parts[0].text == "echo:again"

    run(scenario())


def test_streaming_refused_past_the_cap_before_any_message(servers: Servers, run: Any) -> None:
    s = servers.work

    async def scenario() -> None:
        async with channel(s) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            calls = [(await held_stream(stub, f"s{i}", s.executor))[0] for i in range(2)]
            refused_call = stub.SendStreamingMessage(user_message("over"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await refused_call.read()
            assert_refused(refused.value)
            s.executor.release("s0")
            s.executor.release("s1")
            for call in calls:
                events = await drain(call)
                assert (
                    events[-1].status_update.status.state == a2a_pb2.TaskState.TASK_STATE_COMPLETED
                )
                assert await call.code() == grpc.StatusCode.OK

    run(scenario())


def test_stream_holds_its_slot_until_it_ends(servers: Servers, run: Any) -> None:
    s = servers.work

    async def scenario() -> None:
        async with channel(s) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            call, _ = await held_stream(stub, "hold-until-end", s.executor)
            working = await call.read()
            assert working.status_update.status.state == a2a_pb2.TaskState.TASK_STATE_WORKING
            assert s.grpc_stats()["in_flight"] == 1  # messages flowed, the slot is still held
            s.executor.release("hold-until-end")
            await drain(call)
            # The handler released the slot before the server sent the final status.
            assert s.gate.in_flight == 0 and s.grpc_stats()["in_flight"] == 0

    run(scenario())


def test_cancelled_calls_keep_their_slots_until_the_work_ends(servers: Servers, run: Any) -> None:
    """Issue 22 item 7 for the in-process door: a call the client cancels keeps its slot
    while its handler (the agent's work) still runs; it is freed when that ends. They used
    to be freed at the cancellation (this test said so) while the agent worked on."""
    s = servers.work

    async def scenario() -> None:
        async with channel(s) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            stream, _ = await held_stream(stub, "cancel-stream", s.executor)
            unary = stub.SendMessage(user_message("hold:cancel-unary"))
            await s.executor.started("cancel-unary")
            assert s.gate.in_flight == 2
            stream.cancel()
            unary.cancel()
            await asyncio.sleep(0.3)
            assert s.gate.in_flight == 2  # the agent still works for both
            s.executor.release("cancel-stream")
            await until(lambda: s.gate.in_flight == 1)
            s.executor.release("cancel-unary")
            await until(lambda: s.gate.in_flight == 0)
            # Both slots are usable again.
            again = [stub.SendMessage(user_message(f"after-cancel-{i}")) for i in range(2)]
            assert [r.message.parts[0].text for r in await asyncio.gather(*again)] == [
                "echo:after-cancel-0",
                "echo:after-cancel-1",
            ]

    run(scenario())


# -- what passes while saturated -----------------------------------------------------------


def test_health_and_reflection_pass_while_saturated(servers: Servers, run: Any) -> None:
    async def scenario() -> None:
        for s in (servers.work, servers.every):
            async with channel(s) as ch:
                stub = a2a_pb2_grpc.A2AServiceStub(ch)
                keys = [f"health-{s.server.port}-{i}" for i in range(s.gate.max_concurrent_runs)]
                held = [stub.SendMessage(user_message(f"hold:{k}")) for k in keys]
                for k in keys:
                    await s.executor.started(k)
                assert s.gate.saturated
                before = s.requests("passthrough")
                health = health_pb2_grpc.HealthStub(ch)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                watch.cancel()
                refl = reflection_pb2_grpc.ServerReflectionStub(ch)
                answers = refl.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
                names = {
                    svc.name async for a in answers for svc in a.list_services_response.service
                }
                assert "lf.a2a.v1.A2AService" in names
                await until(lambda s=s, b=before: s.requests("passthrough") == b + 3)
                for k in keys:
                    s.executor.release(k)
                await asyncio.gather(*held)

    run(scenario())


def test_reads_and_cancellations_pass_while_saturated(servers: Servers, run: Any) -> None:
    s = servers.work

    async def scenario() -> None:
        async with channel(s) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            (call0, task0), (call1, task1) = [
                await held_stream(stub, f"read-{i}", s.executor) for i in range(2)
            ]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SendMessage(user_message("over"))
            assert_refused(refused.value)
            got = await stub.GetTask(a2a_pb2.GetTaskRequest(id=task0.id))
            assert got.id == task0.id
            listed = await stub.ListTasks(a2a_pb2.ListTasksRequest())
            assert {task0.id, task1.id} <= {t.id for t in listed.tasks}
            old = a2a_v0_3_pb2_grpc.A2AServiceStub(ch)
            got_v03 = await old.GetTask(a2a_v0_3_pb2.GetTaskRequest(name=f"tasks/{task1.id}"))
            assert got_v03.id == task1.id
            # The saturated agent can be told to stop, and stopping frees the slot.
            cancelled = await stub.CancelTask(a2a_pb2.CancelTaskRequest(id=task0.id))
            assert cancelled.status.state == a2a_pb2.TaskState.TASK_STATE_CANCELED
            await drain(call0)
            await until(lambda: s.gate.in_flight == 1)
            reply = await stub.SendMessage(user_message("after-cancel-task"))
            assert reply.message.parts[0].text == "echo:after-cancel-task"
            s.executor.release("read-1")
            await drain(call1)

    run(scenario())


def test_gate_all_refuses_reads_but_never_health(servers: Servers, run: Any) -> None:
    s = servers.every

    async def scenario() -> None:
        async with channel(s) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            held = stub.SendMessage(user_message("hold:all-1"))
            await s.executor.started("all-1")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetTask(a2a_pb2.GetTaskRequest(id="whatever"))
            assert_refused(refused.value, pushback="100")  # retry_after=0.1 fixes it
            with pytest.raises(grpc.aio.AioRpcError) as refused_card:
                await stub.GetExtendedAgentCard(a2a_pb2.GetExtendedAgentCardRequest())
            assert_refused(refused_card.value, pushback="100")
            health = health_pb2_grpc.HealthStub(ch)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == (
                health_pb2.HealthCheckResponse.SERVING
            )
            s.executor.release("all-1")
            await held

    run(scenario())


def test_session_id_from_metadata_gives_each_tenant_its_lane(servers: Servers, run: Any) -> None:
    s = servers.work  # 1 turn per tenant

    async def scenario() -> None:
        async with channel(s) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            a = stub.SendMessage(user_message("hold:tenant-a"), metadata=(("x-tenant", "a"),))
            await s.executor.started("tenant-a")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SendMessage(user_message("a-again"), metadata=(("x-tenant", "a"),))
            assert_refused(refused.value)
            reply = await stub.SendMessage(user_message("from-b"), metadata=(("x-tenant", "b"),))
            assert reply.message.parts[0].text == "echo:from-b"
            s.executor.release("tenant-a")
            await a

    run(scenario())


def test_memory_pressure_is_unavailable_and_retried_only_within_the_deadline(
    servers: Servers, run: Any
) -> None:
    s = servers.memory

    async def scenario() -> None:
        servers.sampler.rss_mb = 2048.0  # above the hard threshold (1024 MiB)
        try:
            async with channel(s, *retry_pushback_interceptors(5, deadline_s=1.0)) as ch:
                stub = a2a_pb2_grpc.A2AServiceStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.SendMessage(user_message("heavy"))
                err = refused.value
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                found = trailers(err)
                assert found[REASON_TRAILER] == "memory_pressure"
                # The gate's hint for memory pressure, longer than the client's 1 s deadline:
                # refused once, not retried.
                assert int(found[PUSHBACK_TRAILER]) > 1000
                assert s.grpc_stats()["rejected"]["memory_pressure"] == 1
                servers.sampler.rss_mb = 100.0
                reply = await stub.SendMessage(user_message("light"))
                assert reply.message.parts[0].text == "echo:light"
        finally:
            servers.sampler.rss_mb = 100.0

    run(scenario())


def test_a_session_id_that_is_not_a_str_fails_the_call_not_the_gate(
    servers: Servers, run: Any
) -> None:
    s = servers.bad_tenant

    async def scenario() -> None:
        async with channel(s) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.SendMessage(user_message("x"))
            assert failed.value.code() == grpc.StatusCode.UNKNOWN
            assert s.gate.admitted == 0 and s.gate.rejected == 0 and s.gate.in_flight == 0
            assert s.requests("grpc") == 1  # counted all the same
            with pytest.raises(grpc.aio.AioRpcError) as missing:  # ungated calls are unaffected
                await stub.GetTask(a2a_pb2.GetTaskRequest(id="nope"))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    run(scenario())


def test_every_call_is_recorded_once(servers: Servers, run: Any) -> None:
    s = servers.work

    async def scenario() -> None:
        grpc_before, pass_before = s.requests("grpc"), s.requests("passthrough")
        async with channel(s) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            for i in range(3):
                await stub.SendMessage(user_message(f"count-{i}"))
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.GetTask(a2a_pb2.GetTaskRequest(id="no-such-task"))  # NOT_FOUND, passes
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        await until(lambda: s.requests("passthrough") == pass_before + 2)
        assert s.requests("grpc") == grpc_before + 3
        stats = s.gate.request_stats()["grpc"]
        assert stats["buckets"][-1] == (math.inf, stats["count"]) and stats["sum"] > 0

    run(scenario())


# -- gating the work behind the call -------------------------------------------------------


def test_gated_executor_takes_over_the_calls_slot(servers: Servers, run: Any) -> None:
    s = servers.shared  # ceiling 1; the executor is gated on the same gate

    async def scenario() -> None:
        async with channel(s) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            # A blocking send needs the call's slot and its work's: one slot, no deadlock.
            blocking = stub.SendMessage(user_message("hold:shared-1"))
            await s.executor.started("shared-1")
            assert s.gate.in_flight == 1
            assert s.gate.transport_stats().get("a2a_task", {}).get("admitted", 0) == 0
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SendMessage(user_message("over"))
            assert_refused(refused.value, pushback="100")
            s.executor.release("shared-1")
            done = await blocking
            assert done.task.status.state == a2a_pb2.TaskState.TASK_STATE_COMPLETED
            await until(lambda: s.gate.in_flight == 0)

            # returnImmediately: the call ends at once, the work keeps the slot until it ends.
            request = user_message("hold:shared-2")
            request.configuration.return_immediately = True
            reply = await stub.SendMessage(request)
            await s.executor.started("shared-2")
            assert reply.task.status.state in (
                a2a_pb2.TaskState.TASK_STATE_SUBMITTED,
                a2a_pb2.TaskState.TASK_STATE_WORKING,
            )
            assert s.gate.in_flight == 1  # the response is out, the work still holds the slot
            with pytest.raises(grpc.aio.AioRpcError) as refused_again:
                await stub.SendMessage(user_message("over-again"))
            assert_refused(refused_again.value, pushback="100")
            s.executor.release("shared-2")
            await until(lambda: s.gate.in_flight == 0)
            reply = await stub.SendMessage(user_message("free-again"))
            assert reply.message.parts[0].text == "echo:free-again"
            assert s.gate.transport_stats()["grpc"]["admitted"] == 3

    run(scenario())


# -- the retrying client -------------------------------------------------------------------


def test_client_interceptor_gets_through_once_capacity_frees(servers: Servers, run: Any) -> None:
    s = servers.every  # ceiling 1, pushback 100 ms

    async def scenario() -> None:
        async with (
            channel(s) as plain,
            channel(s, *retry_pushback_interceptors(50, jitter=0.0)) as retrying,
        ):
            held = a2a_pb2_grpc.A2AServiceStub(plain).SendMessage(user_message("hold:retry-1"))
            await s.executor.started("retry-1")
            stub = a2a_pb2_grpc.A2AServiceStub(retrying)
            before = s.rejected()
            loop = asyncio.get_running_loop()
            started = loop.time()
            unary = asyncio.ensure_future(stub.SendMessage(user_message("patient")))
            await until(lambda: s.rejected() >= before + 1)  # refused at least once...
            s.executor.release("retry-1")
            await held
            reply = await unary  # ...then admitted after the pushback
            assert reply.message.parts[0].text == "echo:patient"
            assert loop.time() - started >= 0.1
            refusals = s.rejected() - before
            assert 1 <= refusals

            # A stream refused before its first message is retried the same way.
            held = a2a_pb2_grpc.A2AServiceStub(plain).SendMessage(user_message("hold:retry-2"))
            await s.executor.started("retry-2")
            before = s.rejected()
            stream = stub.SendStreamingMessage(user_message("patient-stream"))
            reader = asyncio.ensure_future(drain(stream))
            await until(lambda: s.rejected() >= before + 1)
            s.executor.release("retry-2")
            await held
            events = await reader
            assert events[0].message.parts[0].text == "echo:patient-stream"
            assert await stream.code() == grpc.StatusCode.OK

    run(scenario())


def test_client_interceptor_budget_and_deadline(servers: Servers, run: Any) -> None:
    s = servers.every

    async def scenario() -> None:
        async with channel(s) as plain:
            held = a2a_pb2_grpc.A2AServiceStub(plain).SendMessage(user_message("hold:budget"))
            await s.executor.started("budget")
            # Out of retries: 1 call + 2 retries, then the last refusal is the caller's.
            async with channel(s, *retry_pushback_interceptors(2, jitter=0.0)) as ch:
                before = s.rejected()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await a2a_pb2_grpc.A2AServiceStub(ch).SendMessage(user_message("x"))
                assert_refused(refused.value, pushback="100")
                assert s.rejected() - before == 3
                stream = a2a_pb2_grpc.A2AServiceStub(ch).SendStreamingMessage(user_message("y"))
                with pytest.raises(grpc.aio.AioRpcError) as refused_stream:
                    await stream.read()
                assert_refused(refused_stream.value, pushback="100")
                assert s.rejected() - before == 6
            # A deadline shorter than the pushback: no retry at all.
            async with channel(s, RetryPushbackInterceptor(5, deadline_s=0.05)) as ch:
                before = s.rejected()
                with pytest.raises(grpc.aio.AioRpcError):
                    await a2a_pb2_grpc.A2AServiceStub(ch).SendMessage(user_message("x"))
                assert s.rejected() - before == 1
            # The call's own timeout bounds the retries too.
            async with channel(s, RetryPushbackInterceptor(5)) as ch:
                before = s.rejected()
                with pytest.raises(grpc.aio.AioRpcError):
                    await a2a_pb2_grpc.A2AServiceStub(ch).SendMessage(
                        user_message("x"), timeout=0.15
                    )
                assert 1 <= s.rejected() - before <= 2
            s.executor.release("budget")
            await held

    run(scenario())


def test_client_interceptor_leaves_other_errors_alone(servers: Servers, run: Any) -> None:
    s = servers.work

    async def scenario() -> None:
        async with channel(s, RetryPushbackInterceptor(5)) as ch:
            before = s.requests("passthrough")
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await a2a_pb2_grpc.A2AServiceStub(ch).GetTask(a2a_pb2.GetTaskRequest(id="nope"))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            await until(lambda: s.requests("passthrough") >= before + 1)
            assert s.requests("passthrough") == before + 1  # not retried

    run(scenario())


def test_sdk_client_with_the_retrying_channel(servers: Servers, run: Any) -> None:
    s = servers.every

    async def scenario() -> None:
        card = agent_card()
        del card.supported_interfaces[:]
        card.supported_interfaces.add(
            url=s.server.target, protocol_binding="GRPC", protocol_version="1.0"
        )
        config = ClientConfig(
            streaming=False,
            supported_protocol_bindings=["GRPC"],
            grpc_channel_factory=lambda url: grpc.aio.insecure_channel(
                url, interceptors=retry_pushback_interceptors(50, jitter=0.0)
            ),
        )
        plain_config = ClientConfig(
            streaming=False,
            supported_protocol_bindings=["GRPC"],
            grpc_channel_factory=grpc.aio.insecure_channel,
        )
        async with channel(s) as plain:
            held = a2a_pb2_grpc.A2AServiceStub(plain).SendMessage(user_message("hold:sdk"))
            await s.executor.started("sdk")
            # Without the interceptor the SDK client surfaces the refusal.
            async with ClientFactory(plain_config).create(card) as bare:
                with pytest.raises(A2AClientError, match="RESOURCE_EXHAUSTED"):
                    async for _ in bare.send_message(user_message("bare")):
                        pass
            async with ClientFactory(config).create(card) as client:
                before = s.rejected()

                async def send() -> list[Any]:
                    return [e async for e in client.send_message(user_message("via-sdk"))]

                reply = asyncio.ensure_future(send())
                await until(lambda: s.rejected() >= before + 1)
                s.executor.release("sdk")
                await held
                events = await reply
                assert events[0].message.parts[0].text == "echo:via-sdk"

    run(scenario())


# -- passthrough of other services ---------------------------------------------------------


def test_sync_and_async_handlers_of_other_services_pass_and_are_counted(
    servers: Servers, run: Any
) -> None:
    s = servers.every

    async def scenario() -> None:
        before = s.requests("passthrough")
        async with channel(s) as ch:
            assert await ch.unary_unary("/test.Plain/SyncEcho")(b"abc") == b"abc"
            assert [m async for m in ch.unary_stream("/test.Plain/SyncCount")(b"\x03")] == [
                b"\x00",
                b"\x01",
                b"\x02",
            ]
            assert await ch.unary_unary("/test.Plain/AsyncEcho")(b"xyz") == b"xyz"
            assert [m async for m in ch.unary_stream("/test.Plain/AsyncCount")(b"\x02")] == [
                b"\x00",
                b"\x01",
            ]
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await ch.unary_unary("/test.Plain/Nope")(b"")
            assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
        await until(lambda: s.requests("passthrough") == before + 4)

    run(scenario())


def test_busy_without_admitgate_reason_is_not_retried(servers: Servers, run: Any) -> None:
    s = servers.every

    async def scenario() -> None:
        async with channel(s, RetryPushbackInterceptor(5)) as ch:
            before = s.server.busy_calls
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await ch.unary_unary("/test.Plain/Busy")(b"")
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert trailers(busy.value)[PUSHBACK_TRAILER] == "10"
            assert s.server.busy_calls == before + 1

    run(scenario())


@given(
    hint=st.text(max_size=30)
    | st.from_regex(r"\A[0-9]{1,6000}\Z")
    | st.sampled_from(["²", "٣", "9" * 400, "9" * 5000, "-1", "+5", "1e3", " 5", ""])
)
@settings(max_examples=200, deadline=None)
def test_any_pushback_is_parsed_quickly_or_refused(hint: str) -> None:
    """Every trailer value gives a finite delay >= 0 or none, within a few ms: a delay only
    for ASCII digits. ("²".isdigit() is true and int("²") raises; 400 digits overflow a
    float, 5000 break int(). grpc-core itself re-serialises this trailer as an int64, so over
    its wire such values arrive normalised; another stack's trailers may not be.)"""
    trailers = (("admitgate-reason", "queue_full"), (PUSHBACK_TRAILER, hint))
    for raw in (trailers, ((k, v.encode("utf-8", "surrogatepass")) for k, v in trailers)):
        started = time.thread_time()
        delay = _pushback(grpc.StatusCode.RESOURCE_EXHAUSTED, raw)
        assert time.thread_time() - started < 0.005
        if delay is not None:
            assert math.isfinite(delay) and delay >= 0.0
            assert hint.isascii() and hint.isdigit()


# -- validation ----------------------------------------------------------------------------


def test_interceptor_arguments_are_validated() -> None:
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    with pytest.raises(TypeError, match="gate must be an admitgate.AdmissionGate, got None"):
        AdmissionInterceptor(None)
    with pytest.raises(TypeError, match="gate must be"):
        AdmissionInterceptor(object())
    with pytest.raises(ValueError, match="gate_methods must be 'work' or 'all', got 'reads'"):
        AdmissionInterceptor(gate, gate_methods="reads")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="session_id must be a callable or None, got 'x-tenant'"):
        AdmissionInterceptor(gate, session_id="x-tenant")  # type: ignore[arg-type]
    for bad in (0, -1, math.nan, math.inf, True, "1"):
        with pytest.raises(ValueError, match="retry_after must be"):
            AdmissionInterceptor(gate, retry_after=bad)  # type: ignore[arg-type]
    assert AdmissionInterceptor(gate, retry_after=2).gate is gate


def test_client_interceptor_arguments_are_validated() -> None:
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="max_retries must be an int >= 0"):
            RetryPushbackInterceptor(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_retries must be an int >= 0"):
            retry_pushback_interceptors(bad)  # type: ignore[arg-type]
    for bad_deadline in (0, -1.0, math.inf, math.nan, False):
        with pytest.raises(ValueError, match="deadline_s must be"):
            RetryPushbackInterceptor(deadline_s=bad_deadline)  # type: ignore[arg-type]
    for bad_jitter in (-0.1, 1.5, math.nan, None):
        with pytest.raises(ValueError, match="jitter must be"):
            RetryPushbackInterceptor(jitter=bad_jitter)  # type: ignore[arg-type]
    unary, stream = retry_pushback_interceptors(0, deadline_s=None, jitter=1)
    assert isinstance(unary, RetryPushbackInterceptor)
    assert isinstance(stream, RetryPushbackStreamInterceptor)
    assert (stream.max_retries, stream.deadline_s, stream.jitter) == (0, None, 1.0)


def test_session_from_metadata_is_validated() -> None:
    for bad in ("", "X-Tenant", "tenant-bin", "a b", 3):
        with pytest.raises(ValueError, match="key must"):
            session_from_metadata(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="default must be a str"):
        session_from_metadata("x-tenant", default=None)  # type: ignore[arg-type]
