"""Workload ``threads``: several threads, each with its own event loop, share one gate.

4 threads x own loop x 50 tasks x 400 turns (body ``await asyncio.sleep(0)``) against one
thread running the same per-thread load: total turns per second, with free slots (ceiling
100,000: only the lock is shared) and at a contended ceiling of 32, next to the same load with
no gate. Afterwards every gate's counters must be exact and its peak within its ceiling. The
reference cannot take part: its semaphore binds to one event loop.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import Any

from .harness import Result, Timed, check_counters, rotations
from .subjects import build


def _run(gate: Any, threads: int, tasks: int, turns: int) -> tuple[float, int]:
    """Wall time for `threads` threads, each running its own loop of `tasks` x `turns`."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    async def worker() -> None:
        sleep = asyncio.sleep
        if gate is None:
            for _ in range(turns):
                await sleep(0)
        else:
            admit = gate.admit
            for _ in range(turns):
                async with admit(session_id="s"):
                    await sleep(0)

    async def main() -> None:
        await asyncio.gather(*[worker() for _ in range(tasks)])

    def thread_main() -> None:
        loop = asyncio.new_event_loop()
        try:
            barrier.wait()
            loop.run_until_complete(main())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            loop.close()

    pool = [threading.Thread(target=thread_main) for _ in range(threads)]
    for th in pool:
        th.start()
    with Timed() as t:
        barrier.wait()
        for th in pool:
            th.join()
    if errors:
        raise errors[0]
    return t.elapsed, threads * tasks * turns


def bench_threads(size: dict[str, Any]) -> Result:
    """Turns per second with N threads sharing one gate, against one thread."""
    nthreads, tasks, turns = size["threads"]
    result = Result(
        "threads",
        f"{nthreads} threads x own event loop x {tasks} tasks x {turns} turns (body sleep(0)) "
        "sharing one gate, vs 1 thread alone; total turns/s",
        "turns/s",
    )
    configs = {"free slots": 100_000, "ceiling 32": 32}
    gates = {
        name: build(max_concurrent_runs=ceiling, queue_depth=100_000, overflow_policy="queue")
        for name, ceiling in configs.items()
    }
    expected = {name: 0 for name in configs}
    variants: dict[str, Callable[[], tuple[float, int]]] = {}
    for name, gate in gates.items():
        variants[f"admitgate {name}, 1 thread"] = functools.partial(_run, gate, 1, tasks, turns)
        variants[f"admitgate {name}, {nthreads} threads"] = functools.partial(
            _run, gate, nthreads, tasks, turns
        )
    variants["floor (no gate), 1 thread"] = lambda: _run(None, 1, tasks, turns)
    variants[f"floor (no gate), {nthreads} threads"] = lambda: _run(None, nthreads, tasks, turns)
    for order in rotations(list(variants), size["threads_reps"]):
        for label in order:
            elapsed, turns_done = variants[label]()
            result.rows.setdefault(label, []).append(turns_done / elapsed)
            for name in configs:
                if label.startswith(f"admitgate {name},"):
                    expected[name] += turns_done
    result.rows = {label: result.rows[label] for label in variants}
    exact = True
    for name, gate in gates.items():
        check_counters(result, f"admitgate {name}", gate.stats(), expected[name])
        exact = exact and result.checks[-1]["ok"]
        peak, ceiling = gate.peak_in_flight, configs[name]
        result.check(
            f"admitgate {name}: peak in flight within the ceiling",
            peak <= ceiling,
            f"peak {peak}, ceiling {ceiling}",
        )
        ratio = result.ratio(
            f"admitgate {name}: {nthreads} threads/1 thread",
            f"admitgate {name}, {nthreads} threads",
            f"admitgate {name}, 1 thread",
        )
        result.target(f"{nthreads}T/1T turns/s ({name})", ratio, 0.8, at_least=True)
    result.ratio(
        f"floor: {nthreads} threads/1 thread",
        f"floor (no gate), {nthreads} threads",
        "floor (no gate), 1 thread",
    )
    result.extra["counters_exact"] = exact
    result.notes.append(
        "the reference cannot be shared across event loops (its semaphore binds to one)"
    )
    return result
