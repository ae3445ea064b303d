"""What operators expect of a production gate (issue 11): drain, queue wait timeouts, place
in line, the sync API, live reconfiguration and the per-tenant view. Everything through the
public API; after everything settles, admitted + rejected + shed + cancelled equals the turns
that reached the gate."""

from __future__ import annotations

import asyncio
import threading
import time

import admitgate
import pytest
from conftest import run, settle
from hypothesis import given, settings
from hypothesis import strategies as st


def conserved(gate) -> int:
    return gate.admitted + gate.rejected + gate.shed + gate.cancelled


class Turn:
    """A turn held open until released, recording how it ended."""

    def __init__(self, gate, **admit) -> None:
        self.release = asyncio.Event()
        self.started = False
        self.outcome: str | None = None
        self.error: BaseException | None = None
        self.admission = gate.admit(**admit)
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            async with self.admission:
                self.started = True
                await self.release.wait()
            self.outcome = "done"
        except admitgate.AdmissionRejected as exc:
            self.outcome, self.error = f"rejected:{exc.reason}", exc


# -- drain ------------------------------------------------------------------------------


def test_drain_refuses_queued_and_new_turns_and_waits_for_running_ones_on_two_loops():
    gate = admitgate.build_admission_gate(max_concurrent_runs=2, queue_depth=10)
    started = threading.Event()
    release_other = threading.Event()
    other_outcome: list[str] = []

    def other_loop() -> None:
        async def main() -> None:
            try:
                async with gate.admit(session_id="other"):
                    started.set()
                    while not release_other.is_set():
                        await asyncio.sleep(0.005)
                other_outcome.append("done")
            except admitgate.AdmissionRejected as exc:
                other_outcome.append(f"rejected:{exc.reason}")

        asyncio.run(main())

    worker = threading.Thread(target=other_loop)
    worker.start()
    assert started.wait(5)

    async def scenario():
        running = Turn(gate)
        queued = [Turn(gate) for _ in range(3)]
        await settle()
        assert running.started and gate.queued == 3
        drain = asyncio.ensure_future(gate.close(drain_timeout=5))
        await settle()
        assert [t.outcome for t in queued] == ["rejected:closing"] * 3
        assert queued[0].error.retry_after is None
        late = Turn(gate)
        await settle()
        assert late.outcome == "rejected:closing"
        assert not drain.done(), "two turns are still running"
        running.release.set()
        await settle()
        assert not drain.done(), "the other loop's turn still runs"
        release_other.set()
        report = await asyncio.wait_for(drain, 5)
        assert report == admitgate.DrainReport(finished=2, still_running=0, queued_rejected=3)
        assert running.outcome == "done"
        assert gate.closed
        again = await gate.close(drain_timeout=0)  # a closed gate stays closed
        assert again == admitgate.DrainReport(0, 0, 0)
        assert gate.stats()["in_flight"] == 0

    run(scenario())
    worker.join(5)
    assert other_outcome == ["done"]
    assert conserved(gate) == 6
    assert gate.transport_stats()["direct"]["rejected"]["closing"] == 4


def test_drain_timeout_reports_turns_still_running_and_never_cancels_them():
    async def scenario():
        gate = admitgate.build_admission_gate(max_concurrent_runs=2)
        turns = [Turn(gate), Turn(gate)]
        await settle()
        report = await gate.close(drain_timeout=0.05)
        assert report == admitgate.DrainReport(finished=0, still_running=2, queued_rejected=0)
        assert all(t.started and t.outcome is None for t in turns)
        turns[0].release.set()
        turns[1].release.set()
        await settle()
        assert [t.outcome for t in turns] == ["done", "done"]
        assert gate.in_flight == 0

    run(scenario())


def test_close_sync_from_a_thread_waits_for_async_turns():
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    reports: list[admitgate.DrainReport] = []

    async def scenario():
        turn = Turn(gate)
        await settle()
        closer = threading.Thread(target=lambda: reports.append(gate.close_sync(drain_timeout=5)))
        closer.start()
        await asyncio.sleep(0.05)
        assert not reports
        turn.release.set()
        await settle()
        await asyncio.to_thread(closer.join, 5)

    run(scenario())
    assert reports == [admitgate.DrainReport(1, 0, 0)]
    with pytest.raises(ValueError, match="drain_timeout"):
        gate.close_sync(drain_timeout=-1)
    with pytest.raises(TypeError, match="drain_timeout"):
        gate.close_sync(drain_timeout="soon")


