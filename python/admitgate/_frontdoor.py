"""What every front door shares: the request's slot, the work rule and the refusal's marks.

The HTTP middleware (:mod:`admitgate.asgi`), the gRPC interceptor (:mod:`admitgate.grpc`),
the executor wrapper (:mod:`admitgate.a2a`) and the clients that recognise a refusal
(:mod:`admitgate.client`, the gRPC client interceptors) meet here, so no front door imports
another's private names:

- the slot of the gated request in flight (:class:`RequestSlot` in :data:`CURRENT_SLOT`),
  which a ``GatedAgentExecutor`` running that request's work on the same gate takes over
  (:func:`adopt_request_slot`) instead of taking a second slot;
- which A2A methods start or continue agent work (:data:`A2A_WORK_METHODS`);
- how a refusal is answered (:func:`refusal`: the reason, its statuses from
  :data:`admitgate.REJECTION_REASONS`, the retry hint, rounded up by :func:`whole_seconds`
  and :func:`whole_ms`) and the marks a client knows it by (:data:`REASON_KEY`,
  :data:`ERROR_DOMAIN`, :data:`JSONRPC_REJECTED_CODE`);
- the ``admitgate-throttled`` mark an app puts on its answer to a provider 429
  (:data:`THROTTLED_KEY`, read by :func:`throttle_hint`);
- the check of what a ``session_id`` callable returns, and the check of ``gate`` that the
  gRPC interceptor and the metrics collector (:mod:`admitgate.metrics`) make.

It imports no front door, nor grpc, httpx or the A2A SDK.
"""

from __future__ import annotations

import contextvars
import math
from typing import Any, Final, NamedTuple

from ._admitgate import AdmissionGate
from ._errors import REJECTION_REASONS, AdmissionRejected

# -- the request's slot ------------------------------------------------------------------------


class RequestSlot:
    """The slot a gated request holds, shareable with :class:`admitgate.a2a.GatedAgentExecutor`.

    The request holds one share until its response ends or its handler returns (a client that
    left does not end it while the handler runs); an executor running that request's work on
    the same gate may adopt a second share, so the slot is released when both are done and
    the same work never takes two slots.

    The turn ends as a turn's ``async with gate.admit()`` block ends: with the exception that
    left the request's handler or its work, if one did (:meth:`saw`), so an exception of
    ``AdaptiveLimit.throttle_on`` is a throttle signal; and with what was reported on the way
    (:meth:`report_throttled`).
    """

    __slots__ = ("gate", "_admission", "_request_share", "_work_share", "_error")

    def __init__(self, gate: Any, admission: Any) -> None:
        self.gate = gate
        self._admission = admission
        self._request_share = True
        self._work_share = False
        self._error: BaseException | None = None

    def adopt(self, gate: Any) -> bool:
        """Take the work share if ``gate`` is this slot's gate and the request still holds it."""
        if gate is not self.gate or not self._request_share or self._work_share:
            return False
        self._work_share = True
        return True

    def saw(self, exc: BaseException) -> None:
        """Note an exception that left the request's handler or its work while the slot is
        held; the turn ends with the first one noted."""
        if self._error is None and (self._request_share or self._work_share):
            self._error = exc

    def report_throttled(self, retry_after_s: float | None) -> None:
        """The provider throttled this request's call (see ``Admission.report_throttled``)."""
        if self._request_share or self._work_share:
            self._admission.report_throttled(retry_after_s)

    def report_usage(self, tokens: int) -> None:
        """The agent reported the tokens this request's turn used (``turn.report_usage``)."""
        if self._request_share or self._work_share:
            self._admission.report_usage(tokens=tokens)

    async def end_request(self) -> None:
        """Give back the request's share (idempotent)."""
        if self._request_share:
            self._request_share = False
            if not self._work_share:
                await self._end_turn()

    async def end_work(self) -> None:
        """Give back the adopted work share (idempotent)."""
        if self._work_share:
            self._work_share = False
            if not self._request_share:
                await self._end_turn()

    async def _end_turn(self) -> None:
        exc, self._error = self._error, None  # no cycle through the traceback once ended
        if exc is None:
            await self._admission.__aexit__(None, None, None)
        else:
            await self._admission.__aexit__(type(exc), exc, exc.__traceback__)


CURRENT_SLOT: contextvars.ContextVar[RequestSlot | None] = contextvars.ContextVar(
    "admitgate_request_slot", default=None
)
"""The slot of the gated request (HTTP or gRPC) whose handler runs in this context."""


def adopt_request_slot(gate: Any) -> RequestSlot | None:
    """The slot of the gated request running in this context, adopted for its work, if any."""
    slot = CURRENT_SLOT.get()
    if slot is not None and slot.adopt(gate):
        return slot
    return None


# -- which requests are gated ------------------------------------------------------------------

A2A_WORK_METHODS: Final = ("SendMessage", "SendStreamingMessage", "SubscribeToTask")
"""The A2A methods that start or continue agent work, as A2A 1.0 names them in every binding.
Each front door adds its own spelling of the v0.3 names (they differ between bindings)."""

GATE_METHODS: Final = ("work", "all")
"""The values of a front door's ``gate_methods``."""

# -- refusals ----------------------------------------------------------------------------------

ERROR_DOMAIN: Final = "admitgate"
"""``ErrorInfo.domain`` of a REST refusal (the A2A SDK's own errors use ``a2a-protocol.org``)."""

