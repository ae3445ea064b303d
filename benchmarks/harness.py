"""What every workload shares: timed regions, interleaved repetitions, medians, results.

A workload builds a :class:`Result`, fills its rows with samples (one list per variant), then
adds ratios of medians, performance **targets** (a miss is reported, never an error) and
correctness **checks** (a failed check makes the bench exit non-zero).
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

perf = time.perf_counter


class CheckFailed(Exception):
    """A counter check failed in a way that makes the rest of the workload meaningless.

    Raised where carrying on could hang (a queue that is not as full as the workload needs);
    the runner reports it as a failed check, not as a crash.
    """


class Timed:
    """Times one region with the garbage collector collected before it and paused inside it.

    A collection triggered by one variant's garbage is then not charged to another variant.
    ``elapsed`` holds the seconds spent in the region once it is left.
    """

    def __enter__(self) -> Timed:
        gc.collect()
        self._was_enabled = gc.isenabled()
        gc.disable()
        self.elapsed = 0.0
        self._t0 = perf()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = perf() - self._t0
        if self._was_enabled:
            gc.enable()


def rotations(names: list[str], reps: int) -> list[list[str]]:
    """Interleaved order: each repetition runs every variant once, rotated by one."""
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(reps)]


def median(xs: list[float]) -> float:
    """The median of ``xs``, NaN when there is no sample."""
    return statistics.median(xs) if xs else float("nan")


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN when ``b`` is zero."""
    return a / b if b else float("nan")


class Result:
    """One workload's figures: rows of samples, ratios, targets, checks and notes."""

    def __init__(self, name: str, title: str, unit: str) -> None:
        self.name = name
        self.title = title
        self.unit = unit  # "us" (samples in seconds, shown in microseconds), "B", "turns/s", ...
        self.rows: dict[str, list[float]] = {}
        self.ratios: dict[str, float] = {}
        self.targets: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}
        self.error: str | None = None

    def median(self, variant: str) -> float:
        """The median of one variant's samples."""
        return median(self.rows.get(variant, []))

    def ratio(self, label: str, a: str, b: str) -> float:
        """Records and returns the ratio of the medians of variants ``a`` and ``b``."""
        value = ratio(self.median(a), self.median(b))
        self.ratios[label] = value
        return value

    def target(self, what: str, value: float, limit: float, *, at_least: bool = False) -> None:
        """Records a performance target: met when ``value <= limit`` (``>=`` if ``at_least``)."""
        met = value >= limit if at_least else value <= limit
        self.targets.append(
            {"target": what, "value": value, "limit": limit, "at_least": at_least, "met": met}
        )

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        """Records a correctness check (counters, bookkeeping); a failed one fails the bench."""
        self.checks.append({"check": what, "ok": bool(ok), "detail": detail})

    @property
    def failed_checks(self) -> list[dict[str, Any]]:
        """The checks that failed."""
        return [c for c in self.checks if not c["ok"]]

    def as_dict(self) -> dict[str, Any]:
        """Everything, for ``--json``."""
        return {
            "name": self.name,
            "title": self.title,
            "unit": self.unit,
            "medians": {k: self.median(k) for k in self.rows},
            "samples": self.rows,
            "ratios": self.ratios,
            "targets": self.targets,
            "checks": self.checks,
            "error": self.error,
            "notes": self.notes,
            **({"extra": self.extra} if self.extra else {}),
        }


def check_counters(result: Result, label: str, stats: dict[str, Any], admitted: int) -> None:
    """Checks a gate's ``stats()``: exactly ``admitted`` turns admitted, nothing held any more.

    Nothing may be in flight, queued or parked on a human, and nothing rejected, shed or
    cancelled: the workloads that call this only ever run turns to completion.
    """
    problems = []
    if stats["admitted"] != admitted:
        problems.append(f"admitted {stats['admitted']}, expected {admitted}")
    for key in ("in_flight", "queued", "awaiting_human", "rejected", "shed", "cancelled"):
        if stats.get(key, 0):
            problems.append(f"{key} {stats[key]}, expected 0")
    detail = "; ".join(problems) or (
        f"admitted {admitted}, nothing in flight or queued, nothing rejected, shed or cancelled"
    )
    result.check(f"{label} counters exact", not problems, detail)


def interleave(
    loop: asyncio.AbstractEventLoop,
    variants: Mapping[str, Callable[[], Awaitable[float]]],
    reps: int,
    result: Result,
    *,
    warmup: bool = True,
) -> None:
    """Runs every variant once per repetition in rotated order, appending to ``result.rows``.

    With ``warmup`` each variant first runs once unrecorded. The rows keep the declared order
    of ``variants`` (after the rows of earlier calls).
    """
    if warmup:
        for run in variants.values():
            loop.run_until_complete(run())
    for order in rotations(list(variants), reps):
        for name in order:
            result.rows.setdefault(name, []).append(loop.run_until_complete(variants[name]()))
    result.rows = {
        **{k: v for k, v in result.rows.items() if k not in variants},
        **{name: result.rows[name] for name in variants},
    }


def show(value: float, unit: str) -> str:
    """One figure, formatted for its unit (``n/a`` for NaN)."""
    if value != value:  # NaN
        return "n/a"
    if unit == "us":
        return f"{value * 1e6:10.3f} us"
    if unit == "B":
        return f"{value:10.0f} B"
    if unit == "turns/s":
        return f"{value:10.0f} turns/s"
    return f"{value:10.4g} {unit}"


def print_result(result: Result) -> None:
    """Prints one workload's table: medians, ratios, targets, checks, notes, error."""
    print(f"\n== {result.name}: {result.title}")
    width = max((len(k) for k in result.rows), default=8)
    for variant, samples in result.rows.items():
        spread = ""
        if len(samples) > 1:
            spread = f"   (min {show(min(samples), result.unit).strip()}, n={len(samples)})"
        print(f"  {variant:<{width}}  {show(median(samples), result.unit)}{spread}")
    for label, value in result.ratios.items():
        print(f"  {label:<{width + 14}} {value:8.3f}x")
    for t in result.targets:
        rel = ">=" if t["at_least"] else "<="
        mark = "MET " if t["met"] else "MISS"
        print(f"  [{mark}] {t['target']}: {t['value']:.3f} ({rel} {t['limit']})")
    for c in result.checks:
        mark = "PASS" if c["ok"] else "FAIL"
        print(f"  [{mark}] check: {c['check']}" + (f" ({c['detail']})" if c["detail"] else ""))
    for note in result.notes:
        print(f"  note: {note}")
    if result.error is not None:
        print(f"  ERROR: {result.error}")
