"""Workload ``priorities-cost``: what a turn costs on a gate with priority classes, beside the
same gate without them (issue 23's bar: at most +0.5 us per turn).

Uncontended turns (a free slot, an empty body), interleaved in one process: a gate without
classes; a gate with two classes (`interactive` `min_share=0.5`, `batch`, fair queuing on)
whose turns name their class; the same whose turns name none (the default class); and the
classed gate's turns through `priority=` read from an ASGI scope's header, as the HTTP middleware
reads it (the door's lookup included, the rest of the middleware not).
"""

from __future__ import annotations

import asyncio
from typing import Any

import admitgate
from admitgate._priority_door import PriorityDoor

from .harness import Result, Timed, check_counters, interleave
from .subjects import build

CLASSES = [admitgate.PriorityClass("interactive", min_share=0.5), admitgate.PriorityClass("batch")]


async def _turns(gate: Any, n: int, priority: str | None) -> float:
    admit = gate.admit
    with Timed() as t:
        for _ in range(n):
            async with admit(session_id="user-1", priority=priority):
                pass
    return t.elapsed / n


async def _door_turns(gate: Any, door: PriorityDoor, n: int) -> float:
    scope = {"headers": [(b"host", b"agent"), (b"x-priority", b"interactive")]}
    admit = gate.admit
    with Timed() as t:
        for _ in range(n):
            async with admit(session_id="user-1", priority=door.from_scope(scope)):
                pass
    return t.elapsed / n


def bench_priorities_cost(size: dict[str, Any]) -> Result:
    """Per-turn cost with and without classes, interleaved."""
    result = Result(
        "priorities-cost",
        "async with gate.admit() with a free slot, empty body, per turn: no classes vs two",
        "us",
    )
    n, reps = size["uncontended_n"], size["reps"]
    plain = build(max_concurrent_runs=32, queue_depth=128)
    classed = build(max_concurrent_runs=32, queue_depth=128, priorities=CLASSES)
    named = build(max_concurrent_runs=32, queue_depth=128, priorities=CLASSES)
    via_door = build(max_concurrent_runs=32, queue_depth=128, priorities=CLASSES)
    door = PriorityDoor(via_door, "header:x-priority")
    variants = {
        "no classes": lambda: _turns(plain, n, None),
        "classes, default class": lambda: _turns(classed, n, None),
        "classes, priority=": lambda: _turns(named, n, "interactive"),
        "classes, priority from a header": lambda: _door_turns(via_door, door, n),
    }
    loop = asyncio.new_event_loop()
    try:
        interleave(loop, variants, reps, result)
    finally:
        loop.close()
    for label, gate in (
        ("no classes", plain),
        ("classes, default class", classed),
        ("classes, priority=", named),
        ("classes, priority from a header", via_door),
    ):
        check_counters(result, label, gate.stats(), (reps + 1) * n)
    base = result.median("no classes")
    extra: dict[str, float] = {}
    for label in (
        "classes, default class",
        "classes, priority=",
        "classes, priority from a header",
    ):
        extra[label] = (result.median(label) - base) * 1e6
        result.notes.append(f"{label}: {extra[label]:+.3f} us per turn over no classes")
    result.target("classes, priority=: extra us per turn", extra["classes, priority="], 0.5)
    return result
