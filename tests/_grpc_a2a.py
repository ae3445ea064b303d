"""Test support: a real A2A gRPC server (the SDK's handlers, v1 and v0.3, plus the standard
health and reflection services) on an event loop in a background thread.

Tests submit coroutines to the server's loop with :meth:`LoopThread.run`, so the server, its
gate and the test's clients share one loop and the executor's events can be set directly.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc
import grpc.aio
from a2a.compat.v0_3 import a2a_v0_3_pb2_grpc
from a2a.compat.v0_3.grpc_handler import CompatGrpcHandler
from a2a.helpers.proto_helpers import get_message_text, new_task_from_user_message, new_text_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue_v2 import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler, GrpcHandler
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import a2a_pb2, a2a_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 15.0) -> T:
        """Run ``coro`` on the loop and return its result (fails after ``timeout``)."""
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop).result(
            timeout + 1.0
        )

    def close(self) -> None:
        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(drain(), self.loop).result(5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        self.loop.close()


class HoldingExecutor(AgentExecutor):
    """A trivial agent. ``"hold:<key>"`` publishes a working task, then waits for
    :meth:`release` of ``key`` before completing it; any other text is answered at once."""

    def __init__(self) -> None:
        self._started: dict[str, asyncio.Event] = {}
        self._release: dict[str, asyncio.Event] = {}

    def _event(self, table: dict[str, asyncio.Event], key: str) -> asyncio.Event:
        return table.setdefault(key, asyncio.Event())

    async def started(self, key: str) -> None:
        """Wait until the turn ``key`` is running inside the agent."""
        await self._event(self._started, key).wait()

    def release(self, key: str) -> None:
        """Let the turn ``key`` finish (call on the server's loop)."""
        self._event(self._release, key).set()

    def release_all(self) -> None:
        """Let every held turn finish."""
        for key in list(self._started):
            self.release(key)

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        text = get_message_text(context.message)
        if not text.startswith("hold:"):
            await event_queue.enqueue_event(
                new_text_message(
                    f"echo:{text}", context_id=context.context_id, task_id=context.task_id
                )
            )
            return
        key = text.removeprefix("hold:")
        task = context.current_task or new_task_from_user_message(context.message)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work()
        self._event(self._started, key).set()
        await self._event(self._release, key).wait()
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def agent_card() -> a2a_pb2.AgentCard:
    """A spec-compliant card for the test agent (streaming on)."""
    return a2a_pb2.AgentCard(
        name="echo",
        description="test agent",
        version="1.0.0",
        supported_interfaces=[
            a2a_pb2.AgentInterface(
                url="127.0.0.1:0", protocol_binding="GRPC", protocol_version="1.0"
            )
        ],
        capabilities=a2a_pb2.AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[a2a_pb2.AgentSkill(id="echo", name="echo", description="echoes", tags=["test"])],
    )


class A2AServer:
    """A ``grpc.aio`` server on 127.0.0.1 serving the A2A SDK's gRPC handlers (v1 and v0.3)
    for a :class:`HoldingExecutor`, the standard health service and reflection."""

    def __init__(
        self,
        interceptors: list[grpc.aio.ServerInterceptor],
        wrap: Callable[[AgentExecutor], AgentExecutor] | None = None,
    ) -> None:
        self.executor = HoldingExecutor()
        self._wrap = wrap
        self._interceptors = interceptors
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.health = health_aio.HealthServicer()
        self.busy_calls = 0

    async def start(self) -> None:
        executor = self.executor if self._wrap is None else self._wrap(self.executor)
        handler = DefaultRequestHandler(
            agent_executor=executor, task_store=InMemoryTaskStore(), agent_card=agent_card()
        )
        server = grpc.aio.server(interceptors=self._interceptors)
        a2a_pb2_grpc.add_A2AServiceServicer_to_server(GrpcHandler(handler), server)
        a2a_v0_3_pb2_grpc.add_A2AServiceServicer_to_server(CompatGrpcHandler(handler), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        server.add_generic_rpc_handlers((self._plain_service(),))
        reflection.enable_server_reflection(
            (
                "lf.a2a.v1.A2AService",
                "a2a.v1.A2AService",
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.server = server

    def _plain_service(self) -> grpc.GenericRpcHandler:
        """``test.Plain``: a non-A2A service on raw bytes, with synchronous and async
        handlers, and ``Busy``, which refuses like a server that is not admitgate."""

        def sync_echo(request: bytes, context: Any) -> bytes:
            return request

        def sync_count(request: bytes, context: Any) -> Any:
            for i in range(request[0]):
                yield bytes([i])

        async def async_echo(request: bytes, context: Any) -> bytes:
            return request

        async def async_count(request: bytes, context: Any) -> Any:
            for i in range(request[0]):
                yield bytes([i])

        async def busy(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            self.busy_calls += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "busy elsewhere",
                trailing_metadata=(("grpc-retry-pushback-ms", "10"),),
            )
            raise AssertionError("abort returned")

        return grpc.method_handlers_generic_handler(
            "test.Plain",
            {
                "SyncEcho": grpc.unary_unary_rpc_method_handler(sync_echo),
                "SyncCount": grpc.unary_stream_rpc_method_handler(sync_count),
                "AsyncEcho": grpc.unary_unary_rpc_method_handler(async_echo),
                "AsyncCount": grpc.unary_stream_rpc_method_handler(async_count),
                "Busy": grpc.unary_unary_rpc_method_handler(busy),
            },
        )

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


def user_message(text: str) -> a2a_pb2.SendMessageRequest:
    """A ``SendMessageRequest`` carrying one user text part."""
    return a2a_pb2.SendMessageRequest(
        message=a2a_pb2.Message(
            message_id=f"m-{text}-{id(text)}",
            role=a2a_pb2.Role.ROLE_USER,
            parts=[a2a_pb2.Part(text=text)],
        )
    )


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (bounded) until ``predicate()`` holds: for state another task changes without an
    event to wait on (a slot freed by the server noticing a cancelled call)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {predicate}")
        await asyncio.sleep(0.005)
