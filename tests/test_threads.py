"""One gate shared by several threads, each running its own event loop.

The ceiling holds across threads (concurrency is measured inside the bodies under a lock),
the counters stay exact, a slot freed on one loop wakes a waiter parked on another loop (on
that loop's own thread), and a human-approval wait entered from a worker thread lends the
slot and takes it back.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter

import admitgate
import pytest
from praisonaiagents.approval import registry

HUMAN_WAIT_SCOPE = registry.HUMAN_WAIT_SCOPE

THREADS = 4


def run_threads(target, n=THREADS, timeout=30.0):
    """Runs ``target(i)`` in ``n`` threads; re-raises the first failure; fails on a hang."""
    errors: list[BaseException] = []

    def wrap(i):
        try:
            target(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread is stuck: the gate wedged"
    if errors:
        raise errors[0]


class Meter:
    """Concurrency measured inside bodies, across threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.scope_now: Counter = Counter()
        self.scope_peak = 0

    def enter(self, scope):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            if scope:
                self.scope_now[scope] += 1
                self.scope_peak = max(self.scope_peak, self.scope_now[scope])

    def leave(self, scope):
        with self.lock:
            self.now -= 1
            if scope:
                self.scope_now[scope] -= 1


@pytest.mark.parametrize("overflow", ["reject", "queue", "shed_oldest"])
@pytest.mark.parametrize("per_scope", [0, 2])
def test_four_loops_share_one_gate(overflow, per_scope):
    ceiling = 3
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=ceiling,
        queue_depth=4,
        overflow_policy=overflow,
        max_concurrent_runs_per_scope=per_scope,
    )
    meter = Meter()
    seen = [Counter() for _ in range(THREADS)]

    def thread(i):
        rng = random.Random(i)

        async def turn(session):
            seen[i]["reached"] += 1
            try:
                async with gate.admit(session_id=session):
                    seen[i]["entered"] += 1
                    scope = session if per_scope else ""
                    meter.enter(scope)
                    try:
                        for _ in range(rng.randrange(1, 4)):
                            await asyncio.sleep(0)
                        # Let the other threads run while this one holds a slot.
                        time.sleep(0.0002 if rng.random() < 0.1 else 0)
                    finally:
                        meter.leave(scope)
            except admitgate.AdmissionRejected as exc:
                seen[i]["shed_seen" if exc.reason == "shed" else "rejected_seen"] += 1

        async def worker():
            for _ in range(60):
                session = rng.choice(["", "a", "a", "b", "c"])
                if rng.random() < 0.1:
                    task = asyncio.ensure_future(turn(session))
                    await asyncio.sleep(0)
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                else:
                    await turn(session)

        async def main():
            await asyncio.gather(*(worker() for _ in range(8)))

        asyncio.run(main())

    run_threads(thread)
    total = sum(seen, Counter())
    assert meter.peak <= ceiling, f"{meter.peak} bodies ran at once, ceiling {ceiling}"
    assert gate.peak_in_flight <= ceiling
    if per_scope:
        assert meter.scope_peak <= per_scope
    assert (gate.in_flight, gate.queued, gate.awaiting_human) == (0, 0, 0)
    assert gate.admitted == total["entered"]
    assert gate.rejected == total["rejected_seen"]
    assert total["shed_seen"] <= gate.shed
    assert gate.admitted + gate.rejected + gate.shed + gate.cancelled == total["reached"]
    assert gate.admitted > 0
    if overflow == "reject":
        assert gate.shed == 0
    if overflow == "queue":
        assert gate.rejected == 0 and gate.shed == 0


def test_release_on_one_loop_wakes_a_waiter_idle_on_another():
    """Loop B sits idle in select() with one waiter; a release on loop A must wake it, and
    the waiter must resume on B's own thread."""
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=1)
    holding = threading.Event()
    b_waiting = threading.Event()
    release = threading.Event()
    record = {}

    def loop_a(_):
        async def main():
            async with gate.admit(session_id="a"):
                holding.set()
                # Block this loop's thread until B waits, then release from here.
                assert await asyncio.to_thread(release.wait, 10)

        asyncio.run(main())

    def loop_b(_):
        assert holding.wait(10)

        async def main():
            admission = gate.admit(session_id="b")
            loop = asyncio.get_running_loop()
            loop.call_soon(b_waiting.set)
            started = time.monotonic()
            async with admission:
                record["thread"] = threading.get_ident()
                record["loop"] = asyncio.get_running_loop()
                record["waited"] = time.monotonic() - started
            record["expected_thread"] = threading.get_ident()
            record["expected_loop"] = loop

        asyncio.run(main())

    threads = [
        threading.Thread(target=loop_a, args=(0,), daemon=True),
        threading.Thread(target=loop_b, args=(1,), daemon=True),
    ]
    for t in threads:
        t.start()
    assert b_waiting.wait(10)
    deadline = time.monotonic() + 5
    while gate.queued != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert gate.queued == 1 and gate.in_flight == 1
    time.sleep(0.05)  # B is now idle, blocked in its selector
    release.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "the waiter on loop B was never woken"
    assert record["thread"] == record["expected_thread"]
    assert record["loop"] is record["expected_loop"]
    assert record["waited"] < 5
    assert (gate.in_flight, gate.queued, gate.admitted, gate.cancelled) == (0, 0, 2, 0)


