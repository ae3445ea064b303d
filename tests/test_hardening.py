"""Regression tests for the core hardening (issue 8): each test fails on the build before the
fix and passes after it. Each docstring names the defect and what must happen now."""

from __future__ import annotations

import asyncio
import copy
import gc
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import admitgate
import pytest
from conftest import FakeSampler, run, settle


def soft_gate(depth: int, overflow: str = "reject", ceiling: int = 4):
    """A gate with max_rss_mb=1000 whose sampler reads 950 MiB (95%: soft pressure)."""
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=ceiling,
        queue_depth=depth,
        overflow_policy=overflow,
        resource_policy=admitgate.build_memory_pressure_policy(max_rss_mb=1000),
    )
    assert gate is not None
    sampler = FakeSampler(950.0, sample_cls=admitgate.ResourceSample)
    gate._resource_sampler = sampler
    return gate, sampler


class Turn:
    """A turn held open until released, recording how it ended."""

    def __init__(self, gate, name: str, **admit) -> None:
        self.release = asyncio.Event()
        self.started = False
        self.outcome: str | None = None
        self.error: BaseException | None = None
        self.task = asyncio.get_running_loop().create_task(self._run(gate, admit))

    async def _run(self, gate, admit) -> None:
        try:
            async with gate.admit(**admit):
                self.started = True
                await self.release.wait()
            self.outcome = "done"
        except admitgate.AdmissionRejected as exc:
            self.outcome, self.error = f"rejected:{exc.reason}", exc
        except asyncio.CancelledError:
            self.outcome = "cancelled"
            raise


def test_soft_pressure_with_an_empty_queue_waits_instead_of_refusing():
    """Defect 1: with queue_depth=0 and one turn running, soft pressure refused a second turn
    with `queue_full` (the queue was empty). It now waits outside the depth."""

    async def scenario():
        gate, sampler = soft_gate(depth=0)
        sampler.rss_mb = 100.0
        a = Turn(gate, "a")
        await settle()
        sampler.rss_mb = 950.0
        b = Turn(gate, "b")
        await settle()
        assert a.started and not b.started and b.outcome is None
        assert (gate.rejected, gate.queued) == (0, 1)
        a.release.set()
        await settle()
        assert b.started, "the released slot goes to the held-back turn"
        b.release.set()
        await settle()
        assert (gate.admitted, gate.rejected, gate.in_flight) == (2, 0, 0)

    run(scenario())


def test_soft_pressure_never_refuses_while_slots_are_free():
    """Defect 1: with queue_depth=2, one turn running and soft pressure, two of four arrivals
    were refused while three slots were free. Now three wait outside the depth (never more
    than the free slots), the fourth meets the queue as it would without pressure, and the
    overflow policy applies only past that."""

    async def scenario():
        gate, sampler = soft_gate(depth=2)
        sampler.rss_mb = 100.0
        first = Turn(gate, "first")
        await settle()
        sampler.rss_mb = 950.0
        turns = [Turn(gate, f"t{i}") for i in range(4)]
        await settle()
        assert [t.outcome for t in turns] == [None] * 4
        assert (gate.rejected, gate.queued, gate.in_flight) == (0, 4, 1)
        extra = [Turn(gate, "x1"), Turn(gate, "x2")]
        await settle()
        # The depth (2) counts only the fourth turn and x1: x2 overflows.
        assert [t.outcome for t in extra] == [None, "rejected:queue_full"]
        assert extra[1].error.retry_after is not None
        sampler.rss_mb = 100.0  # pressure eases: held-back turns fill the free slots in order
        probe = Turn(gate, "probe")
        await settle()
        assert [t.started for t in turns] == [True, True, True, False]
        assert not probe.started
        for t in [first, *turns, extra[0], probe]:
            t.release.set()
        await settle()
        assert gate.in_flight == 0 and gate.queued == 0
        assert gate.admitted + gate.rejected + gate.shed + gate.cancelled == 8

    run(scenario())


