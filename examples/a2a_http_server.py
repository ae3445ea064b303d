"""An A2A agent over HTTP (JSON-RPC and REST) behind the gate: `python a2a_http_server.py`
serves it on http://127.0.0.1:8000 (or $ADMITGATE_EXAMPLE_PORT) until Ctrl-C."""

import os

import uvicorn
from a2a.helpers.proto_helpers import new_text_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill
from starlette.applications import Starlette

import admitgate
from admitgate.a2a import GatedAgentExecutor
from admitgate.asgi import AdmissionMiddleware


class EchoExecutor(AgentExecutor):  # stands in for your agent
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        await event_queue.enqueue_event(new_text_message("echo: " + context.get_user_input()))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        pass


def build_app(url: str, gate: admitgate.AdmissionGate) -> AdmissionMiddleware:
    """The agent's ASGI app at `url`, gated at the door and around the agent's work."""
    card = AgentCard(
        name="echo",
        description="echoes",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url=url + "/", protocol_binding="JSONRPC", protocol_version="1.0"),
            AgentInterface(url=url, protocol_binding="HTTP+JSON", protocol_version="1.0"),
        ],
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="echo", name="echo", description="echoes", tags=["demo"])],
    )
    handler = DefaultRequestHandler(
        agent_executor=GatedAgentExecutor(EchoExecutor(), gate),  # bounds the agent's work
        task_store=InMemoryTaskStore(),
        agent_card=card,
    )
    app = Starlette(
        routes=[
            *create_agent_card_routes(card),
            *create_jsonrpc_routes(handler, "/"),
            *create_rest_routes(handler),
        ]
    )
    return AdmissionMiddleware(app, gate)  # refuses A2A work at the door: 429/503 + Retry-After


if __name__ == "__main__":
    port = int(os.environ.get("ADMITGATE_EXAMPLE_PORT", "8000"))
    gate = admitgate.build_admission_gate(max_concurrent_runs=20, queue_depth=40)
    assert gate is not None
    uvicorn.run(build_app(f"http://127.0.0.1:{port}", gate), host="127.0.0.1", port=port)
