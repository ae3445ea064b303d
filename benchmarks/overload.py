"""Workload ``overload``: sustained overload under ``shed_oldest``.

Ceiling 1 (held), a full queue of 1k / 10k / 100k waiters, and every arrival evicts the
oldest waiter. Reported: the cost per arrival above the floor (the same arrivals as tasks
that are rejected at once), per depth, for admitgate, the reference and a pure-Python O(1)
FIFO (what waking a long-parked task costs whatever the gate). Every batch must shed exactly
one waiter per arrival and leave the queue full; otherwise the workload stops with
:class:`~benchmarks.harness.CheckFailed` (carrying on would wait for waiters never evicted).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import sys
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import admitgate

from .harness import CheckFailed, Result, Timed, interleave, median, ratio
from .subjects import arrival, build, park, reference

# Arrivals per event-loop iteration: traffic arrives in bursts, and one loop iteration (an
# epoll_wait call) per arrival would drown the gate in loop overhead.
BURST = 50
FIFO = "python O(1) FIFO"


async def _rejected_at_once(rejected: type[BaseException]) -> None:
    try:
        raise rejected()
    except rejected:
        pass


class FifoShedGate:
    """Informative baseline: the least a ``shed_oldest`` FIFO can do in Python.

    One future per waiter in a deque; evicting the oldest is ``popleft`` + ``set_exception``
    (O(1)). Its cost per arrival shows what waking a long-parked (cache-cold) task costs,
    whatever the gate.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.held = False
        self.shed = 0

    @property
    def queued(self) -> int:
        """Waiters in the queue."""
        return len(self.waiters)

    def admit(self, session_id: str = "") -> _FifoShedAdmission:
        """One turn's async context manager."""
        return _FifoShedAdmission(self)


class _FifoShedAdmission:
    __slots__ = ("gate",)

    def __init__(self, gate: FifoShedGate) -> None:
        self.gate = gate

    async def __aenter__(self) -> None:
        gate = self.gate
        if not gate.held:
            gate.held = True
            return
        if len(gate.waiters) >= gate.depth:
            gate.waiters.popleft().set_exception(admitgate.AdmissionRejected())
            gate.shed += 1
        fut = asyncio.get_running_loop().create_future()
        gate.waiters.append(fut)
        await fut

    async def __aexit__(self, *exc: object) -> None:
        gate = self.gate
        if gate.waiters:
            gate.waiters.popleft().set_result(None)
        else:
            gate.held = False


class _Overloaded:
    """A gate at ceiling 1 (held) with a full queue of `depth` waiters, oldest first."""

    def __init__(self, gate: Any, depth: int, rejected: tuple[type[BaseException], ...]) -> None:
        self.gate = gate
        self.depth = depth
        self.rejected = rejected
        self.waiters: deque[asyncio.Task[None]] = deque()
        self.holder: asyncio.Task[None] | None = None
        self.release: asyncio.Future[None] | None = None

    async def fill(self) -> None:
        loop = asyncio.get_running_loop()
        self.release = loop.create_future()
        self.holder = loop.create_task(park(self.gate.admit, self.release))
        await asyncio.sleep(0)
        chunk = 2_000
        while len(self.waiters) < self.depth:
            for _ in range(min(chunk, self.depth - len(self.waiters))):
                self.waiters.append(loop.create_task(arrival(self.gate.admit, self.rejected)))
            await asyncio.sleep(0)
        while self.gate.queued < self.depth:
            await asyncio.sleep(0)
        for _ in range(5):  # let the reference's helper tasks start
            await asyncio.sleep(0)

    async def batch(self, m: int) -> float:
        loop = asyncio.get_running_loop()
        sleep = asyncio.sleep
        admit = self.gate.admit
        rejected = self.rejected
        shed0 = self.gate.shed
        waiters = self.waiters
        with Timed() as t:
            for i in range(m):
                waiters.append(loop.create_task(arrival(admit, rejected)))
                if i % BURST == BURST - 1:
                    await sleep(0)
            victims = [waiters.popleft() for _ in range(m)]
            await asyncio.wait(victims)
        if self.gate.shed - shed0 != m or self.gate.queued != self.depth:
            raise CheckFailed(
                f"overload bookkeeping off: shed {self.gate.shed - shed0} of {m}, "
                f"queued {self.gate.queued} of {self.depth}"
            )
        return t.elapsed / m

    async def drain(self) -> None:
        for task in self.waiters:
            task.cancel()
        await asyncio.gather(*self.waiters, return_exceptions=True)
        self.waiters.clear()
        if self.release is not None and not self.release.done():
            self.release.set_result(None)
        if self.holder is not None:
            await self.holder


async def _floor_batch(m: int) -> float:
    loop = asyncio.get_running_loop()
    sleep = asyncio.sleep
    rejected = admitgate.AdmissionRejected
    tasks = []
    with Timed() as t:
        for i in range(m):
            tasks.append(loop.create_task(_rejected_at_once(rejected)))
            if i % BURST == BURST - 1:
                await sleep(0)
        await asyncio.wait(tasks)
    return t.elapsed / m


def _check_final(result: Result, depth: int, stats: dict[str, Any], arrivals: int) -> None:
    """admitgate's counters once drained: the holder admitted, one shed per arrival, the rest
    of the queue cancelled, nothing held."""
    expected = {
        "admitted": 1,
        "shed": arrivals,
        "cancelled": depth,
        "rejected": 0,
        "in_flight": 0,
        "queued": 0,
    }
    wrong = [f"{k} {stats[k]}, expected {v}" for k, v in expected.items() if stats[k] != v]
    result.check(
        f"admitgate @{depth} counters exact after the drain",
        not wrong,
        "; ".join(wrong) or ", ".join(f"{k} {v}" for k, v in expected.items()),
    )


def bench_overload(size: dict[str, Any]) -> Result:
    """Cost per arrival under sustained ``shed_oldest`` overload, per queue depth."""
    result = Result(
        "overload",
        "sustained overload, shed_oldest, ceiling 1 (held), full queue; every arrival evicts "
        "the oldest waiter; time per arrival",
        "us",
    )
    ref = reference()
    m = size["overload_m"]
    above: dict[str, dict[int, float]] = {"admitgate": {}, "reference": {}, FIFO: {}}
    for depth in size["overload_depths"]:
        loop = asyncio.new_event_loop()
        gates: dict[str, tuple[_Overloaded, int]] = {
            f"admitgate @{depth}": (
                _Overloaded(
                    build(max_concurrent_runs=1, queue_depth=depth, overflow_policy="shed_oldest"),
                    depth,
                    (admitgate.AdmissionRejected,),
                ),
                m,
            )
        }
        if ref is not None:
            gates[f"reference @{depth}"] = (
                _Overloaded(
                    ref.build_admission_gate(
                        max_concurrent_runs=1, queue_depth=depth, overflow_policy="shed_oldest"
                    ),
                    depth,
                    (ref.AdmissionRejected,),
                ),
                size["overload_m_ref"][depth],
            )
        variants: dict[str, Callable[[], Awaitable[float]]] = {}
        gates[f"{FIFO} @{depth}"] = (
            _Overloaded(FifoShedGate(depth), depth, (admitgate.AdmissionRejected,)),
            m,
        )
        try:
            for state, _ in gates.values():
                loop.run_until_complete(state.fill())
            gc.collect()
            gc.freeze()  # the waiters are long-lived: keep them out of the collections
            variants = {name: functools.partial(st.batch, k) for name, (st, k) in gates.items()}
            variants[f"floor @{depth}"] = lambda: _floor_batch(m)
            interleave(loop, variants, size["overload_reps"], result, warmup=False)
        finally:
            # admitgate's waiters are cancelled (O(1) each). The reference's are abandoned
            # with their loop and collected silently: cancelling them is quadratic (each
            # cancelled Semaphore.acquire removes itself from the semaphore's deque).
            state = gates[f"admitgate @{depth}"][0]
            loop.run_until_complete(state.drain())
            final = state.gate.stats()
            loop.set_exception_handler(lambda _loop, _context: None)
            del gates, variants, state
            loop.close()
            del loop
            gc.unfreeze()
            hook = sys.unraisablehook
            sys.unraisablehook = lambda _unraisable: None
            try:
                gc.collect()
            finally:
                sys.unraisablehook = hook
        _check_final(result, depth, final, size["overload_reps"] * m)
        # Paired: each repetition's arrival cost minus the floor measured in the same round.
        floors = result.rows[f"floor @{depth}"]
        for who in above:
            key = f"{who} @{depth}"
            if key in result.rows:
                above[who][depth] = median(
                    [g - f for g, f in zip(result.rows[key], floors, strict=True)]
                )
    depths = size["overload_depths"]
    for who, by_depth in above.items():
        for depth, value in by_depth.items():
            result.extra[f"{who} above floor @{depth} (s)"] = value
    ours_above = above["admitgate"]
    spread = max(ours_above.values()) / min(ours_above.values())
    result.ratios[f"admitgate above-floor max/min over depths {list(depths)}"] = spread
    # O(1) eviction means no growth with the depth: the deepest queue against the shallowest.
    growth = ratio(ours_above[depths[-1]], ours_above[depths[0]])
    result.ratios[f"admitgate above-floor @{depths[-1]} / @{depths[0]}"] = growth
    mid = 10_000 if 10_000 in ours_above else depths[-1]
    if mid in above["reference"]:
        result.ratios[f"reference/admitgate above floor @{mid}"] = ratio(
            above["reference"][mid], ours_above[mid]
        )
    for depth in depths:
        line = f"above floor @{depth}: admitgate {ours_above[depth] * 1e6:.3f} us"
        if depth in above["reference"]:
            line += f", reference {above['reference'][depth] * 1e6:.3f} us"
        line += f", {FIFO} {above[FIFO][depth] * 1e6:.3f} us"
        result.notes.append(line)
    result.target(f"admitgate above-floor growth @{depths[-1]} / @{depths[0]}", growth, 1.5)
    if mid in above["reference"]:
        result.target(
            f"reference/admitgate above floor @{mid}",
            result.ratios[f"reference/admitgate above floor @{mid}"],
            5.0,
            at_least=True,
        )
    return result
