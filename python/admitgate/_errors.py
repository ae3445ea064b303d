"""The exception a rejected or shed turn raises."""

from __future__ import annotations

DEFAULT_BUSY_MESSAGE = "Busy right now \u2014 please resend in a moment."


class AdmissionRejected(Exception):
    """A turn was refused because the gateway is at capacity.

    ``message`` is a user-facing busy acknowledgement a bot can send as is. ``reason`` says
    why the gate refused: ``"queue_full"`` (the queue the turn would join was full),
    ``"memory_pressure"`` (RSS at or above the hard threshold), ``"shed"`` (evicted from the
    queue by a newer turn under ``shed_oldest``) or ``"policy"`` (a custom policy said
    reject); ``None`` when raised by user code.
    """

    def __init__(self, message: str = DEFAULT_BUSY_MESSAGE, *, reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason
