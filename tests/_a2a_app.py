"""A real a2a-sdk agent served by uvicorn on loopback, for the A2A front-door tests.

- :class:`ControlledExecutor` is a trivial ``AgentExecutor`` whose behaviour the message text
  picks: ``echo <text>`` answers with a message; ``hold <key>`` creates a task, marks it
  working and finishes only when the test releases latch ``<key>`` (so the test decides when
  work ends, without sleeping); ``ask`` creates a task that asks for input
  (``input-required``), which a later ``hold <key>`` on the same task continues; ``fail``
  raises.
- :func:`build_sdk_app` serves it with the SDK's own routes (agent card, JSON-RPC at ``/``
  with v0.3 compatibility, REST with v0.3 compatibility) plus a custom route ``/custom`` and
  a raw streaming route ``/upload`` that echoes what it receives (size and digest).
- :class:`ServerThread` runs uvicorn in a thread with its own event loop on a socket bound
  to 127.0.0.1 port 0; its app is a :class:`Switch`, so each test can put its own front
  door (a fresh gate, a fresh middleware) in front of the one SDK app.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import uvicorn
from a2a.helpers.proto_helpers import get_message_text, new_task_from_user_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import (
    create_agent_card_routes,
    create_jsonrpc_routes,
    create_rest_routes,
)
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Message,
    Part,
    Role,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

A2A_HEADERS = {"A2A-Version": "1.0"}


class Latch:
    """A one-shot gate between the test thread and an executor on the server's loop."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.finished = threading.Event()
        self.cancelled = threading.Event()
        self._released = threading.Event()
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def release(self) -> None:
        """Let the executor holding this latch finish (callable from any thread)."""
        with self._lock:
            self._released.set()
            if self._loop is not None and self._event is not None:
                self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self) -> None:
        """Wait on the server's loop until :meth:`release`."""
        with self._lock:
            if self._event is None:
                self._event = asyncio.Event()
                self._loop = asyncio.get_running_loop()
            if self._released.is_set():
                self._event.set()
        await self._event.wait()


class Latches:
    """Latches by key, created on first use from either side."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latches: dict[str, Latch] = {}

    def __getitem__(self, key: str) -> Latch:
        with self._lock:
            latch = self._latches.get(key)
            if latch is None:
                latch = self._latches[key] = Latch()
            return latch

    def release_all(self) -> None:
        """Release every latch (test teardown: nothing stays blocked)."""
        with self._lock:
            latches = list(self._latches.values())
        for latch in latches:
            latch.release()


class ControlledExecutor(AgentExecutor):
    """A trivial agent driven by the message text (see the module docstring)."""

    def __init__(self, latches: Latches) -> None:
        self.latches = latches
        self.executions = 0
        self.running = 0
        self.peak_running = 0

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Answer ``echo``, hold a task for ``hold <key>``, ask for ``ask``, raise for ``fail``."""
        assert context.message is not None
        text = get_message_text(context.message)
        command, _, arg = text.partition(" ")
        self.executions += 1
        if command == "echo":
            await event_queue.enqueue_event(
                Message(
                    role=Role.ROLE_AGENT,
                    message_id=str(uuid.uuid4()),
                    parts=[Part(text=arg)],
                    context_id=context.context_id or "",
                )
            )
            return
        if command == "fail":
            raise RuntimeError("asked to fail")
        if command not in ("hold", "ask"):
            raise ValueError(f"unknown command {text!r}")
        task = context.current_task
        if task is None:
            task = new_task_from_user_message(context.message)
            task.id = context.task_id or task.id
            task.context_id = context.context_id or task.context_id
            await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        if command == "ask":
            await updater.requires_input(updater.new_agent_message([Part(text="which one?")]))
            return
        latch = self.latches[arg]
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            await updater.start_work()
            latch.started.set()
            await latch.wait()
            await updater.complete()
        except asyncio.CancelledError:
            latch.cancelled.set()
            raise
        finally:
            self.running -= 1
            latch.finished.set()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Mark the task canceled."""
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        await updater.cancel()


def agent_card(base_url: str) -> AgentCard:
    """The card of the test agent, with JSON-RPC and REST interfaces at ``base_url``."""
    return AgentCard(
        name="front door test agent",
        description="echoes and holds tasks on command",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url=base_url + "/", protocol_binding="JSONRPC", protocol_version="1.0"),
            AgentInterface(url=base_url, protocol_binding="HTTP+JSON", protocol_version="1.0"),
        ],
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="echo", name="echo", description="echo", tags=["test"])],
    )


async def _custom(request: Request) -> Response:
    return JSONResponse({"custom": True})


async def _upload(request: Request) -> Response:
    digest = hashlib.sha256()
    size = 0
    async for chunk in request.stream():
        digest.update(chunk)
        size += len(chunk)
    return JSONResponse({"size": size, "sha256": digest.hexdigest()})


def build_sdk_app(executor: AgentExecutor, base_url: str) -> Starlette:
    """The SDK's routes for ``executor`` plus ``/custom`` and ``/upload``."""
    card = agent_card(base_url)
    handler = DefaultRequestHandler(
        agent_executor=executor, task_store=InMemoryTaskStore(), agent_card=card
    )
    routes: list[Any] = [
        Route("/custom", _custom, methods=["GET"]),
        Route("/upload", _upload, methods=["POST"]),
        *create_agent_card_routes(card),
        *create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True),
        *create_rest_routes(handler, enable_v0_3_compat=True),
    ]
    return Starlette(routes=routes)


class Switch:
    """An ASGI app that forwards to whatever app the test put in :attr:`app`."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


class ServerThread:
    """uvicorn on 127.0.0.1 (port 0) in a thread with its own event loop."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.switch = Switch(_not_ready)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, app: Callable[..., Any]) -> None:
        """Serve ``app`` (through the switch); returns once uvicorn accepts connections."""
        self.switch.app = app
        config = uvicorn.Config(
            self.switch,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
            access_log=False,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def _run(self) -> None:
        assert self._server is not None

        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            assert self._server is not None
            await self._server.serve(sockets=[self.sock])

        asyncio.run(serve())

    def stop(self) -> None:
        """Stop uvicorn and join its thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.sock.close()


async def _not_ready(scope: Any, receive: Any, send: Any) -> None:
    raise RuntimeError("no app installed")


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``condition`` (cheaply) until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def jsonrpc(method: str, params: dict[str, Any], rpc_id: Any = "1") -> dict[str, Any]:
    """A JSON-RPC 2.0 request object."""
    return {"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": params}


def send_params(
    text: str, *, return_immediately: bool = False, task_id: str | None = None
) -> dict[str, Any]:
    """``SendMessageRequest`` params (JSON) for a user message with ``text``."""
    message: dict[str, Any] = {
        "role": "ROLE_USER",
        "messageId": str(uuid.uuid4()),
        "parts": [{"text": text}],
    }
    if task_id is not None:
        message["taskId"] = task_id
    params: dict[str, Any] = {"message": message}
    if return_immediately:
        params["configuration"] = {"returnImmediately": True}
    return params
