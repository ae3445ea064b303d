"""What the broker's attack suites share: an agent that counts its concurrent executions, the
SDK app on hypercorn (HTTP/1.1 and h2c on one port), and a raw-socket HTTP/1.1 client (what an
attacker uses: any bytes, any header, split anywhere).

- :class:`CountingExecutor` runs every execution for the time its message asks (``sleep
  <seconds>``, or ``echo <text>`` at once) and counts executions, those running now and the
  most that ever ran at once: the quantity the broker's cap bounds.
- :class:`HypercornThread` serves an ASGI app with hypercorn on a loopback port, in a thread
  with its own event loop. hypercorn speaks h2c with prior knowledge (and checks
  ``:authority`` against ``Host`` as RFC 9113 §8.3.1 asks, as the ``h2`` library does).
- :func:`raw_exchange` sends bytes on a fresh connection and reads one HTTP/1.1 response.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from a2a.helpers.proto_helpers import get_message_text, new_task_from_user_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import Message, Part, Role

#: The reasons a broker refusal may carry (``admitgate.REJECTION_REASONS``).
DOCUMENTED_REASONS = {
    "queue_full",
    "shed",
    "policy",
    "timeout",
    "deadline",
    "memory_pressure",
    "closing",
    "fleet_unavailable",
}
#: The broker's own answers that are not refusals of the gate: a request target it cannot
#: forward (400), a body that did not arrive in time (408), the agent unreachable (502).
BROKER_ERRORS = {400, 408, 413, 502}


class CountingExecutor(AgentExecutor):
    """Counts executions; ``sleep <s>`` answers a message after ``s`` seconds, ``task <s>``
    creates a working task at once and completes it after ``s`` seconds (a stream's events
    start at once), ``big <n>`` answers ``n`` bytes of text, anything else answers at
    once."""

    def __init__(self) -> None:
        self.executions = 0
        self.running = 0
        self.peak = 0
        self.finished = 0

    def reset(self) -> None:
        """Forget the peak and the counts (nothing may be running)."""
        assert self.running == 0, self.running
        self.executions = self.peak = self.finished = 0

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Answer after the time the message asks for, counting this execution meanwhile."""
        assert context.message is not None
        text = get_message_text(context.message)
        self.executions += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            command, _, arg = text.partition(" ")
            if command == "task":
                # A task that is working at once (a stream's first events), done later.
                task = new_task_from_user_message(context.message)
                task.id = context.task_id or task.id
                task.context_id = context.context_id or task.context_id
                await event_queue.enqueue_event(task)
                updater = TaskUpdater(event_queue, task.id, task.context_id)
                await updater.start_work()
                await asyncio.sleep(float(arg))
                await updater.complete()
                return
            if command == "sleep":
                await asyncio.sleep(float(arg))
            if command == "big":
                text = "x" * int(arg)
            await event_queue.enqueue_event(
                Message(
                    role=Role.ROLE_AGENT,
                    message_id=str(uuid.uuid4()),
                    parts=[Part(text=text)],
                    context_id=context.context_id or "",
                )
            )
        finally:
            self.running -= 1
            self.finished += 1

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Nothing to cancel: executions end by themselves."""


def free_port() -> int:
    """A loopback port free now (for a server that cannot be handed a bound socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HypercornThread:
    """hypercorn on 127.0.0.1 in a thread with its own event loop."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    def start(self, app: Callable[..., Any]) -> None:
        """Serve ``app``; returns once hypercorn accepts connections."""
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        config = Config()
        config.bind = [f"127.0.0.1:{self.port}"]
        config.loglevel = "WARNING"
        config.accesslog = None
        config.errorlog = None
        config.graceful_timeout = 1

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._started.set()
            await serve(app, config, shutdown_trigger=self._stop.wait)  # type: ignore[arg-type]

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        self._started.wait(10)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("hypercorn did not start") from None
                time.sleep(0.02)

    def stop(self) -> None:
        """Stop hypercorn and join its thread."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)


@dataclass
class RawResponse:
    """One HTTP/1.1 response as read from a socket (``status`` 0: the connection closed
    without one)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def read_response(sock: socket.socket, pending: bytearray | None = None) -> RawResponse:
    """Reads one response (Content-Length, chunked, or to the close; 1xx skipped). Bytes
    read past it (a pipelined next response) are left in ``pending`` for the next call,
    which starts from them."""
    carry = pending if pending is not None else bytearray()
    data = bytes(carry)
    carry.clear()

    def more() -> bytes:
        return sock.recv(65536)

    while True:
        while b"\r\n\r\n" not in data:
            chunk = more()
            if not chunk:
                return RawResponse()
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200 and status != 101:
            continue
        break
    if status == 101:
        return RawResponse(status, headers, data)
    if "content-length" in headers:
        length = int(headers["content-length"])
        while len(data) < length:
            chunk = more()
            if not chunk:
                break
            data += chunk
        carry.extend(data[length:])
        return RawResponse(status, headers, data[:length])
    if "chunked" in headers.get("transfer-encoding", ""):
        while b"0\r\n\r\n" not in data:
            chunk = more()
            if not chunk:
                break
            data += chunk
        end = data.find(b"0\r\n\r\n") + 5 if b"0\r\n\r\n" in data else len(data)
        carry.extend(data[end:])
        return RawResponse(status, headers, data[:end])
    while True:
        chunk = more()
        if not chunk:
            return RawResponse(status, headers, data)
        data += chunk


def raw_exchange(
    address: str, pieces: list[bytes], *, pause: float = 0.0, timeout: float = 20.0
) -> RawResponse:
    """Sends ``pieces`` on a fresh connection to ``address`` (``host:port``), ``pause``
    seconds apart, then reads one response."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        for i, piece in enumerate(pieces):
            if i and pause:
                time.sleep(pause)
            sock.sendall(piece)
        try:
            return read_response(sock)
        except (ConnectionResetError, BrokenPipeError):
            return RawResponse()


def request_bytes(
    method: str, target: str, headers: list[tuple[str, str]], body: bytes = b""
) -> bytes:
    """An HTTP/1.1 request as bytes, headers exactly as given (no Content-Length added)."""
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return head.encode("latin-1") + b"\r\n" + body


def h2c_post_headers(body: bytes) -> Any:
    """An h2c client connection (prior knowledge) with its preface and the HEADERS of an A2A
    1.0 JSON-RPC POST of ``body`` queued on stream 1; the caller sends the body (whole or in
    part) with ``send_data(1, ...)`` and writes ``data_to_send()``."""
    import h2.config
    import h2.connection

    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    connection.send_headers(
        1,
        [
            (":method", "POST"),
            (":path", "/"),
            (":scheme", "http"),
            (":authority", "agent"),
            ("content-type", "application/json"),
            ("a2a-version", "1.0"),
            ("content-length", str(len(body))),
        ],
    )
    return connection
