"""Draining a gate: ``await gate.close(drain_timeout=...)`` and ``gate.close_sync(...)``.

The native gate does the work that must be atomic (stop admitting, refuse every queued turn
with ``closing``, count what still runs) and tells when the last running turn has ended; this
module waits for that, bounded by the timeout, and reports.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, NamedTuple


class DrainReport(NamedTuple):
    """What a drain did.

    ``finished``: turns that were running when the drain began and ended before it returned.
    ``still_running``: turns still running when it returned (the timeout passed first); they
    are never cancelled. ``queued_rejected``: waiting turns refused with ``closing`` when the
    drain began, turns that held their local slot while waiting for a fleet lease included
    (they had not started).
    """

    finished: int
    still_running: int
    queued_rejected: int


def _timeout(drain_timeout: Any) -> float | None:
    if drain_timeout is None:
        return None
    if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float)):
        raise TypeError(f"drain_timeout must be a number of seconds or None, got {drain_timeout!r}")
    if math.isnan(drain_timeout) or drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0 seconds or None, got {drain_timeout!r}")
    return None if math.isinf(drain_timeout) else float(drain_timeout)


def _report(running_at_start: int, refused: int, still_running: int) -> DrainReport:
    return DrainReport(
        finished=max(running_at_start - still_running, 0),
        still_running=still_running,
        queued_rejected=refused,
    )


async def close(gate: Any, drain_timeout: Any = None) -> DrainReport:
    """See ``AdmissionGate.close``."""
    timeout = _timeout(drain_timeout)
    running, refused = gate._begin_close()
    drained = gate._drained_future()
    if drained is not None:
        try:
            # shield: a timeout must not cancel the future the gate will resolve.
            await asyncio.wait_for(asyncio.shield(drained), timeout)
        except asyncio.TimeoutError:
            pass
    return _report(running, refused, gate._running())


def close_sync(gate: Any, drain_timeout: Any = None) -> DrainReport:
    """See ``AdmissionGate.close_sync``."""
    timeout = _timeout(drain_timeout)
    running, refused = gate._begin_close()
    gate._wait_drained(timeout)
    return _report(running, refused, gate._running())
