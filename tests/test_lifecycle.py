"""A gate's life beyond steady traffic: memory pressure easing with nobody arriving,
reconfiguring across a ceiling of 0, forking at every stage, draining with a fleet limit, a
queue of 100k with ``on_queued``, and the interpreter exiting with turns in flight.

Every test checks that the counters add up: each arrival is counted exactly once as admitted,
rejected, shed or cancelled, and nothing is left in flight or queued at the end.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from typing import Any

import admitgate
import pytest
from conftest import FakeSampler, in_forked_child, run, settle

WRAPPED = 2**63  # a count at or past this has wrapped below zero


def settled(gate: Any, arrivals: int) -> None:
    """Every arrival counted once, as its caller saw it; nothing held or waiting."""
    s = gate.stats()
    assert s["admitted"] + s["rejected"] + s["shed"] + s["cancelled"] == arrivals, s
    assert (s["in_flight"], s["queued"], s["awaiting_human"]) == (0, 0, 0), s
    for name, t in gate.transport_stats().items():
        assert (t["in_flight"], t["queued"]) == (0, 0), (name, t)


class Meter:
    """Counts bodies running at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.entered = 0

    def enter(self) -> None:
        self.now += 1
        self.entered += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1


async def held_turn(gate: Any, meter: Meter, leave: asyncio.Event, **admit: Any) -> None:
    async with gate.admit(**admit):
        meter.enter()
        try:
            await leave.wait()
        finally:
            meter.leave()