ERROR_INFO_TYPE: Final = "type.googleapis.com/google.rpc.ErrorInfo"
"""The ``@type`` of ``google.rpc.ErrorInfo`` in a JSON error's ``details``."""

JSONRPC_REJECTED_CODE: Final = -32029
"""JSON-RPC error code of a refusal: in the implementation-defined server-error range
(-32000..-32099) and outside the codes A2A uses (-32001..-32009)."""

REASON_KEY: Final = "admitgate-reason"
"""The HTTP header and gRPC trailer carrying a refusal's reason; its presence marks a refusal
by a front door, which never reached the agent."""

PRIORITY_KEY: Final = "admitgate-priority"
"""The gRPC trailer naming a refused call's priority class (on a gate with classes). HTTP
refusals name it in their bodies: ``data.priority`` of a JSON-RPC error, ``metadata.priority``
of a REST error's ``ErrorInfo``."""

DEFAULT_STATUSES: Final = (429, "RESOURCE_EXHAUSTED")
"""The HTTP status and gRPC code of a reason missing from ``REJECTION_REASONS`` (an
``AdmissionRejected`` raised by user code with ``reason=None``): "try again later"."""


class Refusal(NamedTuple):
    """How a front door answers one ``AdmissionRejected``."""

    reason: str
    """The gate's reason, ``"rejected"`` when it gave none."""
    http_status: int
    """429 or 503, from ``REJECTION_REASONS``."""
    grpc_status: str
    """The ``grpc.StatusCode`` name, from ``REJECTION_REASONS``."""
    retry_after: float | None
    """The hint to send, in seconds: the front door's fixed one, else the gate's, else none."""


def refusal(exc: AdmissionRejected, retry_after: float | None) -> Refusal:
    """The answer to ``exc`` for a front door configured with ``retry_after`` (``None``: use
    the gate's hint)."""
    reason = exc.reason or "rejected"
    http_status, grpc_status = REJECTION_REASONS.get(reason, DEFAULT_STATUSES)
    hint = retry_after if retry_after is not None else exc.retry_after
    return Refusal(reason, http_status, grpc_status, hint)


DEADLINE_HEADER: Final = b"x-envoy-expected-rq-timeout-ms"
"""The HTTP request header a front door reads the caller's deadline from: Envoy's, in whole
milliseconds (Envoy sets it on the requests it forwards; any client may send it). A value
that is not 1 to 10 ASCII digits is ignored."""


def header_deadline_s(headers: list[tuple[bytes, bytes]]) -> float | None:
    """The seconds left for a request, from :data:`DEADLINE_HEADER` in ASGI ``headers``."""
    for name, value in headers:
        if name == DEADLINE_HEADER:
            if 0 < len(value) <= 10 and value.isdigit():  # bytes.isdigit is ASCII only
                return int(value) / 1000.0
            return None
    return None


THROTTLED_KEY: Final = "admitgate-throttled"
"""The HTTP response header (and gRPC trailing metadata key) an app behind a front door sets
on the answer to a gated request whose provider call was throttled (a 429 it turned into its
own answer): the front door reports the throttle to the request's turn (as
``turn.report_throttled()``) and removes the header (the trailer) before it reaches the
client. Its value is the provider's ``Retry-After`` in seconds when it is a number of 0 to
86400, else the throttle is reported without one. Opt-in: only an app sets it, never a
front door (a refusal by the gate is no throttle of the provider's)."""

_MAX_THROTTLE_HINT_S: Final = 86400.0


def throttle_hint(value: bytes | str) -> float | None:
    """The seconds :data:`THROTTLED_KEY`'s ``value`` carries, ``None`` if none."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if not 0 < len(text) <= 16 or not text.replace(".", "", 1).isdigit() or not text.isascii():
        return None
    seconds = float(text)
    return seconds if seconds <= _MAX_THROTTLE_HINT_S else None


def whole_seconds(hint: float) -> int:
    """A retry hint as ``Retry-After`` sends it: whole seconds, rounded up, never negative."""
    return max(0, math.ceil(hint))


def whole_ms(hint: float) -> int:
    """A retry hint as ``grpc-retry-pushback-ms`` and ``RetryInfo`` send it: whole
    milliseconds, rounded up."""
    return math.ceil(hint * 1000.0)


# -- argument checks ---------------------------------------------------------------------------


def check_abandoned_response_timeout(value: object) -> float:
    """``abandoned_response_timeout`` as seconds: a finite number >= 0 (``0``: the app is told
    at once that its client left), the same rule as the broker's flag."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"abandoned_response_timeout must be a finite number of seconds >= 0, got {value!r}"
        )
    return float(value)


def check_gate(gate: object) -> None:
    """``TypeError`` unless ``gate`` is an :class:`admitgate.AdmissionGate`."""
    if not isinstance(gate, AdmissionGate):
        hint = (
            " (build_admission_gate returns None when nothing is configured)"
            if gate is None
            else ""
        )
        raise TypeError(f"gate must be an admitgate.AdmissionGate, got {gate!r}{hint}")


def checked_session(session: object, argument: str) -> str:
    """``session``, what ``session_id(<argument>)`` returned, if it is a str; ``TypeError``
    otherwise."""
    if type(session) is not str:
        raise TypeError(f"session_id({argument}) must return a str, got {session!r}")
    return session