def _blocking_human_wait(factory, entered: threading.Event, resume: threading.Event):
    with factory():
        entered.set()
        assert resume.wait(10)


@pytest.mark.parametrize("how", ["run_in_executor", "to_thread_registry"])
def test_human_wait_in_a_worker_thread_lends_and_takes_back_the_slot(how):
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=4)
    entered, resume = threading.Event(), threading.Event()
    order = []

    async def main():
        y_running = asyncio.Event()
        y_finish = asyncio.Event()
        x_finish = asyncio.Event()
        x_park = asyncio.Event()

        async def human_turn():
            async with gate.admit(session_id="x"):
                order.append("x")
                await x_park.wait()
                if how == "run_in_executor":
                    factory = HUMAN_WAIT_SCOPE.get()
                    assert factory is not None
                    loop = asyncio.get_running_loop()
                    await loop.run_in_executor(None, _blocking_human_wait, factory, entered, resume)
                else:
                    # asyncio.to_thread copies the context, as PraisonAI's registry expects.
                    def via_registry():
                        with registry._human_wait_scope():
                            entered.set()
                            assert resume.wait(10)

                    await asyncio.to_thread(via_registry)
                await x_finish.wait()

        async def plain_turn(name, running=None, finish=None):
            async with gate.admit(session_id=name):
                order.append(name)
                if running:
                    running.set()
                if finish:
                    await finish.wait()

        x = asyncio.ensure_future(human_turn())
        await asyncio.sleep(0.01)
        y = asyncio.ensure_future(plain_turn("y", y_running, y_finish))
        await asyncio.sleep(0.01)
        assert order == ["x"] and gate.queued == 1
        x_park.set()
        assert await asyncio.to_thread(entered.wait, 10)
        # The slot was lent: y runs while x waits on a person.
        await asyncio.wait_for(y_running.wait(), 5)
        assert (gate.in_flight, gate.awaiting_human, gate.queued) == (1, 1, 0)
        # The person answers while y still runs: x takes its slot back beyond the ceiling.
        resume.set()
        deadline = time.monotonic() + 5
        while gate.awaiting_human and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        assert (gate.in_flight, gate.awaiting_human) == (2, 0)
        z = asyncio.ensure_future(plain_turn("z"))
        await asyncio.sleep(0.01)
        assert gate.queued == 1
        # y's release repays the borrow: z must not start yet.
        y_finish.set()
        await y
        await asyncio.sleep(0.01)
        assert (gate.in_flight, gate.queued) == (1, 1) and "z" not in order
        x_finish.set()
        await x
        await asyncio.wait_for(z, 5)
        assert order == ["x", "y", "z"]
        assert gate.peak_in_flight == 2

    asyncio.run(main())
    assert (gate.in_flight, gate.queued, gate.awaiting_human) == (0, 0, 0)
    assert (gate.admitted, gate.rejected, gate.shed, gate.cancelled) == (3, 0, 0, 0)


def test_human_waits_from_many_threads_drain_to_zero():
    """Turns on four loops park on 'humans' in worker threads while others come and go."""
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=2, queue_depth=2, overflow_policy="queue"
    )
    reached = Counter()
    lock = threading.Lock()

    def thread(i):
        rng = random.Random(100 + i)

        async def turn():
            with lock:
                reached["n"] += 1
            async with gate.admit(session_id=f"s{i}"):
                if rng.random() < 0.3:
                    factory = HUMAN_WAIT_SCOPE.get()
                    pause = rng.random() * 0.002

                    def person():
                        with factory():
                            time.sleep(pause)

                    await asyncio.get_running_loop().run_in_executor(None, person)
                await asyncio.sleep(0)

        async def main():
            await asyncio.gather(*(turn() for _ in range(40)))

        asyncio.run(main())

    run_threads(thread)
    assert (gate.in_flight, gate.queued, gate.awaiting_human) == (0, 0, 0)
    assert gate.admitted == reached["n"] == 4 * 40
    assert gate.rejected == gate.shed == gate.cancelled == 0
