"""AdmissionGate(..., fleet=FleetLimit(...)): a turn runs once it has a local slot and a fleet
lease, against a real redis-server (the session fixture of ``conftest.py``).

The counters say what callers experienced: a turn refused by the fleet counts as rejected, one
cancelled while it waited for its lease as cancelled, and its local slot goes to the next turn.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
import warnings
from typing import Any

import pytest
from admitgate import AdmissionGate, AdmissionRejected, FleetLimit, build_admission_gate
from conftest import reap_child, run
from fleet_support import RedisServer, eventually, free_port


def new_key() -> str:
    """A limit key no other test uses."""
    return f"gate:{uuid.uuid4().hex[:12]}"


def settled(gate: AdmissionGate, arrivals: int) -> None:
    """Every arrival is counted once, as its caller saw it, and nothing is held."""
    s = gate.stats()
    assert s["admitted"] + s["rejected"] + s["shed"] + s["cancelled"] == arrivals, s
    assert (s["in_flight"], s["queued"]) == (0, 0), s


class Turns:
    """Turns through a gate that stay inside until ``leave`` is set."""

    def __init__(self, gate: AdmissionGate):
        self.gate = gate
        self.entered = 0
        self.leave = asyncio.Event()

    async def turn(self, session: str = "") -> None:
        async with self.gate.admit(session_id=session):
            self.entered += 1
            await self.leave.wait()

    def start(self, n: int = 1, session: str = "") -> list[asyncio.Task[None]]:
        return [asyncio.ensure_future(self.turn(session)) for _ in range(n)]


def test_the_gate_takes_the_fleet_and_validates_it(redis_server: RedisServer) -> None:
    limit = FleetLimit(redis_server.url, new_key(), 3)
    gate = build_admission_gate(fleet=limit)  # no local ceiling: the fleet's cap alone
    assert gate is not None and gate.fleet is limit and gate.enabled
    assert build_admission_gate() is None, "without a fleet nothing is configured"
    stats = gate.stats()
    assert stats["fleet_max_in_flight"] == 3 and stats["fleet_backend_up"] == 1
    fleet_keys = {k for k in stats if k.startswith("fleet_")}
    assert fleet_keys == {
        "fleet_in_flight",
        "fleet_max_in_flight",
        "fleet_backend_up",
        "fleet_lease_lost",
        "fleet_borrowed",
        "fleet_outages",
        "fleet_failovers",
    }
    assert all(isinstance(v, int | float) for v in stats.values())
    plain = build_admission_gate(max_concurrent_runs=2)
    assert plain is not None and plain.fleet is None
    assert not any(k.startswith("fleet_") for k in plain.stats())
    with pytest.raises(
        ValueError, match=r"^fleet must be an admitgate.FleetLimit or None, got 'x'"
    ):
        AdmissionGate(None, fleet="x")


def test_the_fleet_cap_binds_below_the_local_ceiling(redis_server: RedisServer) -> None:
    limit = FleetLimit(redis_server.url, new_key(), 2)
    gate = build_admission_gate(max_concurrent_runs=5, queue_depth=5, fleet=limit)
    assert gate is not None

    async def scenario() -> None:
        turns = Turns(gate)
        tasks = turns.start(4)
        await eventually(lambda: turns.entered == 2 and gate.in_flight == 4, "two run")
        await asyncio.sleep(0.1)
        assert turns.entered == 2, "the fleet cap of 2 holds"
        assert gate.admitted == 2, "turns waiting for their lease are not admitted yet"
        assert gate.saturated, "saturated means the fleet cap"
        assert gate.transport_stats()["direct"]["queued"] == 2
        turns.leave.set()
        await asyncio.gather(*tasks)
        assert turns.entered == 4

    run(scenario(), timeout=20)
    settled(gate, 4)
    assert gate.admitted == 4 and gate.transport_stats()["direct"]["admitted"] == 4


def test_a_turn_cancelled_while_waiting_for_its_lease_counts_as_cancelled(
    redis_server: RedisServer,
) -> None:
    key = new_key()
    limit = FleetLimit(redis_server.url, key, 1)
    gate = build_admission_gate(max_concurrent_runs=2, queue_depth=2, fleet=limit)
    assert gate is not None
    r = redis_server.client()

    async def scenario() -> None:
        turns = Turns(gate)
        running = turns.start(1)
        await eventually(lambda: turns.entered == 1, "the first runs")
        waiting = turns.start(1)
        await eventually(lambda: r.zcard(f"{{{key}}}:tickets") == 1, "a ticket")
        assert gate.in_flight == 2, "it holds its local slot while it waits for the lease"
        queued = turns.start(1)  # local ceiling reached: waits in the local queue
        await eventually(lambda: gate.queued == 1, "queued locally")
        waiting[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
        # Its local slot went to the next turn, which now waits for the lease in turn.
        await eventually(lambda: gate.queued == 0 and gate.in_flight == 2, "handed on")
        assert gate.cancelled == 1
        turns.leave.set()
        await asyncio.gather(*running, *queued)
        assert turns.entered == 2

    run(scenario(), timeout=20)
    settled(gate, 3)
    assert (gate.admitted, gate.cancelled, gate.rejected) == (2, 1, 0)
    assert r.zcard(f"{{{key}}}:tickets") == 0


def test_an_admission_exited_while_it_waits_for_its_lease_still_hands_its_slot_on(
    redis_server: RedisServer,
) -> None:
    # `__aexit__` reaching a turn that never ran (it still waits for its lease) must leave the
    # turn to its wait: cancelling the wait then hands the local slot on, as for any turn.
    key = new_key()
    limit = FleetLimit(redis_server.url, key, 1)
    gate = build_admission_gate(max_concurrent_runs=2, queue_depth=2, fleet=limit)
    assert gate is not None
    r = redis_server.client()

    async def scenario() -> None:
        turns = Turns(gate)
        running = turns.start(1)
        await eventually(lambda: turns.entered == 1, "the first runs")
        admission = gate.admit()

        async def enter() -> None:
            await admission.__aenter__()

        waiting = asyncio.ensure_future(enter())
        await eventually(lambda: r.zcard(f"{{{key}}}:tickets") == 1, "a ticket")
        assert gate.in_flight == 2, "it holds its local slot while it waits for the lease"
        await admission.__aexit__(None, None, None)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await eventually(lambda: gate.in_flight == 1, "its local slot handed on")
        await eventually(lambda: r.zcard(f"{{{key}}}:tickets") == 0, "its ticket withdrawn")
        turns.leave.set()
        await asyncio.gather(*running)

    run(scenario(), timeout=20)
    settled(gate, 2)
    assert (gate.admitted, gate.cancelled) == (1, 1)


def test_a_fleet_refusal_counts_as_rejected_and_a_local_admission_as_admitted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="admitgate")
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens: an outage from the start
    fast = {"connect_timeout_s": 0.3, "command_timeout_s": 0.3}
    strict = build_admission_gate(
        max_concurrent_runs=2,
        fleet=FleetLimit(dead, new_key(), 5, on_backend_error="reject", **fast),
    )
    lenient = build_admission_gate(
        max_concurrent_runs=2, fleet=FleetLimit(dead, new_key(), 5, **fast)
    )
    assert strict is not None and lenient is not None

    async def scenario() -> None:
        for _ in range(3):
            with pytest.raises(AdmissionRejected) as refused:
                async with strict.admit(session_id="a"):
                    pytest.fail("refused turns never run")
            assert refused.value.reason == "fleet_unavailable"
            assert refused.value.retry_after is not None
        ran = 0
        for _ in range(3):
            async with lenient.admit(session_id="a"):
                ran += 1
        assert ran == 3

    run(scenario(), timeout=20)
    assert (strict.admitted, strict.rejected, strict.in_flight) == (0, 3, 0)
    assert strict.transport_stats()["direct"]["rejected"]["fleet_unavailable"] == 3
    assert strict.stats()["fleet_backend_up"] == 0
    settled(strict, 3)
    assert (lenient.admitted, lenient.rejected) == (3, 0)
    settled(lenient, 3)
    messages = [rec.getMessage() for rec in caplog.records if rec.name == "admitgate"]
    assert sum("fleet_unavailable" in m and "rejecting turn" in m for m in messages) == 3
    assert sum("unreachable" in m for m in messages) == 2, "one warning per limit's outage"


def test_the_queue_timeout_bounds_the_wait_for_a_lease(redis_server: RedisServer) -> None:
    key = new_key()
    other = FleetLimit(redis_server.url, key, 1)
    gate = build_admission_gate(
        max_concurrent_runs=2, queue_timeout_s=0.3, fleet=FleetLimit(redis_server.url, key, 1)
    )
    assert gate is not None
    r = redis_server.client()

    async def scenario() -> None:
        held = await other.acquire()
        started = time.monotonic()
        with pytest.raises(AdmissionRejected) as refused:
            async with gate.admit():
                pytest.fail("no lease came")
        waited = time.monotonic() - started
        assert refused.value.reason == "timeout"
        assert 0.25 < waited < 3, waited
        await eventually(lambda: r.zcard(f"{{{key}}}:tickets") == 0, "ticket withdrawn")
        await held.release()
        async with gate.admit():
            pass

    run(scenario(), timeout=20)
    assert (gate.admitted, gate.rejected) == (1, 1)
    assert gate.transport_stats()["direct"]["rejected"]["timeout"] == 1
    settled(gate, 2)


def test_admit_sync_waits_for_its_lease_on_a_worker_thread(redis_server: RedisServer) -> None:
    key = new_key()
    other = FleetLimit(redis_server.url, key, 1)
    gate = build_admission_gate(max_concurrent_runs=2, fleet=FleetLimit(redis_server.url, key, 1))
    assert gate is not None
    entered = threading.Event()
    outcome: list[Any] = []

    def worker(timeout: float | None) -> None:
        try:
            with gate.admit_sync(timeout=timeout):
                entered.set()
                outcome.append("ran")
        except AdmissionRejected as exc:
            outcome.append(exc.reason)

    async def scenario() -> None:
        held = await other.acquire()
        thread = threading.Thread(target=worker, args=(None,))
        thread.start()
        await eventually(lambda: gate.in_flight == 1, "its local slot taken")
        await asyncio.sleep(0.2)
        assert not entered.is_set(), "blocked until a lease frees"
        await held.release()
        await eventually(entered.is_set, "entered once the lease came")
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
        held = await other.acquire()
        timed = threading.Thread(target=worker, args=(0.3,))
        timed.start()
        await asyncio.get_running_loop().run_in_executor(None, timed.join, 10)
        await held.release()

    run(scenario(), timeout=30)
    assert outcome == ["ran", "timeout"]
    assert (gate.admitted, gate.rejected) == (1, 1)
    settled(gate, 2)


def test_a_human_wait_lends_the_lease_fleet_wide_and_resumes_without_blocking(
    redis_server: RedisServer,
) -> None:
    from praisonaiagents.approval.registry import HUMAN_WAIT_SCOPE

    key = new_key()
    r = redis_server.client()
    here = build_admission_gate(max_concurrent_runs=2, fleet=FleetLimit(redis_server.url, key, 1))
    there_limit = FleetLimit(redis_server.url, key, 1)
    there = build_admission_gate(max_concurrent_runs=2, fleet=there_limit)
    assert here is not None and there is not None

    async def scenario() -> None:
        other = Turns(there)
        async with here.admit(session_id="alice"):
            wait = HUMAN_WAIT_SCOPE.get()()
            async with wait:  # a person decides: the lease goes back to the fleet
                assert here.awaiting_human == 1 and here.in_flight == 0
                waiting = other.start(1)
                await eventually(lambda: other.entered == 1, "the other replica got it")
                resumed = time.monotonic()
            assert time.monotonic() - resumed < 0.5, "resuming never waits on Redis"
            # No room: the resuming turn borrows over the cap, counted fleet-wide.
            await eventually(lambda: r.get(f"{{{key}}}:borrowed") == "1", "borrowed")
            assert here.stats()["fleet_borrowed"] == 1
            assert r.zcard(f"{{{key}}}:holders") == 2
            other.leave.set()
            await asyncio.gather(*waiting)
            # That release repaid the borrow instead of freeing room.
            await eventually(lambda: r.get(f"{{{key}}}:borrowed") in (None, "0"), "repaid")
            assert r.zcard(f"{{{key}}}:holders") == 1
        await eventually(lambda: r.zcard(f"{{{key}}}:holders") == 0, "all given back")

    run(scenario(), timeout=20)
    settled(here, 1)
    settled(there, 1)


def test_closing_the_gate_refuses_turns_waiting_for_their_lease(
    redis_server: RedisServer,
) -> None:
    key = new_key()
    other = FleetLimit(redis_server.url, key, 1)
    gate = build_admission_gate(max_concurrent_runs=3, fleet=FleetLimit(redis_server.url, key, 1))
    assert gate is not None
    r = redis_server.client()
    refused: list[str | None] = []

    def blocked() -> None:
        try:
            with gate.admit_sync():
                refused.append("ran")
        except AdmissionRejected as exc:
            refused.append(exc.reason)

    async def scenario() -> None:
        held = await other.acquire()
        waiting = asyncio.ensure_future(gate.admit().__aenter__())
        thread = threading.Thread(target=blocked)
        thread.start()
        await eventually(lambda: gate.in_flight == 2, "both hold a slot, waiting for a lease")
        report = await gate.close(drain_timeout=5)
        with pytest.raises(AdmissionRejected) as closed:
            await waiting
        assert closed.value.reason == "closing"
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
        assert refused == ["closing"]
        assert report.still_running == 0 and gate.in_flight == 0
        await eventually(lambda: r.zcard(f"{{{key}}}:tickets") == 0, "tickets withdrawn")
        await held.release()

    run(scenario(), timeout=20)
    assert (gate.admitted, gate.rejected) == (0, 2)
    assert gate.transport_stats()["direct"]["rejected"]["closing"] == 2
    settled(gate, 2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_gives_back_the_parents_turn_lease(redis_server: RedisServer) -> None:
    key = new_key()
    r = redis_server.client()
    gate = build_admission_gate(max_concurrent_runs=2, fleet=FleetLimit(redis_server.url, key, 2))
    assert gate is not None
    admission = gate.admit()

    async def enter() -> None:
        await admission.__aenter__()

    run(enter())
    parent = r.zrange(f"{{{key}}}:holders", 0, -1)
    assert len(parent) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 3
        try:
            admission.__aexit__(None, None, None)  # the parent's turn ends here: nothing sent

            async def turn() -> None:
                async with gate.admit():
                    assert r.zcard(f"{{{key}}}:holders") == 2

            run(turn(), timeout=20)
            time.sleep(0.2)
            code = 0 if r.zrange(f"{{{key}}}:holders", 0, -1) == parent else 1
        finally:
            os._exit(code)
    assert reap_child(pid, 30) == 0
    assert r.zrange(f"{{{key}}}:holders", 0, -1) == parent, "the child left it alone"
    admission.__aexit__(None, None, None)
    deadline = time.monotonic() + 5
    while r.zcard(f"{{{key}}}:holders") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.zcard(f"{{{key}}}:holders") == 0
    settled(gate, 1)


# -- issue 22 item 14: the caller's deadline bounds the wait for the lease ---------------------


def test_deadline_s_bounds_the_wait_for_the_lease(redis_server: RedisServer) -> None:
    """Fails before the fix: with ``fleet=``, a turn that held its local slot and waited for
    its lease was bounded by the queue timeout alone: ``deadline_s=0.3`` ran at 1.8 s. Now it is
    refused with ``deadline`` (504) once less of its deadline is left than a turn takes; a
    queue timeout that comes first refuses it with ``timeout``, as in the local queue."""
    key = new_key()
    there = build_admission_gate(max_concurrent_runs=2, fleet=FleetLimit(redis_server.url, key, 1))
    gates = {
        timeout_s: build_admission_gate(
            max_concurrent_runs=2,
            queue_depth=4,
            queue_timeout_s=timeout_s,
            fleet=FleetLimit(redis_server.url, key, 1),
        )
        for timeout_s in (None, 0.2)
    }
    assert there is not None and all(gates.values())

    async def scenario() -> None:
        holder = Turns(there)
        held = holder.start(1)
        await eventually(lambda: holder.entered == 1, "the fleet's one lease is held")
        for deadline_s, timeout_s, reason in ((0.3, None, "deadline"), (5.0, 0.2, "timeout")):
            began = time.monotonic()
            with pytest.raises(AdmissionRejected) as err:
                async with gates[timeout_s].admit(deadline_s=deadline_s):
                    raise AssertionError("ran without a lease")
            waited = time.monotonic() - began
            assert err.value.reason == reason, (deadline_s, err.value)
            assert waited < min(deadline_s, timeout_s or deadline_s) + 0.3, waited
        holder.leave.set()
        await asyncio.gather(*held)

    run(scenario(), timeout=10)
    for gate in gates.values():
        s = gate.stats()
        assert (s["rejected"], s["admitted"], s["in_flight"], s["queued"]) == (1, 0, 0, 0), s


def test_admit_sync_deadline_s_bounds_the_wait_for_the_lease(redis_server: RedisServer) -> None:
    key = new_key()
    there = build_admission_gate(max_concurrent_runs=2, fleet=FleetLimit(redis_server.url, key, 1))
    here = build_admission_gate(max_concurrent_runs=2, fleet=FleetLimit(redis_server.url, key, 1))
    assert here is not None and there is not None
    entered, leave = threading.Event(), threading.Event()

    def holder() -> None:
        with there.admit_sync():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert entered.wait(5)
        began = time.monotonic()
        with pytest.raises(AdmissionRejected) as err, here.admit_sync(deadline_s=0.3):
            raise AssertionError("ran without a lease")
        assert err.value.reason == "deadline"
        assert time.monotonic() - began < 0.6
    finally:
        leave.set()
        thread.join()
    s = here.stats()
    assert (s["rejected"], s["in_flight"]) == (1, 0), s
