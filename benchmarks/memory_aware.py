"""Workload ``memory-aware``: the cost of memory-aware admission when it never triggers.

Uncontended turns with ``resource_policy=build_memory_pressure_policy(max_rss_mb=1e9)``
(built-in sampler) against the same gate without it, for admitgate and the reference.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import admitgate

from .harness import Result, check_counters, interleave
from .subjects import build, reference
from .uncontended import gate_turns


def bench_memory_aware(size: dict[str, Any]) -> Result:
    """Uncontended turns with memory-aware admission on against off."""
    n, reps = size["uncontended_n"], size["reps"]
    result = Result(
        "memory-aware",
        "uncontended turns, memory-aware admission on (max_rss_mb=1e9, built-in sampler) vs "
        "off; per turn",
        "us",
    )
    off = build(max_concurrent_runs=32, queue_depth=128)
    on = build(
        max_concurrent_runs=32,
        queue_depth=128,
        resource_policy=admitgate.build_memory_pressure_policy(max_rss_mb=1e9),
    )
    variants: dict[str, Callable[[], Awaitable[float]]] = {
        "admitgate on": lambda: gate_turns(on, n),
        "admitgate off": lambda: gate_turns(off, n),
    }
    ref = reference()
    if ref is not None:
        ron = ref.build_admission_gate(
            max_concurrent_runs=32,
            queue_depth=128,
            resource_policy=ref.build_memory_pressure_policy(max_rss_mb=1e9),
        )
        roff = ref.build_admission_gate(max_concurrent_runs=32, queue_depth=128)
        variants["reference on"] = lambda: gate_turns(ron, n)
        variants["reference off"] = lambda: gate_turns(roff, n)
    loop = asyncio.new_event_loop()
    try:
        interleave(loop, variants, reps, result)
    finally:
        loop.close()
    check_counters(result, "admitgate on", on.stats(), (reps + 1) * n)
    check_counters(result, "admitgate off", off.stats(), (reps + 1) * n)
    result.ratio("admitgate on/off", "admitgate on", "admitgate off")
    if ref is not None:
        result.ratio("reference on/off", "reference on", "reference off")
        result.ratio("admitgate on/reference on", "admitgate on", "reference on")
    result.target("admitgate on/off", result.ratios["admitgate on/off"], 1.25)
    return result