async def eventually(predicate: Any, what: str, timeout: float = 2.0) -> float:
    """Waits (yielding to the loop, never arriving at the gate) until predicate() holds;
    returns how long it took."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            pytest.fail(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - started


# -- memory pressure easing ------------------------------------------------------------------


def pressure_gate(sampler: FakeSampler, **limits: Any) -> Any:
    return admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(
            **{"max_concurrent_runs": 4, "queue_depth": 8, "overflow_policy": "reject", **limits}
        ),
        resource_policy=admitgate.MemoryPressurePolicy(soft_rss_mb=100, hard_rss_mb=200),
        resource_sampler=sampler,
    )


@pytest.mark.parametrize("eases_by", ["sample", "reconfigure"])
def test_waiters_held_back_by_soft_pressure_start_once_it_eases(eases_by: str) -> None:
    """Issue 15 item 6: with 1 of 4 slots taken under soft pressure, 3 turns wait; RSS drops
    below soft (or `reconfigure(max_rss_mb=0)` turns memory-aware admission off) and nobody
    arrives or leaves. They must take the free slots at once, not time out."""
    sampler = FakeSampler(150.0)
    gate = pressure_gate(sampler, queue_timeout_s=3.0)

    async def scenario() -> None:
        meter, leave = Meter(), asyncio.Event()
        tasks = [asyncio.ensure_future(held_turn(gate, meter, leave)) for _ in range(4)]
        await settle()
        assert (meter.now, gate.in_flight, gate.queued) == (1, 1, 3)
        if eases_by == "sample":
            sampler.rss_mb = 50.0
        else:
            assert gate.reconfigure(max_rss_mb=0) == 0
            assert gate.stats()["max_rss_mb"] == 0.0
        took = await eventually(lambda: meter.now == 4, "the held-back waiters started")
        assert took < 0.5, took
        assert (gate.in_flight, gate.queued) == (4, 0)
        leave.set()
        await asyncio.gather(*tasks)

    run(scenario())
    assert gate.rejected == 0
    settled(gate, 4)


def test_blocked_threads_held_back_by_pressure_start_once_it_eases() -> None:
    """Item 6 for admit_sync: threads held back by soft pressure start when a sample shows it
    eased, with no event loop anywhere and nobody arriving or leaving."""
    sampler = FakeSampler(150.0)
    gate = pressure_gate(sampler)
    leave = threading.Event()
    entered: list[float] = []

    def turn() -> None:
        with gate.admit_sync(timeout=5.0):
            entered.append(time.monotonic())
            leave.wait(10)

    threads = [threading.Thread(target=turn) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while (gate.in_flight, gate.queued) != (1, 3) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert (gate.in_flight, gate.queued) == (1, 3)
    eased = time.monotonic()
    sampler.rss_mb = 50.0
    while len(entered) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(entered) == 4, "threads held back by pressure were stranded"
    assert max(entered) - eased < 0.5
    leave.set()
    for t in threads:
        t.join(5)
    settled(gate, 4)


# -- reconfigure across 0 --------------------------------------------------------------------


def test_turns_let_through_by_a_disabled_gate_count_against_a_ceiling_set_later() -> None:
    """Issue 15 item 7: 5 turns pass a gate with no ceiling; `reconfigure(max_concurrent_runs=2)`
    must count them, so newcomers wait until fewer than 2 run (before: 5 + 2 ran, in_flight
    read 2)."""
    gate = admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(
            max_concurrent_runs=0, queue_depth=16, overflow_policy="queue"
        )
    )
    assert gate.enabled is False

    async def scenario() -> None:
        meter = Meter()
        early = [asyncio.Event() for _ in range(5)]
        first = [asyncio.ensure_future(held_turn(gate, meter, e)) for e in early]
        await settle()
        assert meter.now == 5
        gate.reconfigure(max_concurrent_runs=2)
        assert gate.enabled is True
        assert gate.in_flight == 5, "the turns already running are not counted"
        late_leave = asyncio.Event()
        late = [asyncio.ensure_future(held_turn(gate, meter, late_leave)) for _ in range(5)]
        await settle()
        assert (meter.now, gate.queued) == (5, 5), "a newcomer ran above the ceiling"
        for i, e in enumerate(early):
            e.set()
            await settle()
            # 5 - (i + 1) early ones still run; the late ones fill up to the ceiling only.
            assert meter.now == max(5 - (i + 1), 2), (i, meter.now)
            assert gate.in_flight == meter.now
        late_leave.set()
        await asyncio.gather(*first, *late)
        assert meter.peak == 5

    run(scenario())
    s = gate.stats()
    # The 5 turns let through while disabled were never admitted by the gate (as in the
    # reference); the 5 late ones were.
    assert (s["admitted"], s["in_flight"], s["queued"]) == (5, 0, 0), s
    assert gate.transport_stats()["direct"]["admitted"] == 10


def test_a_drain_waits_for_turns_let_through_by_a_disabled_gate() -> None:
    """A drain never cancels a running turn and reports the ones still running: turns let
    through by a gate with nothing to enforce are running turns too."""
    gate = admitgate.AdmissionGate(None)

    async def scenario() -> None:
        meter, leave = Meter(), asyncio.Event()
        task = asyncio.ensure_future(held_turn(gate, meter, leave))
        await settle()
        assert meter.now == 1
        assert await gate.close(drain_timeout=0) == (0, 1, 0)
        closing = asyncio.ensure_future(gate.close(drain_timeout=5))
        await settle()
        assert not closing.done(), "the drain did not wait for the running turn"
        leave.set()
        assert await closing == (1, 0, 0)
        await task

    run(scenario())
    assert (gate.in_flight, gate.admitted) == (0, 0)


def test_reconfigure_n_to_0_to_n_with_turns_running_queued_and_lending() -> None:
    """The ceiling holds across N -> 0 -> N: turns running under N, turns let through while
    the ceiling is 0, a turn lending its slot to a human wait, and waiters queued at the time;
    counters add up at the end."""
    from praisonaiagents.approval.registry import HUMAN_WAIT_SCOPE

    gate = admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(
            max_concurrent_runs=2, queue_depth=16, overflow_policy="queue"
        )
    )

    async def scenario() -> None:
        meter = Meter()
        leave_a, leave_b, leave_c = asyncio.Event(), asyncio.Event(), asyncio.Event()
        human_entered, human_done = asyncio.Event(), asyncio.Event()

        async def lender() -> None:
            async with gate.admit():
                meter.enter()
                async with HUMAN_WAIT_SCOPE.get()():
                    meter.leave()  # not running while a person decides
                    human_entered.set()
                    await human_done.wait()
                    meter.enter()
                await leave_a.wait()
                meter.leave()

        tasks = [asyncio.ensure_future(lender())]
        await human_entered.wait()
        assert (gate.in_flight, gate.awaiting_human) == (0, 1)
        tasks += [asyncio.ensure_future(held_turn(gate, meter, leave_a)) for _ in range(4)]
        await settle()
        assert (meter.now, gate.queued) == (2, 2)
        gate.reconfigure(max_concurrent_runs=0)  # the 2 waiters start at once
        await settle()
        assert (meter.now, gate.queued, gate.in_flight) == (4, 0, 4)
        tasks += [asyncio.ensure_future(held_turn(gate, meter, leave_b)) for _ in range(3)]
        await settle()
        assert meter.now == 7  # no ceiling: they pass
        gate.reconfigure(max_concurrent_runs=3)
        assert gate.in_flight == 7
        human_done.set()  # resumes by borrowing a slot
        await settle()
        assert (meter.now, gate.in_flight, gate.awaiting_human) == (8, 8, 0)
        tasks += [asyncio.ensure_future(held_turn(gate, meter, leave_c)) for _ in range(4)]
        await settle()
        assert (meter.now, gate.queued) == (8, 4)  # nobody new runs above the ceiling
        leave_a.set()  # the lender and 4 turns leave: 3 still run, at the ceiling
        await settle()
        assert (meter.now, gate.in_flight, gate.queued) == (3, 3, 4)
        leave_b.set()  # the 3 let through at ceiling 0 leave: 3 waiters start
        await settle()
        assert (meter.now, gate.in_flight, gate.queued) == (3, 3, 1)
        leave_c.set()
        await asyncio.gather(*tasks)

    run(scenario())
    # The 3 let through at ceiling 0 were never admitted by the gate (as in the reference).
    settled(gate, 9)
    assert gate.transport_stats()["direct"]["admitted"] == 12


# -- fork ------------------------------------------------------------------------------------


def never_wrapped(gate: Any) -> None:
    s = gate.stats()
    for key, value in s.items():
        if isinstance(value, int):
            assert 0 <= value < WRAPPED, (key, value)
    for name, t in gate.transport_stats().items():
        counts = [t["in_flight"], t["queued"], t["admitted"], *t["rejected"].values()]
        assert all(0 <= c < WRAPPED for c in counts), (name, t)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_childs_counters_never_wrap_when_the_parents_turns_end_there() -> None:
    """Issue 15 item 8: in a forked child the parent's turns end (a queued turn withdrawn, a
    running one and one let through by a disabled gate exiting). The child's per-transport
    counters must stay at 0, not wrap to 2^64 - 1; the parent is unaffected."""
    gated: Any = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=4)
    disabled = admitgate.AdmissionGate(None)
    loop = asyncio.new_event_loop()
    running = gated.admit(transport="rest")
    loop.run_until_complete(running.__aenter__())
    queued = gated.admit(transport="rest")
    wait = queued.__aenter__()
    through = disabled.admit(transport="rest")
    loop.run_until_complete(through.__aenter__())
    before = (gated.transport_stats(), disabled.transport_stats(), gated.stats())
    assert before[0]["rest"]["queued"] == 1 and before[1]["rest"]["in_flight"] == 1

    def child() -> None:
        wait.close()  # the parent's waiter withdraws in the child
        loop.run_until_complete(running.__aexit__(None, None, None))
        loop.run_until_complete(through.__aexit__(None, None, None))
        for gate in (gated, disabled):
            never_wrapped(gate)
            for t in gate.transport_stats().values():
                assert (t["in_flight"], t["queued"]) == (0, 0), t

        async def main() -> None:  # the child's gates work
            async with gated.admit(transport="rest"), disabled.admit(transport="rest"):
                assert gated.transport_stats()["rest"]["in_flight"] == 1
                assert disabled.transport_stats()["rest"]["in_flight"] == 1

        asyncio.run(main())
        settled(gated, 1)
        settled(disabled, 0)

    code, message = in_forked_child(child)
    assert code == 0, message
    assert (gated.transport_stats(), disabled.transport_stats(), gated.stats()) == before
    wait.close()
    loop.run_until_complete(running.__aexit__(None, None, None))
    loop.run_until_complete(through.__aexit__(None, None, None))
    loop.close()
    settled(gated, 2)
    assert disabled.transport_stats()["rest"]["in_flight"] == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("stage", ["queued", "running", "lending", "reconfigured_from_0"])
def test_fork_at_every_stage_leaves_both_gates_sane(stage: str) -> None:
    """A child forked while turns are queued, running, lending their slot to a human wait, or
    just after a reconfigure adopted turns let through at ceiling 0: the child's gate starts
    empty and works, its counters never wrap when the parent's turns end there, and the
    parent's gate is untouched and drains."""
    from praisonaiagents.approval.registry import HUMAN_WAIT_SCOPE

    ceiling = 0 if stage == "reconfigured_from_0" else 1
    gate = admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(
            max_concurrent_runs=ceiling, queue_depth=8, overflow_policy="queue"
        )
    )
    loop = asyncio.new_event_loop()
    leave = asyncio.Event()
    meter = Meter()

    async def lender() -> None:
        async with gate.admit(transport="rest"):
            async with HUMAN_WAIT_SCOPE.get()():
                await leave.wait()

    async def start() -> list[asyncio.Task[None]]:
        if stage == "lending":
            tasks = [asyncio.ensure_future(lender())]
            await settle()
            assert gate.awaiting_human == 1
        else:
            tasks = []
        tasks += [
            asyncio.ensure_future(held_turn(gate, meter, leave, transport="rest"))
            for _ in range(1 if stage == "running" else 3)
        ]
        await settle()
        if stage == "reconfigured_from_0":
            gate.reconfigure(max_concurrent_runs=1)
        return tasks

    tasks = loop.run_until_complete(start())
    expected = {
        "queued": (1, 2),
        "running": (1, 0),
        "lending": (1, 2),
        "reconfigured_from_0": (3, 0),
    }[stage]
    assert (gate.in_flight, gate.queued) == expected
    before = (gate.stats(), gate.transport_stats())

    def child() -> None:
        never_wrapped(gate)
        assert (gate.in_flight, gate.queued, gate.awaiting_human) == (0, 0, 0)
        # The parent's turns end in the child (the running ones leave, the waiting ones are
        # cancelled: the child's gate does not know them): nothing reaches the child's counts.
        leave.set()
        loop.run_until_complete(settle())
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        never_wrapped(gate)
        assert (gate.in_flight, gate.queued, gate.awaiting_human) == (0, 0, 0)
        child_meter, child_leave = Meter(), asyncio.Event()

        async def main() -> None:
            turns = [
                asyncio.ensure_future(held_turn(gate, child_meter, child_leave)) for _ in range(3)
            ]
            await settle()
            assert child_meter.now == 1 and gate.queued == 2
            child_leave.set()
            await asyncio.gather(*turns)

        asyncio.run(main())
        assert child_meter.peak == 1
        settled(gate, 3)

    code, message = in_forked_child(child)
    assert code == 0, message
    assert (gate.stats(), gate.transport_stats()) == before
    leave.set()
    loop.run_until_complete(asyncio.wait_for(asyncio.gather(*tasks), 5))
    loop.close()
    assert meter.peak == (3 if stage == "reconfigured_from_0" else 1)
    if stage == "reconfigured_from_0":
        assert gate.admitted == 0  # let through while disabled, never admitted by the gate
        assert gate.in_flight == 0
    else:
        settled(gate, {"queued": 3, "running": 1, "lending": 4}[stage])