def test_memory_pressure_reason_means_the_hard_threshold_only():
    """Defect 1: `memory_pressure` is the hard threshold; soft pressure refuses nobody."""

    async def scenario():
        gate, sampler = soft_gate(depth=0, ceiling=1)
        sampler.rss_mb = 1200.0
        t = Turn(gate, "hard")
        await settle()
        assert t.outcome == "rejected:memory_pressure"
        assert t.error.retry_after == 5.0

    run(scenario())


class SlowEnabledPolicy:
    """A custom resource policy whose `enabled` property releases the GIL (a sleep)."""

    hard_rss_mb = 1000.0

    def __init__(self) -> None:
        self.calls = 0

    @property
    def enabled(self) -> bool:
        self.calls += 1
        time.sleep(0.05)
        return True

    def evaluate(self, sample):
        return admitgate.AdmissionDecision.ADMIT


def test_no_deadlock_between_a_gil_releasing_policy_and_a_sampler_swap():
    """Defect 2: a Rust lock was held while a custom policy's `enabled` ran; a thread setting
    `gate._resource_sampler` waited for that lock holding the GIL, and the process hung."""
    gate = admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=2),
        resource_policy=SlowEnabledPolicy(),
        resource_sampler=FakeSampler(10.0, sample_cls=admitgate.ResourceSample),
    )
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            gate.enabled  # noqa: B018 - reads the policy's property
            gate.stats()

    def writer() -> None:
        for _ in range(40):
            gate._resource_sampler = FakeSampler(10.0, sample_cls=admitgate.ResourceSample)

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    threads.append(threading.Thread(target=writer, daemon=True))
    for t in threads:
        t.start()
    threads[-1].join(timeout=20)
    stop.set()
    for t in threads[:-1]:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "deadlock: a thread never finished"


def test_sync_human_wait_on_the_loop_thread_does_not_lend():
    """Defect 3: with a ceiling of 1, a turn entering HUMAN_WAIT_SCOPE synchronously on its
    own loop thread lent its slot to a waiter on that same (blocked) loop; on resume it
    borrowed, and two bodies ran at once. Now nothing is lent there (as in the reference);
    a sync wait on a worker thread still lends."""
    from praisonaiagents.approval.registry import HUMAN_WAIT_SCOPE

    async def scenario():
        gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=4)
        running = 0
        peak = 0
        entered = asyncio.Event()

        async def approver():
            nonlocal running, peak
            async with gate.admit():
                running += 1
                peak = max(peak, running)
                wait = HUMAN_WAIT_SCOPE.get()()
                with wait:  # sync, on the loop thread
                    entered.set()
                    await asyncio.sleep(0.05)
                running -= 1

        async def other():
            nonlocal running, peak
            await entered.wait()
            async with gate.admit():
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(0)
                running -= 1

        await asyncio.gather(approver(), other())
        assert peak == 1
        assert gate.peak_in_flight == 1
        assert (gate.in_flight, gate.awaiting_human) == (0, 0)

        # On a worker thread the slot is lent (someone on the loop can use it).
        async with gate.admit():
            wait = HUMAN_WAIT_SCOPE.get()()
            await asyncio.to_thread(wait.__enter__)
            assert (gate.in_flight, gate.awaiting_human) == (0, 1)
            await asyncio.to_thread(wait.__exit__, None, None, None)
            assert (gate.in_flight, gate.awaiting_human) == (1, 0)

    run(scenario())


@pytest.mark.parametrize("after", ["close", "throw"])
def test_closing_a_completed_wait_keeps_the_slot_returnable(after):
    """Defect 4: close() or throw() on a Wait that had already completed overwrote the
    admission's state, so __aexit__ returned nothing and a ceiling-1 gate was dead."""

    async def scenario():
        gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=1)
        holder = Turn(gate, "holder")
        await settle()
        admission = gate.admit()
        wait = admission.__aenter__()
        fut = asyncio.ensure_future(wait)
        await settle()
        holder.release.set()
        await fut  # granted: the admission holds the slot
        assert admission.active
        if after == "close":
            wait.close()
        else:
            with pytest.raises(ValueError):
                wait.throw(ValueError("late"))
        assert admission.active
        await admission.__aexit__(None, None, None)
        assert gate.in_flight == 0
        async with gate.admit():  # the gate is alive
            pass
        assert gate.admitted == 3

    run(scenario())


