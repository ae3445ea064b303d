"""admitgate: the admission gate for AI-agent gateways.

Decides, for every inbound agent turn, whether it runs now, waits in a bounded FIFO queue,
or is rejected with a busy reply: a concurrency ceiling, per-tenant sub-limits, overflow
policies (``reject`` / ``queue`` / ``shed_oldest``) and memory-aware admission, with a Rust
core. A drop-in for PraisonAI BotOS's pure-Python gate (see :mod:`admitgate.praisonai`).

    gate = admitgate.build_admission_gate(max_concurrent_runs=32, queue_depth=128)
    async with gate.admit(session_id=user_id):
        reply = await agent.run(message)
"""

from __future__ import annotations

import atexit as _atexit
import os as _os
from typing import Any

from . import _admitgate
from ._admitgate import (
    DURATION_BUCKETS,
    MAX_TRANSPORTS,
    AdaptiveLimit,
    AdmissionGate,
    ConcurrencyLimitPolicy,
    FleetLease,
    FleetLimit,
    InternalError,
    MemoryPressurePolicy,
    RateLimit,
    RecentUsage,
    RssSampler,
)
from ._builders import build_admission_gate, build_memory_pressure_policy
from ._drain import DrainReport
from ._errors import REJECTION_REASONS, AdmissionRejected
from ._priorities import PriorityClass
from ._types import ResourceSample

__version__: str = _admitgate.__version__

__all__ = [
    "DURATION_BUCKETS",
    "MAX_TRANSPORTS",
    "REJECTION_REASONS",
    "AdaptiveLimit",
    "AdmissionDecision",
    "AdmissionGate",
    "AdmissionRejected",
    "ConcurrencyLimitPolicy",
    "DrainReport",
    "FleetLease",
    "FleetLimit",
    "InternalError",
    "MemoryPressurePolicy",
    "PriorityClass",
    "RateLimit",
    "RecentUsage",
    "ResourceSample",
    "RssSampler",
    "build_admission_gate",
    "build_memory_pressure_policy",
]


def __getattr__(name: str) -> Any:
    # Resolved on first use: praisonaiagents' enum when it is installed (see _decision).
    if name == "AdmissionDecision":
        from ._decision import decision_enum

        return decision_enum()
    raise AttributeError(f"module 'admitgate' has no attribute {name!r}")


def _after_fork_in_child() -> None:
    _admitgate._reset_after_fork()
    _admitgate._reset_fleet_after_fork()
    _admitgate._invalidate_samplers()


if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_after_fork_in_child)

# Before the interpreter finalizes, threads other than the exiting one leave admitgate's Rust
# code and no longer enter it (a daemon thread inside it when CPython < 3.14 ends it would
# crash the process). Registered at import, so it runs after the atexit hooks registered later.
_atexit.register(_admitgate._quiesce_at_exit)