# -- queue timeout ----------------------------------------------------------------------


def test_a_turn_waiting_past_the_queue_timeout_is_refused_and_leaves_no_trace():
    async def scenario():
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=1, queue_depth=5, queue_timeout_s=0.05
        )
        assert gate.queue_timeout_s == 0.05
        holder = Turn(gate)
        await settle()
        waiter = Turn(gate, transport="rest")
        await asyncio.sleep(0.15)
        assert waiter.outcome == "rejected:timeout"
        assert waiter.error.retry_after is not None and waiter.error.retry_after >= 1.0
        assert (gate.queued, gate.rejected) == (0, 1)
        assert gate.transport_stats()["rest"]["rejected"]["timeout"] == 1
        assert gate.transport_stats()["rest"]["queued"] == 0
        holder.release.set()
        await settle()
        assert conserved(gate) == 2

    run(scenario())


def test_a_callers_own_wait_for_counts_as_cancelled_not_timeout():
    async def scenario():
        gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=5)
        holder = Turn(gate)
        await settle()

        async def enter() -> None:
            async with gate.admit():
                pass

        with pytest.raises(asyncio.TimeoutError):  # asyncio.timeout() is 3.11+
            await asyncio.wait_for(enter(), 0.02)
        assert (gate.cancelled, gate.rejected) == (1, 0)
        holder.release.set()
        await settle()

    run(scenario())


@settings(max_examples=40, deadline=None)
@given(
    timeout_ms=st.integers(1, 8),
    hold_ms=st.lists(st.integers(0, 8), min_size=1, max_size=6),
    waiters=st.integers(1, 6),
)
def test_timeouts_racing_releases_grant_or_time_out_never_both(timeout_ms, hold_ms, waiters):
    async def scenario():
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=1, queue_depth=10, queue_timeout_s=timeout_ms / 1000
        )
        outcomes: list[str] = []
        running = 0
        peak = 0

        async def turn(hold: float) -> None:
            nonlocal running, peak
            try:
                async with gate.admit():
                    running += 1
                    peak = max(peak, running)
                    await asyncio.sleep(hold)
                    running -= 1
                outcomes.append("admitted")
            except admitgate.AdmissionRejected as exc:
                outcomes.append(exc.reason)

        holds = [h / 1000 for h in hold_ms]
        tasks = [turn(holds[i % len(holds)]) for i in range(waiters + 1)]
        await asyncio.gather(*tasks)
        await settle()
        assert peak == 1
        assert set(outcomes) <= {"admitted", "timeout"}
        assert gate.admitted == outcomes.count("admitted")
        assert gate.rejected == outcomes.count("timeout")
        assert conserved(gate) == len(outcomes) == waiters + 1
        assert (gate.in_flight, gate.queued) == (0, 0)

    run(scenario(), timeout=10)


# -- place in line ------------------------------------------------------------------------


def test_place_in_line_after_a_burst_across_tenants():
    async def scenario():
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=2, queue_depth=20, max_concurrent_runs_per_scope=2
        )
        calls: list[tuple[str, int, float | None]] = []
        holders = [Turn(gate, session_id="a"), Turn(gate, session_id="b")]
        await settle()
        # Some history for the release-rate estimator.
        holders[0].release.set()
        await settle()
        holders[0] = Turn(gate, session_id="a")
        await settle()
        waiting = []
        for i, tenant in enumerate(["a", "b", "c", "a", "c"]):
            waiting.append(
                Turn(
                    gate,
                    session_id=tenant,
                    on_queued=lambda p, e, i=i: calls.append((f"w{i}", p, e)),
                )
            )
        await settle()
        assert [c[1] for c in calls] == [0, 1, 2, 3, 4]
        assert [w.admission.position for w in waiting] == [0, 1, 2, 3, 4]
        assert all(c[2] is not None and c[2] >= 0 for c in calls)
        estimates = [w.admission.estimated_wait_s for w in waiting]
        assert estimates == sorted(estimates), "later turns wait longer"
        holders[1].release.set()
        await settle()
        assert waiting[0].started
        assert waiting[0].admission.position is None, "nothing is computed once it runs"
        assert [w.admission.position for w in waiting[1:]] == [0, 1, 2, 3]
        assert holders[0].admission.position is None
        for t in [*holders, *waiting]:
            t.release.set()
        await settle()
        assert conserved(gate) == 8

    run(scenario())


