"""Plain data types shared with PraisonAI's policy protocol."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResourceSample:
    """A point-in-time reading of the process's memory.

    ``rss_mb`` is the resident set size in MiB, or ``None`` when the platform cannot report
    it (memory-aware admission then admits: a missing signal never blocks a turn).
    """

    rss_mb: float | None = None
