"""``AdmissionDecision``, shared with praisonaiagents when it is installed.

PraisonAI's reference gate compares decisions by identity
(``decision is AdmissionDecision.REJECT``), so a policy from admitgate handed to that gate
must return praisonaiagents' own enum members. When ``praisonaiagents.gateway`` can be
imported, ``admitgate.AdmissionDecision`` *is* that enum; otherwise it is an identical
``str`` enum defined here. The choice is made once, on first use, so importing admitgate
never pays for importing praisonaiagents.
"""

from __future__ import annotations

import enum
import functools
from typing import Any


class AdmissionDecision(str, enum.Enum):
    """Outcome of one admission evaluation: admit now, wait in the queue, or reject."""

    ADMIT = "admit"
    QUEUE = "queue"
    REJECT = "reject"


AdmissionDecision.__module__ = "admitgate"


@functools.cache
def decision_enum() -> Any:
    """The ``AdmissionDecision`` enum this process uses."""
    try:
        from praisonaiagents.gateway import AdmissionDecision as shared  # type: ignore[import-untyped]
    except Exception:  # not installed, or broken: admitgate works without it
        return AdmissionDecision
    return shared


def members() -> tuple:
    """``(ADMIT, QUEUE, REJECT)`` of :func:`decision_enum`, for the native module."""
    decision = decision_enum()
    return (decision.ADMIT, decision.QUEUE, decision.REJECT)
