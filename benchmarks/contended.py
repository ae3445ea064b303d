"""Workload ``contended``: many tasks, few slots, every turn queues.

``tasks`` tasks x ``turns`` turns each, body ``await asyncio.sleep(0)``, ceiling ``ceiling``,
``overflow_policy="queue"`` (full size: 2,000 x 20, ceiling 32); time per turn against the
reference, ``asyncio.Semaphore`` and the same tasks with no gate. Afterwards admitgate's
counters must be exact and its peak in flight within the ceiling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from .harness import Result, Timed, check_counters, interleave
from .subjects import build, reference


async def _run(enter: Callable[[], Any] | None, tasks: int, turns: int) -> float:
    sleep = asyncio.sleep

    if enter is None:

        async def worker() -> None:
            for _ in range(turns):
                await sleep(0)

    else:

        async def worker() -> None:
            for _ in range(turns):
                async with enter():
                    await sleep(0)

    with Timed() as t:
        await asyncio.gather(*[worker() for _ in range(tasks)])
    return t.elapsed / (tasks * turns)


def bench_contended(size: dict[str, Any]) -> Result:
    """Contended turns at a small ceiling, overflow ``queue``."""
    tasks, turns, ceiling = size["contended"]
    result = Result(
        "contended",
        f"{tasks} tasks x {turns} turns, body await asyncio.sleep(0), ceiling {ceiling}, "
        "overflow queue; time per turn",
        "us",
    )
    gate = build(max_concurrent_runs=ceiling, queue_depth=tasks, overflow_policy="queue")
    sem = asyncio.Semaphore(ceiling)
    variants: dict[str, Callable[[], Awaitable[float]]] = {
        "admitgate": lambda: _run(lambda: gate.admit(session_id="s"), tasks, turns),
    }
    ref = reference()
    if ref is not None:
        rgate = ref.build_admission_gate(
            max_concurrent_runs=ceiling, queue_depth=tasks, overflow_policy="queue"
        )
        variants["reference"] = lambda: _run(lambda: rgate.admit(session_id="s"), tasks, turns)
    variants["semaphore"] = lambda: _run(lambda: sem, tasks, turns)
    variants["floor (no gate)"] = lambda: _run(None, tasks, turns)
    loop = asyncio.new_event_loop()
    try:
        interleave(loop, variants, size["contended_reps"], result)
    finally:
        loop.close()
    check_counters(result, "admitgate", gate.stats(), (size["contended_reps"] + 1) * tasks * turns)
    result.extra["admitgate_counters_exact"] = result.checks[-1]["ok"]
    peak = gate.peak_in_flight
    result.extra["admitgate_peak_in_flight"] = peak
    result.check(
        "admitgate peak in flight within the ceiling",
        peak <= ceiling,
        f"peak {peak}, ceiling {ceiling}",
    )
    result.ratio("admitgate/semaphore", "admitgate", "semaphore")
    if "reference" in result.rows:
        result.ratio("reference/semaphore", "reference", "semaphore")
        result.ratio("admitgate/reference", "admitgate", "reference")
    result.ratio("admitgate/floor", "admitgate", "floor (no gate)")
    result.target("admitgate/semaphore", result.ratios["admitgate/semaphore"], 1.1)
    return result