def test_no_estimated_wait_until_a_turn_of_the_gate_has_ended():
    """A gate that has just filled up has no release rate yet: its first waiters are told
    nothing (``None``), not the microseconds since its first sample (it said 1.4e-05 s)."""

    async def scenario():
        gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=4)
        calls: list[tuple[int, float | None]] = []
        holder = Turn(gate)
        await settle()
        first = Turn(gate, on_queued=lambda p, e: calls.append((p, e)))
        await settle()
        assert calls == [(0, None)]
        assert first.admission.estimated_wait_s is None
        holder.release.set()
        await settle()
        second = Turn(gate, on_queued=lambda p, e: calls.append((p, e)))
        await settle()
        assert calls[1][0] == 0 and calls[1][1] is not None, "a turn has ended: an estimate"
        for t in (first, second):
            t.release.set()
        await settle()
        assert conserved(gate) == 3

    run(scenario())


def test_on_queued_is_not_called_for_turns_that_do_not_wait_and_a_raising_one_loses_nothing():
    async def scenario():
        gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=2)
        calls = []
        first = Turn(gate, on_queued=lambda *a: calls.append(a))
        await settle()
        assert first.started and calls == []

        def broken(position, estimate):
            raise RuntimeError("bot offline")

        with pytest.raises(RuntimeError, match="bot offline"):
            async with gate.admit(on_queued=broken):
                pass
        assert (gate.queued, gate.cancelled) == (0, 1)
        with pytest.raises(TypeError, match="on_queued"):
            gate.admit(on_queued=5)
        first.release.set()
        await settle()

    run(scenario())


# -- sync API -------------------------------------------------------------------------------


def test_sync_and_async_turns_share_one_gate_from_several_threads():
    gate = admitgate.build_admission_gate(max_concurrent_runs=3, queue_depth=100)
    lock = threading.Lock()
    running = 0
    peak = 0
    done = 0

    def body() -> None:
        nonlocal running, peak, done
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.001)
        with lock:
            running -= 1
            done += 1

    def sync_worker() -> None:
        for _ in range(15):
            with gate.admit_sync(session_id="sync"):
                body()

    def async_worker() -> None:
        async def one() -> None:
            async with gate.admit(session_id="async"):
                body()
                await asyncio.sleep(0.001)

        async def main() -> None:
            await asyncio.gather(*(one() for _ in range(15)))

        asyncio.run(main())

    threads = [threading.Thread(target=sync_worker) for _ in range(3)]
    threads += [threading.Thread(target=async_worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert done == 75 and peak <= 3
    assert gate.admitted == 75 and gate.in_flight == 0 and gate.peak_in_flight <= 3


def test_admit_sync_on_a_loop_thread_raises_at_once():
    async def scenario():
        gate = admitgate.build_admission_gate(max_concurrent_runs=1)
        with pytest.raises(RuntimeError, match="event loop"):
            with gate.admit_sync():
                pass
        assert (gate.admitted, gate.in_flight) == (0, 0)

    run(scenario())


def test_admit_sync_timeout_and_queue_timeout_the_smaller_wins():
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=5, queue_timeout_s=10)
    with gate.admit_sync():
        t0 = time.monotonic()
        with pytest.raises(admitgate.AdmissionRejected) as info:
            with gate.admit_sync(timeout=0.05):
                pass
        waited = time.monotonic() - t0
    assert info.value.reason == "timeout" and 0.04 <= waited < 2
    assert (gate.admitted, gate.rejected, gate.queued) == (1, 1, 0)
    with pytest.raises(ValueError, match="timeout"):
        gate.admit_sync(timeout=0)


def test_admit_sync_wakes_when_an_async_turn_releases():
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=5)
    got: list[float] = []

    async def scenario():
        turn = Turn(gate)
        await settle()

        def blocked() -> None:
            t0 = time.monotonic()
            with gate.admit_sync():
                got.append(time.monotonic() - t0)

        worker = threading.Thread(target=blocked)
        worker.start()
        await asyncio.sleep(0.05)
        assert gate.queued == 1 and not got
        turn.release.set()
        await settle()
        await asyncio.to_thread(worker.join, 5)

    run(scenario())
    assert len(got) == 1 and gate.admitted == 2