class BrokenLimitPolicy:
    """A custom policy whose limit property raises something other than AttributeError."""

    queue_depth = 0
    overflow_policy = "reject"
    max_concurrent_runs_per_scope = 0

    @property
    def max_concurrent_runs(self):
        raise RuntimeError("config service down")

    def decide(self, **facts):
        return admitgate.AdmissionDecision.ADMIT


class BrokenOverflowPolicy(BrokenLimitPolicy):
    max_concurrent_runs = 2

    @property
    def overflow_policy(self):
        raise KeyError("overflow")


@pytest.mark.parametrize(
    ("policy", "attr"),
    [(BrokenLimitPolicy(), "max_concurrent_runs"), (BrokenOverflowPolicy(), "overflow_policy")],
)
def test_a_broken_policy_property_fails_at_construction(policy, attr):
    """Defect 5: a property raising something other than AttributeError silently gave a gate
    with enabled=False (or `reject`). The reference raises at construction; so does admitgate,
    naming the attribute."""
    with pytest.raises(ValueError, match=attr) as info:
        admitgate.AdmissionGate(policy)
    assert isinstance(info.value.__cause__, (RuntimeError, KeyError))


def test_an_evicted_waiter_cancelled_before_it_resumes_counts_as_cancelled():
    """Defect 6: a waiter evicted by shed_oldest whose task was cancelled before it resumed saw
    CancelledError yet counted in `shed`. It now counts as cancelled."""

    async def scenario():
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=1, queue_depth=1, overflow_policy="shed_oldest"
        )
        holder = Turn(gate, "holder")
        await settle()
        victim = Turn(gate, "victim")
        await settle()
        assert gate.queued == 1
        newcomer = Turn(gate, "newcomer")
        await asyncio.sleep(0)  # the newcomer evicts; the victim has not resumed yet
        victim.task.cancel()
        await settle()
        assert victim.outcome == "cancelled"
        assert (gate.shed, gate.cancelled) == (0, 1)
        holder.release.set()
        newcomer.release.set()
        await settle()
        assert gate.admitted + gate.rejected + gate.shed + gate.cancelled == 3

    run(scenario())


def test_random_cancellations_keep_rejections_equal_to_what_callers_saw():
    """Defect 6: under random cancellations, rejected + shed drifted from the refusals callers
    actually received. Now the counters equal the callers' outcomes exactly."""
    import random

    rng = random.Random(8)

    async def scenario():
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=2, queue_depth=3, overflow_policy="shed_oldest"
        )
        outcomes: list[str] = []

        async def turn():
            started = False
            try:
                async with gate.admit():
                    started = True
                    await asyncio.sleep(rng.random() * 0.002)
                outcomes.append("admitted")
            except admitgate.AdmissionRejected as exc:
                outcomes.append(exc.reason)
            except asyncio.CancelledError:
                outcomes.append("admitted" if started else "cancelled")

        tasks = []
        for _ in range(600):
            tasks.append(asyncio.ensure_future(turn()))
            if rng.random() < 0.3:
                rng.choice(tasks).cancel()
            if rng.random() < 0.5:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks, return_exceptions=True)
        await settle()
        # A turn cancelled after it started counts as admitted; one cancelled while queued
        # (or after an eviction or grant it never saw) as cancelled.
        # (A task cancelled before its first step never reached the gate: no outcome.)
        assert gate.admitted + gate.rejected + gate.shed + gate.cancelled == len(outcomes)
        assert gate.rejected == outcomes.count("queue_full")
        assert gate.shed == outcomes.count("shed")
        assert gate.admitted == outcomes.count("admitted")
        assert gate.cancelled == outcomes.count("cancelled")

    run(scenario(), timeout=30)


