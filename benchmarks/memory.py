"""Workload ``memory``: bytes per queued waiter beyond a bare suspended task.

A fresh child process per sample parks N waiters (ceiling 1, held) and reports the growth of
its RSS per waiter (``/proc/self/statm``), after warm-up and ``gc.collect()``; the same again
with ``tracemalloc``, which sees Python allocations only (admitgate's Rust-side records are
invisible to it). Kinds: ``task`` (a task parked on a bare future), ``semaphore``,
``admitgate`` and ``reference``; every gate must report exactly the waiters parked on it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from typing import Any

import admitgate

from .child import run_child
from .harness import Result, median, rotations
from .subjects import arrival, build, park, reference


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux: peak RSS, which only grows here
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def memory_child(kind: str, n: int, mode: str) -> dict[str, Any]:
    """The child's side: bytes per waiter of ``kind``, and (for gates) the waiters queued."""
    import tracemalloc

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def never_waiter(fut: asyncio.Future[None]) -> None:
        await fut

    async def sem_waiter(sem: asyncio.Semaphore) -> None:
        async with sem:
            pass

    async def run() -> dict[str, Any]:
        never: asyncio.Future[None] = loop.create_future()
        rejected: tuple[type[BaseException], ...] = (admitgate.AdmissionRejected,)
        gate: Any = None
        if kind == "task":

            def make() -> Any:
                return never_waiter(never)

        elif kind == "semaphore":
            sem = asyncio.Semaphore(1)
            await sem.acquire()

            def make() -> Any:
                return sem_waiter(sem)

        else:
            if kind == "admitgate":
                gate = build(max_concurrent_runs=1, queue_depth=n + 1_000, overflow_policy="queue")
            else:
                ref = reference()
                if ref is None:
                    raise RuntimeError("the reference is not installed")
                gate = ref.build_admission_gate(
                    max_concurrent_runs=1, queue_depth=n + 1_000, overflow_policy="queue"
                )
                rejected = (ref.AdmissionRejected,)
            loop.create_task(park(gate.admit, never))
            await asyncio.sleep(0)

            def make() -> Any:
                return arrival(gate.admit, rejected)

        # Warm up: lazy imports, interned strings, free lists, the first slab chunk.
        warm = [loop.create_task(make()) for _ in range(200)]
        for _ in range(10):
            await asyncio.sleep(0)
        tasks: list[Any] = [None] * n  # allocated before the baseline
        gc.collect()
        if mode == "tracemalloc":
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
        else:
            base = _rss_bytes()
        for i in range(n):
            tasks[i] = loop.create_task(make())
        for _ in range(10):
            await asyncio.sleep(0)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else _rss_bytes()
        answer: dict[str, Any] = {"bytes": (after - base) / n}
        if gate is not None:
            answer["queued"] = gate.queued
            answer["expected"] = n + len(warm)
        return answer

    return loop.run_until_complete(run())


def bench_memory(size: dict[str, Any]) -> Result:
    """Bytes per queued waiter, each sample in a fresh child process."""
    n = size["memory_n"]
    result = Result(
        "memory",
        f"bytes per queued waiter, {n} waiters in a fresh child process (RSS growth; "
        "tracemalloc shown separately)",
        "B",
    )
    kinds = ["task", "semaphore", "admitgate"]
    if reference() is not None:
        kinds.append("reference")
    modes = size["memory_modes"]
    raw: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    miscounted: dict[str, list[str]] = {}
    for mode in modes:
        for order in rotations(kinds, size["memory_reps"]):
            for kind in order:
                answer = run_child(["memory", kind, str(n), mode], block_praisonai=False)
                raw[mode].setdefault(kind, []).append(answer["bytes"])
                if "queued" in answer:
                    queued, expected = answer["queued"], answer["expected"]
                    miscounted.setdefault(kind, [])
                    if queued != expected:
                        miscounted[kind].append(f"{queued} queued, expected {expected} ({mode})")
    for kind, wrong in miscounted.items():
        result.check(
            f"{kind}: every waiter parked is queued",
            not wrong,
            "; ".join(wrong) or "in every sample",
        )
    for mode in modes:
        task = median(raw[mode]["task"])
        for kind in kinds:
            label = f"{kind} ({mode})" if kind == "task" else f"{kind} beyond task ({mode})"
            values = raw[mode][kind]
            result.rows[label] = values if kind == "task" else [v - task for v in values]
    if "reference" in kinds:
        result.ratio(
            "admitgate/reference beyond task (rss)",
            "admitgate beyond task (rss)",
            "reference beyond task (rss)",
        )
        result.ratio(
            "admitgate/reference beyond task (tracemalloc)",
            "admitgate beyond task (tracemalloc)",
            "reference beyond task (tracemalloc)",
        )
        result.target(
            "admitgate/reference memory beyond the task (rss)",
            result.ratios["admitgate/reference beyond task (rss)"],
            0.25,
        )
    result.notes.append(
        "tracemalloc sees Python allocations only; admitgate's Rust slab records and wakers "
        "are in the RSS figure"
    )
    return result