# -- reconfiguration ------------------------------------------------------------------------


def test_reconfigure_validates_everything_before_changing_anything():
    gate = admitgate.build_admission_gate(max_concurrent_runs=2, queue_depth=4)
    before = gate.stats()
    with pytest.raises(ValueError, match="queue_depth"):
        gate.reconfigure(max_concurrent_runs=8, queue_depth=-1)
    with pytest.raises(ValueError, match="overflow_policy"):
        gate.reconfigure(max_concurrent_runs=8, overflow_policy="nope")
    with pytest.raises(ValueError, match="queue_timeout_s"):
        gate.reconfigure(queue_timeout_s=float("nan"))
    assert gate.stats() == before
    gate.reconfigure(queue_timeout_s=3)
    assert gate.queue_timeout_s == 3.0 and gate.max_concurrent_runs == 2
    assert gate.policy.queue_timeout_s == 3.0


def test_reconfigure_under_load_counters_exact_and_no_over_admission():
    async def scenario():
        gate = admitgate.build_admission_gate(max_concurrent_runs=4, queue_depth=10)
        turns = [Turn(gate) for _ in range(10)]
        await settle()
        assert (gate.in_flight, gate.queued) == (4, 6)
        # Lower: nobody is cancelled; new starts wait until in flight is below 2.
        gate.reconfigure(max_concurrent_runs=2)
        await settle()
        assert sum(t.started for t in turns) == 4
        for t in turns[:3]:
            t.release.set()
        await settle()
        assert gate.in_flight == 2, "one in, after three out: the new ceiling"
        # Raise: waiting turns start at once.
        gate.reconfigure(max_concurrent_runs=5)
        await settle()
        assert gate.in_flight == 5 and gate.queued == 2
        # Shrink the queue: the newest waiter past the new depth is refused.
        refused = gate.reconfigure(queue_depth=1)
        await settle()
        assert refused == 1 and turns[-1].outcome == "rejected:queue_full"
        assert gate.queued == 1
        assert gate.stats()["queue_depth"] == 1 and gate.stats()["max_concurrent_runs"] == 5
        for t in turns:
            t.release.set()
        await settle()
        assert conserved(gate) == 10 and gate.peak_in_flight == 5

    run(scenario())


def test_reconfigure_under_the_queue_policy_refuses_nobody_and_max_rss_mb_changes():
    async def scenario():
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=1, queue_depth=5, overflow_policy="queue"
        )
        turns = [Turn(gate) for _ in range(4)]
        await settle()
        assert gate.reconfigure(queue_depth=0) == 0 and gate.queued == 3
        gate.reconfigure(max_rss_mb=1_000_000)
        assert gate.stats()["max_rss_mb"] == 1_000_000.0
        assert gate._resource_policy.soft_rss_mb == pytest.approx(900_000.0)
        gate.reconfigure(max_rss_mb=0)
        assert gate.stats()["max_rss_mb"] == 0.0
        for t in turns:
            t.release.set()
        await settle()
        assert gate.admitted == 4

    run(scenario())


# -- per-tenant view --------------------------------------------------------------------------


def test_scope_stats_after_bursts_and_idle_tenants_are_forgotten():
    async def scenario():
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=10, queue_depth=10, max_concurrent_runs_per_scope=2
        )
        noisy = [Turn(gate, session_id="noisy") for _ in range(5)]
        quiet = Turn(gate, session_id="quiet")
        await settle()
        assert gate.scope_stats() == {
            "noisy": {"in_flight": 2, "queued": 3},
            "quiet": {"in_flight": 1, "queued": 0},
        }
        for t in [*noisy, quiet]:
            t.release.set()
        await settle()
        assert gate.scope_stats() == {}
        off = admitgate.build_admission_gate(max_concurrent_runs=2)
        async with off.admit(session_id="x"):
            assert off.scope_stats() == {}

    run(scenario())


def test_a_closed_gate_refuses_even_when_it_has_no_limits():
    async def scenario():
        gate = admitgate.AdmissionGate(None)  # no ceiling, no memory policy: counts nothing
        async with gate.admit():
            pass
        report = await gate.close(drain_timeout=0)
        assert report == admitgate.DrainReport(0, 0, 0)
        with pytest.raises(admitgate.AdmissionRejected) as info:
            async with gate.admit():
                pass
        assert info.value.reason == "closing" and gate.rejected == 1

    run(scenario())
