"""The exception a refused turn raises, and the one table of rejection reasons."""

from __future__ import annotations

from typing import Any

DEFAULT_BUSY_MESSAGE = "Busy right now \u2014 please resend in a moment."

#: Every reason a turn can be refused for, with the HTTP status and gRPC status code name a
#: front door answers it with. ``queue_full``, ``policy``, ``memory_pressure``, ``closing``,
#: ``timeout``, ``fleet_unavailable`` and ``deadline`` count in the gate's ``rejected``;
#: ``shed`` counts in ``shed``; ``rate_limited`` (a budget, ``rate_limit=``, refused the turn
#: before it reached the gate) counts in ``stats()["rate_limits"][name]["limited"]``. ``deadline`` answers 504 / DEADLINE_EXCEEDED: the caller's own
#: deadline (``admit(deadline_s=...)``) cannot be met, which is not a reason to retry sooner.
REJECTION_REASONS: dict[str, tuple[int, str]] = {
    "queue_full": (429, "RESOURCE_EXHAUSTED"),
    "shed": (429, "RESOURCE_EXHAUSTED"),
    "policy": (429, "RESOURCE_EXHAUSTED"),
    "memory_pressure": (503, "UNAVAILABLE"),
    "closing": (503, "UNAVAILABLE"),
    "timeout": (429, "RESOURCE_EXHAUSTED"),
    "fleet_unavailable": (503, "UNAVAILABLE"),
    "deadline": (504, "DEADLINE_EXCEEDED"),
    "rate_limited": (429, "RESOURCE_EXHAUSTED"),
}


class AdmissionRejected(Exception):
    """A turn was refused because the gateway is at capacity.

    ``message`` is a user-facing busy acknowledgement a bot can send as is (``str(exc)`` is
    the same text). ``reason`` says why the gate refused (``None`` when raised by user code):

    ===================== ============ ====== ==================
    reason                counted in   HTTP   gRPC
    ===================== ============ ====== ==================
    ``queue_full``        ``rejected`` 429    RESOURCE_EXHAUSTED
    ``shed``              ``shed``     429    RESOURCE_EXHAUSTED
    ``policy``            ``rejected`` 429    RESOURCE_EXHAUSTED
    ``memory_pressure``   ``rejected`` 503    UNAVAILABLE
    ``closing``           ``rejected`` 503    UNAVAILABLE
    ``timeout``           ``rejected`` 429    RESOURCE_EXHAUSTED
    ``fleet_unavailable`` ``rejected`` 503    UNAVAILABLE
    ``deadline``          ``rejected`` 504    DEADLINE_EXCEEDED
    ``rate_limited``      ``limited``  429    RESOURCE_EXHAUSTED
    ===================== ============ ====== ==================

    ``queue_full``: the queue the turn would join was full; ``shed``: evicted from the queue
    by a newer turn under ``shed_oldest``; ``policy``: a custom policy said reject;
    ``memory_pressure``: RSS at or above the hard threshold; ``closing``: the gate is
    draining; ``timeout``: the turn waited longer than the queue timeout (or, under
    ``queue_discipline="adaptive"``, longer than a standing queue's cap);
    ``fleet_unavailable``: the fleet limit's backend is down and the gate is set to refuse;
    ``deadline``: the caller's deadline (``admit(deadline_s=...)``) passed while it waited,
    or less of it was left than a turn typically takes, so it would not have finished;
    ``rate_limited``: a budget (``rate_limit=``) has no room for the turn's identity, counted
    in its ``limited`` (``stats()["rate_limits"]``), never in the gate's counters: the turn
    was refused before it reached the gate.

    ``retry_after`` is the gate's hint, in seconds, of when trying again may succeed: for
    capacity reasons ``(turns ahead + 1) / recent release rate`` clamped to 1..30 s (the rate
    is measured over the last 10 s); a fixed 5 s for ``memory_pressure``; ``None`` for
    ``policy`` and when raised by user code. For ``rate_limited`` it is exact: the time at
    which the same turn fits the budget (if nothing else is admitted for that identity
    first), ``None`` if it never fits (its ``cost`` is more than a whole window of tokens);
    ``retry_after_s`` is the same value. The front doors send it as ``Retry-After``
    (whole seconds, rounded up) and ``grpc-retry-pushback-ms``.

    ``priority`` names the refused turn's priority class on a gate built with
    ``priorities=[...]`` (``None`` otherwise): a full queue sheds the least important class
    first, so a ``shed`` turn's class says who gave way (see ``docs/priorities.md``).
    """

    def __init__(
        self,
        message: str = DEFAULT_BUSY_MESSAGE,
        *,
        reason: str | None = None,
        retry_after: float | None = None,
        priority: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.retry_after = retry_after
        self.priority = priority

    #: For ``rate_limited``: the :class:`admitgate.RateLimit` that refused the turn, and the
    #: index of its rate that did (its ``requests`` rates first, then its ``tokens``); what
    #: a front door names in its ``RateLimit`` field. ``None`` for every other reason.
    rate_limit: Any = None
    rate_limit_index: int | None = None

    @property
    def retry_after_s(self) -> float | None:
        """``retry_after``, in seconds (exact for ``rate_limited``)."""
        return self.retry_after
