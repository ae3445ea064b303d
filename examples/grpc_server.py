"""An A2A agent over gRPC behind the gate's interceptor: `python grpc_server.py` serves it on
127.0.0.1:50051 (or $ADMITGATE_EXAMPLE_PORT) until Ctrl-C or SIGTERM. Health checks are never
gated."""

import asyncio
import os
import signal

import grpc
from a2a.helpers.proto_helpers import get_message_text, new_text_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler, GrpcHandler
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import a2a_pb2, a2a_pb2_grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health

import admitgate
from admitgate.grpc import AdmissionInterceptor, session_from_metadata


class Echo(AgentExecutor):  # stands in for your agent
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        text = get_message_text(context.message)
        await event_queue.enqueue_event(
            new_text_message(
                f"echo: {text}", context_id=context.context_id, task_id=context.task_id
            )
        )

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        pass


def build_server(gate: admitgate.AdmissionGate, address: str) -> tuple[grpc.aio.Server, int]:
    """The gated gRPC server listening on `address` (port 0: any free one), and its port."""
    card = a2a_pb2.AgentCard(
        name="echo",
        description="Echoes what it is told.",
        version="1.0.0",
        supported_interfaces=[
            a2a_pb2.AgentInterface(url=address, protocol_binding="GRPC", protocol_version="1.0")
        ],
        capabilities=a2a_pb2.AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[a2a_pb2.AgentSkill(id="echo", name="echo", description="echo", tags=["demo"])],
    )
    handler = DefaultRequestHandler(
        agent_executor=Echo(), task_store=InMemoryTaskStore(), agent_card=card
    )
    server = grpc.aio.server(
        interceptors=[AdmissionInterceptor(gate, session_id=session_from_metadata("x-tenant"))]
    )
    a2a_pb2_grpc.add_A2AServiceServicer_to_server(GrpcHandler(handler), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # never gated
    port = server.add_insecure_port(address)
    return server, port


async def main() -> None:
    port = int(os.environ.get("ADMITGATE_EXAMPLE_PORT", "50051"))
    gate = admitgate.build_admission_gate(max_concurrent_runs=20, queue_depth=40)
    assert gate is not None
    server, port = build_server(gate, f"127.0.0.1:{port}")
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, or an orchestrator's stop
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await server.start()
    print(f"serving on 127.0.0.1:{port}", flush=True)
    await stop.wait()
    await server.stop(grace=5)  # running calls get 5 s to finish


if __name__ == "__main__":
    asyncio.run(main())