# -- 100k waiters with on_queued -------------------------------------------------------------


def test_100k_queued_arrivals_with_on_queued_stay_cheap_then_drain() -> None:
    """Issue 15: `on_queued` asked for the waiter's position by walking the queue under the
    gate's lock, so n queued arrivals cost O(n^2) (40k: 6.7 s with the lock held). 100k
    arrivals with `on_queued` now finish in bounded time, the position of the newest waiter
    is cheap to read, and a drain refuses every waiter with the counters adding up."""
    n = 100_000
    gate: Any = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=n)
    positions: list[int] = []

    def on_queued(position: int, estimate: float | None) -> None:
        positions.append(position)

    async def scenario() -> None:
        holder = gate.admit()
        await holder.__aenter__()
        started = time.monotonic()
        waits = []
        for _ in range(n):
            admission = gate.admit(on_queued=on_queued)
            waits.append((admission, admission.__aenter__()))
        arrivals = time.monotonic() - started
        assert gate.queued == n
        assert positions[:3] == [0, 1, 2] and positions[-1] == n - 1
        # Reading the newest waiter's position: O(log n) now, a walk of 100k records before.
        newest = waits[-1][0]
        started = time.monotonic()
        for _ in range(10_000):
            assert newest.position == n - 1
        reads = time.monotonic() - started
        assert reads < 0.5, f"10k position reads at depth 100k took {reads:.2f}s"
        assert arrivals < 20, f"{n} queued arrivals took {arrivals:.1f}s"
        # A withdrawal in the middle moves everyone behind it up by one.
        waits[n // 2][1].close()
        assert newest.position == n - 2 and waits[n // 2 + 1][0].position == n // 2
        report = await gate.close(drain_timeout=0)
        assert report == (0, 1, n - 1), report
        for _, wait in waits:
            wait.close()
        await holder.__aexit__(None, None, None)

    run(scenario(), timeout=50)
    s = gate.stats()
    assert s["admitted"] == 1 and s["admitted"] + s["rejected"] + s["cancelled"] == n + 1, s
    assert (s["in_flight"], s["queued"]) == (0, 0)


# -- draining a gate with a fleet limit ------------------------------------------------------


def test_drain_report_counts_a_turn_waiting_for_its_lease_as_refused(redis_server: Any) -> None:
    """Issue 15 item 9: a turn holding its local slot while it waits for its fleet lease is
    refused with `closing` by the drain: the report counts it in `queued_rejected`, not in
    `finished`."""
    key = f"gate:{uuid.uuid4().hex[:12]}"
    other = admitgate.FleetLimit(redis_server.url, key, 1)
    gate: Any = admitgate.build_admission_gate(
        max_concurrent_runs=4, queue_depth=4, fleet=admitgate.FleetLimit(redis_server.url, key, 1)
    )

    async def scenario() -> None:
        held = await other.acquire()  # the fleet is full: the turn waits for its lease
        reasons: list[str] = []

        async def turn() -> None:
            try:
                async with gate.admit():
                    pytest.fail("no lease can come")
            except admitgate.AdmissionRejected as refused:
                reasons.append(str(refused.reason))

        task = asyncio.ensure_future(turn())
        await eventually(lambda: gate.in_flight == 1, "the turn holds its local slot")
        await asyncio.sleep(0.05)
        report = await gate.close(drain_timeout=5)
        await task
        assert reasons == ["closing"]
        assert report == (0, 0, 1), report
        await held.release()

    run(scenario(), timeout=20)
    s = gate.stats()
    assert (s["admitted"], s["rejected"], s["in_flight"]) == (0, 1, 0), s


# -- interpreter exit ------------------------------------------------------------------------

EXIT_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, threading, time
    import admitgate
    from admitgate import AdmissionGate, ConcurrencyLimitPolicy, MemoryPressurePolicy

    kind = sys.argv[1]
    if kind == "plain":
        gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=8)
    elif kind == "per_tenant":
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=4, max_concurrent_runs_per_scope=1, queue_depth=8
        )
    elif kind == "memory":
        gate = AdmissionGate(
            ConcurrencyLimitPolicy(max_concurrent_runs=4, queue_depth=8),
            resource_policy=MemoryPressurePolicy(soft_rss_mb=1, hard_rss_mb=10**6),
        )
    else:
        gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=8)

    def worker():
        with gate.admit_sync(session_id="t"):
            time.sleep(60)

    async def turn():
        async with gate.admit(session_id="t"):
            await asyncio.sleep(60)

    async def main():
        if kind == "threads":
            for _ in range(3):
                threading.Thread(target=worker, daemon=True).start()
            while gate.in_flight + gate.queued < 3:
                await asyncio.sleep(0.01)
        tasks = [asyncio.ensure_future(turn()) for _ in range(3)]
        while gate.in_flight + gate.queued < (6 if kind == "threads" else 3):
            await asyncio.sleep(0.01)
        assert gate.queued > 0, gate.stats()
        print("ready", gate.in_flight, gate.queued, flush=True)
        sys.exit(0)  # turns running and queued, tasks pending, threads blocked

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("kind", ["plain", "per_tenant", "memory", "threads"])
def test_the_interpreter_exits_promptly_with_turns_in_flight(kind: str) -> None:
    """Exiting with turns running and queued (async tasks, and admit_sync threads blocked in
    the queue) on every kind of gate: the process exits 0, promptly, with nothing on stderr."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, kind],
        capture_output=True,
        text=True,
        timeout=30,
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ready"), done.stdout
    assert "Traceback" not in done.stderr and "panicked" not in done.stderr, done.stderr
    assert took < 10, took