def test_the_first_turn_does_not_change_the_applications_logging():
    """Defect 7: the first admitted turn imported praisonaiagents, whose import reconfigures
    the root logger, so admitgate's INFO rejection logs vanished mid-run. The binding is now
    resolved when the gate is built."""
    code = textwrap.dedent(
        """
        import asyncio, logging, admitgate
        gate = admitgate.build_admission_gate(max_concurrent_runs=1)
        logging.getLogger().setLevel(logging.INFO)   # the application configures logging
        async def main():
            async with gate.admit():
                pass
        asyncio.run(main())
        print(logging.getLogger().level)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split()[-1] == str(20), out.stdout + out.stderr


@pytest.mark.parametrize("awaitable", ["ready", "wait"])
def test_throw_follows_the_generator_protocol(awaitable):
    """Defect 8: throw(type, value) wrapped the exception again (ValueError(ValueError(...)))
    and throw(Cls) built Cls(None). A generator raises the same object, and Cls()."""

    async def make():
        gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=2)
        if awaitable == "ready":
            return gate.admit().__aenter__()
        async with gate.admit():
            return gate.admit().__aenter__()

    async def scenario():
        original = ValueError("original")
        with pytest.raises(ValueError) as info:
            (await make()).throw(ValueError, original)
        assert info.value is original
        with pytest.raises(KeyError) as info2:
            (await make()).throw(KeyError)
        assert info2.value.args == ()
        with pytest.raises(KeyError) as info3:
            (await make()).throw(KeyError, "k")
        assert info3.value.args == ("k",)
        with pytest.raises(OSError) as info4:
            (await make()).throw(OSError, (2, "missing"))
        assert info4.value.errno == 2
        inst = RuntimeError("as is")
        with pytest.raises(RuntimeError) as info5:
            (await make()).throw(inst)
        assert info5.value is inst
        with pytest.raises(TypeError):
            (await make()).throw(inst, "extra")

    run(scenario())


def test_reference_cycles_through_the_gate_are_collected():
    """Defect 9: the pyclasses holding Python objects had no __traverse__, so a gate whose
    policy referred back to it leaked. Gates, policies and admissions support weak refs."""

    class SelfAwarePolicy(admitgate.ConcurrencyLimitPolicy):
        pass

    policy = SelfAwarePolicy(max_concurrent_runs=2)
    gate = admitgate.AdmissionGate(policy)
    policy.gate = gate  # a cycle: gate -> policy -> gate
    admission = gate.admit(session_id="a")
    refs = [weakref.ref(gate), weakref.ref(policy), weakref.ref(admission)]
    del policy, gate, admission
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


DECIDED: list[int] = []


class CustomPolicy(admitgate.ConcurrencyLimitPolicy):
    """A PraisonAI-style customisation: decide overridden in Python."""

    def decide(self, **facts):
        DECIDED.append(facts["in_flight"])
        return super().decide(**facts)


def test_policies_can_be_subclassed_pickled_and_copied():
    """Defect 10: ConcurrencyLimitPolicy and MemoryPressurePolicy could not be subclassed
    (PraisonAI users customise decide that way), pickled or deep-copied."""
    DECIDED.clear()
    custom = CustomPolicy(max_concurrent_runs=3, queue_depth=1)
    custom.note = "kept"

    async def scenario():
        gate = admitgate.AdmissionGate(custom)
        async with gate.admit():
            pass

    run(scenario())
    assert DECIDED == [0], "the gate calls the subclass's decide"
    for policy in (
        admitgate.ConcurrencyLimitPolicy(4, 8, "shed_oldest", 2),
        admitgate.MemoryPressurePolicy(soft_rss_mb=900, hard_rss_mb=1000),
        custom,
    ):
        for clone in (pickle.loads(pickle.dumps(policy)), copy.deepcopy(policy), copy.copy(policy)):
            assert type(clone) is type(policy)
            assert repr(clone) == repr(policy)
    assert pickle.loads(pickle.dumps(custom)).note == "kept"


def test_non_str_session_ids_are_keyed_by_str():
    """Defect 10: admit(session_id=12345) raised where the reference runs the turn. Any id is
    accepted and keyed by str(session_id): 12345 and "12345" are one tenant."""

    async def scenario():
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=4, queue_depth=4, max_concurrent_runs_per_scope=1
        )
        a = Turn(gate, "int", session_id=12345)
        await settle()
        b = Turn(gate, "str", session_id="12345")
        await settle()
        assert a.started and not b.started, "same tenant: the second waits in its lane"
        c = Turn(gate, "none", session_id=None)
        await settle()
        assert c.started
        for t in (a, b, c):
            t.release.set()
        await settle()
        assert gate.admitted == 3

    run(scenario())


def test_getters_and_setters_contain_panics():
    """Defect 10: every entry point catches Rust panics (getters and setters included), so
    none can abort the interpreter; they raise admitgate.InternalError. A getter cannot be
    made to panic from Python, so this checks the gate-lock panic hook and that every getter
    still answers afterwards."""
    from admitgate._admitgate import _panic_inside_gate

    gate = admitgate.build_admission_gate(max_concurrent_runs=2)
    with pytest.raises(admitgate.InternalError):
        _panic_inside_gate(gate)
    for name in (
        "in_flight",
        "queued",
        "admitted",
        "rejected",
        "shed",
        "cancelled",
        "awaiting_human",
        "peak_in_flight",
        "oldest_wait_seconds",
        "enabled",
        "saturated",
        "max_concurrent_runs",
        "policy",
    ):
        getattr(gate, name)
    gate._resource_sampler = None


@pytest.mark.parametrize("released_from", ["loop thread", "worker thread"])
def test_a_panic_in_the_middle_of_a_hand_off_strands_nobody(caplog, released_from):
    """Issue 8, "the panic test proves too little": panic in the middle of a state change,
    after the gate granted a waiter its slot and before the waiter heard of it (a test hook
    makes the next wake-up panic). The waiter is withdrawn and its slot goes to the next
    one, the releasing caller is not hurt, the counters say what callers experienced, and
    the gate keeps serving."""
    from admitgate._admitgate import _panic_in_next_wakes

    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1, queue_depth=4, overflow_policy="queue"
    )
    ran: list[str] = []

    async def turn(name: str, hold: asyncio.Event | threading.Event | None = None) -> None:
        async with gate.admit(session_id=name):
            ran.append(name)
            if isinstance(hold, asyncio.Event):
                await hold.wait()

    def held_in_thread(release: threading.Event) -> None:
        with gate.admit_sync(session_id="first"):
            ran.append("first")
            release.wait(5)

    async def main() -> None:
        release: asyncio.Event | threading.Event
        if released_from == "loop thread":
            release = asyncio.Event()
            first = asyncio.ensure_future(turn("first", release))
        else:
            release = threading.Event()
            first = asyncio.ensure_future(asyncio.to_thread(held_in_thread, release))
        while gate.in_flight == 0:
            await asyncio.sleep(0.001)
        waiters = {name: asyncio.ensure_future(turn(name)) for name in ("b", "c", "d")}
        await settle()
        assert gate.queued == 3
        _panic_in_next_wakes(1)
        release.set()
        await first  # the releasing turn ends normally
        await asyncio.wait_for(asyncio.gather(waiters["c"], waiters["d"]), 5)
        # b's wake-up panicked: it never heard of its slot, and was withdrawn.
        assert not waiters["b"].done()
        waiters["b"].cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiters["b"]
        await turn("e")

    with caplog.at_level("ERROR", logger="admitgate"):
        run(main(), timeout=10.0)
    _panic_in_next_wakes(0)
    assert ran == ["first", "c", "d", "e"]
    assert (gate.in_flight, gate.queued) == (0, 0)
    assert (gate.admitted, gate.cancelled, gate.rejected, gate.shed) == (4, 1, 0, 0)
    assert any("internal error while waking" in r.getMessage() for r in caplog.records)
