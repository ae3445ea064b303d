"""Gate an A2A agent's work, not only its requests: an ``AgentExecutor`` wrapper for ``a2a-sdk``.

With ``SendMessage`` and ``returnImmediately``, the response returns as soon as the task
exists while the agent keeps working, so a request-level cap (:mod:`admitgate.asgi`,
:mod:`admitgate.grpc`) does not bound that work. :class:`GatedAgentExecutor` holds a slot
for the whole ``execute`` of a task::

    handler = DefaultRequestHandler(
        agent_executor=GatedAgentExecutor(MyExecutor(), gate),
        task_store=InMemoryTaskStore(),
        agent_card=card,
    )

Needs the ``a2a-sdk`` package (``pip install 'admitgate[a2a]'``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any, Final

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import Message, Part, Role, Task, TaskState, TaskStatus

from ._errors import AdmissionRejected
from ._frontdoor import adopt_request_slot, checked_session

__all__ = ["GatedAgentExecutor"]

_TRANSPORT = re.compile(r"[a-z0-9_]{1,32}")
_INTERRUPTED: Final = frozenset(
    {TaskState.TASK_STATE_INPUT_REQUIRED, TaskState.TASK_STATE_AUTH_REQUIRED}
)


class GatedAgentExecutor(AgentExecutor):
    """An ``AgentExecutor`` that runs each ``execute`` of the wrapped executor with a slot.

    The slot is held from the start of ``execute`` until it returns or raises, however long
    the task runs after its HTTP response (``returnImmediately``) and whichever transport
    (JSON-RPC, REST, gRPC) started it; a task waiting in the gate's queue is withdrawn when it
    is cancelled. ``cancel`` passes straight through, so a task can always be told to stop.

    Refused (``AdmissionRejected`` on entry), the wrapped executor is not called and the task
    is answered as the SDK expects, through the event queue: a new task ends in
    ``TASK_STATE_REJECTED`` with an agent message carrying the busy text, and metadata
    ``{"admitgate": {"reason": ..., "retryAfter": ...}}`` on the task (seconds, or ``None``);
    a task resumed from ``input-required`` or ``auth-required`` is put back in that state
    with the same message, so the client can resend its input later. A blocking
    ``SendMessage`` returns that task; with ``returnImmediately`` the client sees it when it
    polls or subscribes.

    When this executor runs behind :class:`admitgate.asgi.AdmissionMiddleware` or
    :class:`admitgate.grpc.AdmissionInterceptor` **on the same gate**, it takes over the slot
    the request (or call) already holds instead of taking a second one (a blocking
    ``SendMessage`` would otherwise need two slots, and a full gate would deadlock): the slot
    is then released when both the response and ``execute`` are done, counted under the
    request's transport and tenant. This needs the SDK's default request handler
    (``DefaultRequestHandler``), which runs ``execute`` in a copy of the request's context;
    give the legacy handler separate gates.

    An exception leaving the wrapped ``execute`` ends the turn as it would leave an
    ``async with gate.admit()`` block (then propagates to the SDK as before): with
    ``adaptive=AdaptiveLimit(throttle_on=(RateLimitError,))``, a ``RateLimitError`` is a
    throttle signal. The SDK answers such an exception itself (a JSON-RPC error, a REST 500),
    so behind the HTTP middleware or the gRPC interceptor this wrapper is how an agent's
    throttle reaches the gate: the middleware only sees exceptions that leave the app.

    Args:
        executor: the ``AgentExecutor`` doing the work.
        gate: the :class:`admitgate.AdmissionGate` whose slots bound that work.
        session_id: ``callable(context: RequestContext) -> str`` giving the tenant key;
            ``None``: no tenant (``""``). Prefer an authenticated identity
            (``context.call_context.user``) to anything the client chooses freely.
        transport: the transport label of the slots it takes (``[a-z0-9_]{1,32}``, not
            ``"passthrough"``).

    Raises:
        TypeError: ``executor``, ``gate`` or ``session_id`` is not what it should be.
        ValueError: ``transport`` is not a valid label.
    """

    def __init__(
        self,
        executor: AgentExecutor,
        gate: Any,
        *,
        session_id: Callable[[RequestContext], str] | None = None,
        transport: str = "a2a_task",
    ) -> None:
        if not isinstance(executor, AgentExecutor):
            raise TypeError(f"executor must be an a2a AgentExecutor, got {executor!r}")
        if not callable(getattr(gate, "admit", None)):
            raise TypeError(f"gate must be an admitgate.AdmissionGate, got {gate!r}")
        if session_id is not None and not callable(session_id):
            raise TypeError(
                f"session_id must be None or a callable(context) -> str, got {session_id!r}"
            )
        if (
            not isinstance(transport, str)
            or not _TRANSPORT.fullmatch(transport)
            or transport == "passthrough"
        ):
            raise ValueError(
                'transport must match [a-z0-9_]{1,32} and not be "passthrough", '
                f"got {transport!r}"
            )
        self.executor = executor
        self.gate = gate
        self.session_id = session_id
        self.transport = transport

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Run the wrapped ``execute`` holding a slot, or answer the task as refused."""
        adopted = adopt_request_slot(self.gate)
        if adopted is not None:
            try:
                await self.executor.execute(context, event_queue)
            except BaseException as exc:
                adopted.saw(exc)  # the request's turn ends with it, as its own would
                raise
            finally:
                await adopted.end_work()
            return
        session = (
            "" if self.session_id is None else checked_session(self.session_id(context), "context")
        )
        admission = self.gate.admit(session_id=session, transport=self.transport)
        try:
            await admission.__aenter__()
        except AdmissionRejected as exc:
            await _refuse(context, event_queue, exc)
            return
        try:
            await self.executor.execute(context, event_queue)
        except BaseException as exc:
            # As `async with gate.admit()` ends: a throttle_on exception is a 429 signal.
            await admission.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        await admission.__aexit__(None, None, None)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Pass the cancellation to the wrapped executor (never gated)."""
        await self.executor.cancel(context, event_queue)


async def _refuse(context: RequestContext, event_queue: EventQueue, exc: AdmissionRejected) -> None:
    task_id = context.task_id or ""
    context_id = context.context_id or ""
    busy = Message(
        role=Role.ROLE_AGENT,
        message_id=str(uuid.uuid4()),
        parts=[Part(text=exc.message)],
        task_id=task_id,
        context_id=context_id,
    )
    metadata = {"admitgate": {"reason": exc.reason, "retryAfter": exc.retry_after}}
    current = context.current_task
    if current is None:
        # A new task: the SDK wants the Task itself before any status update.
        task = Task(
            id=task_id,
            context_id=context_id,
            status=TaskStatus(state=TaskState.TASK_STATE_REJECTED, message=busy),
            history=[context.message] if context.message is not None else [],
        )
        task.metadata.update(metadata)
        task.status.timestamp.GetCurrentTime()
        await event_queue.enqueue_event(task)
        return
    state = (
        current.status.state
        if current.status.state in _INTERRUPTED
        else TaskState.TASK_STATE_REJECTED
    )
    busy.task_id, busy.context_id = current.id, current.context_id
    updater = TaskUpdater(event_queue, current.id, current.context_id)
    await updater.update_status(state, message=busy, metadata=metadata)
