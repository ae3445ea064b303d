"""The controller against its rules: a stateful (model-based) test of overload control.

Hypothesis drives a real ``AdmissionGate`` with ``adaptive=`` and ``queue_discipline="adaptive"``
through its public API, on one event loop, with random sequences of arrivals (with and without
``deadline_s``), turns that end served or throttled (``report_throttled`` with no
``Retry-After``, 0, or a hold), ``reconfigure(max_concurrent_runs=...)`` both ways, and the clock
moving on. After every step it checks, at the gate, what docs/overload.md promises:

* the limit stays within ``[min_limit, max_concurrent_runs]`` as reconfigured;
* a ``Retry-After`` holds growth: while one runs, the limit never rises;
* a waiting turn's deadline: refused within a tick of becoming infeasible (less of it left
  than a turn takes, at the gate's estimate, which this model follows as the gate does), and
  never granted once its deadline has passed;
* no slot stays idle while an eligible waiter waits (none is held back here: no tenants, no
  memory pressure);
* counters add up: ``admitted + rejected + cancelled`` is every settled arrival, ``in_flight``
  and ``queued`` are the turns the model sees running and waiting;
* every refusal is a documented one (``deadline``, ``timeout``, ``queue_full``).

The gate reads the real monotonic clock (the binding has no other), so "a tick" is a bound
with room for a loaded machine (:data:`TICK`), and the clock moves by sleeping on the loop.
Seeded and bounded: profile ``ci`` (the default) runs 25 examples of 30 steps;
``HYPOTHESIS_PROFILE=long`` runs 300.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from _stateful import PROFILE, stateful_settings
from admitgate import AdaptiveLimit, AdmissionGate, AdmissionRejected, build_admission_gate
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

#: How late a refusal or a grant may be seen, on a shared, loaded machine.
TICK = 0.06
#: The service-time estimate's weight per turn (crates/core/src/overload/service_time.rs).
WEIGHT = 1.0 / 8.0
DOCUMENTED = {"deadline", "timeout", "queue_full"}

SETTINGS = stateful_settings(ci=(25, 30), long=(300, 40), debug=(300, 40), derandomize_ci=True)


@dataclass
class Turn:
    """One arrival, as the model follows it."""

    arrived: float
    deadline: float | None  # absolute, on time.monotonic()
    release: asyncio.Event = field(default_factory=asyncio.Event)
    throttle: tuple[bool, float | None] = (False, None)
    started: float | None = None
    began_running: float | None = None
    ended: float | None = None
    outcome: str | None = None  # "done", "rejected:<reason>", "cancelled"
    task: asyncio.Task[None] | None = None


class ControllerModel(RuleBasedStateMachine):
    @initialize(
        max_runs=st.integers(2, 6),
        min_limit=st.integers(1, 2),
        depth=st.integers(2, 8),
    )
    def build(self, max_runs: int, min_limit: int, depth: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.max_runs = max_runs
        self.min_limit = min_limit
        gate = build_admission_gate(
            max_concurrent_runs=max_runs,
            queue_depth=depth,
            adaptive=AdaptiveLimit(min_limit=min_limit, initial_limit=max_runs),
            queue_discipline="adaptive",
        )
        assert gate is not None
        self.gate: AdmissionGate = gate
        self.turns: list[Turn] = []
        self.estimate: float | None = None  # the service time, as the gate keeps it
        self.hold_until = 0.0
        self.last_limit = self.gate.limit

    def teardown(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is None:
            return
        for turn in self.turns:
            turn.release.set()
        pending = [t.task for t in self.turns if t.task is not None and not t.task.done()]
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=5))
        loop.close()

    # -- driving -------------------------------------------------------------------------

    async def _turn(self, turn: Turn, deadline_s: float | None) -> None:
        try:
            async with self.gate.admit(deadline_s=deadline_s) as admission:
                turn.started = time.monotonic()
                await turn.release.wait()
                throttled, retry_after = turn.throttle
                if throttled:
                    assert admission is not None  # an adaptive gate hands `as turn` its turn
                    admission.report_throttled(retry_after)
            turn.outcome = "done"
        except AdmissionRejected as err:
            turn.outcome = f"rejected:{err.reason}"
        except asyncio.CancelledError:
            turn.outcome = "cancelled"
        turn.ended = time.monotonic()

    def _settle(self, seconds: float = 0.003) -> None:
        """Lets the loop run what is ready: woken waiters claim their slots."""

        async def settle() -> None:
            for _ in range(5):
                await asyncio.sleep(0)
            await asyncio.sleep(seconds)
            for _ in range(5):
                await asyncio.sleep(0)

        self.loop.run_until_complete(settle())

    def running(self) -> list[Turn]:
        return [t for t in self.turns if t.started is not None and t.outcome is None]

    def waiting(self) -> list[Turn]:
        return [t for t in self.turns if t.started is None and t.outcome is None]

    # -- rules ---------------------------------------------------------------------------

    @rule(
        deadline_s=st.none() | st.sampled_from([0.02, 0.05, 0.1, 0.2, 0.4, 1.0]),
        n=st.integers(1, 3),
    )
    def arrive(self, deadline_s: float | None, n: int) -> None:
        for _ in range(n):
            now = time.monotonic()
            turn = Turn(arrived=now, deadline=None if deadline_s is None else now + deadline_s)
            turn.task = self.loop.create_task(self._turn(turn, deadline_s))
            self.turns.append(turn)
        self._settle()

    # No preconditions on what runs or waits: that depends on the real clock, and a rule
    # enabled in one run and not in its replay would make hypothesis' replays diverge. A rule
    # with nothing to act on does nothing.
    @rule(
        which=st.integers(0, 10),
        outcome=st.sampled_from(["served", "served", "throttled", "retry0", "hold"]),
        took=st.sampled_from([0.0, 0.01, 0.03]),
    )
    def finish(self, which: int, outcome: str, took: float) -> None:
        if took:
            self.loop.run_until_complete(asyncio.sleep(took))
        running = self.running()
        if not running:
            return
        turn = running[which % len(running)]
        throttle = {
            "served": (False, None),
            "throttled": (True, None),
            "retry0": (True, 0.0),
            "hold": (True, 0.3),
        }[outcome]
        turn.throttle = throttle
        turn.release.set()
        ended = time.monotonic()
        self._settle()
        if not throttle[0] and turn.started is not None:
            duration = ended - turn.started
            self.estimate = (
                duration
                if self.estimate is None
                else self.estimate + WEIGHT * (duration - self.estimate)
            )
        if throttle[1]:
            self.hold_until = max(self.hold_until, ended + throttle[1])
        self.last_limit = self.gate.limit

    @rule(max_runs=st.integers(1, 8))
    def reconfigure(self, max_runs: int) -> None:
        if max_runs < self.min_limit:
            max_runs = self.min_limit
        self.gate.reconfigure(max_concurrent_runs=max_runs)
        self.max_runs = max_runs
        self._settle()
        self.last_limit = self.gate.limit

    @rule(seconds=st.sampled_from([0.005, 0.02, 0.05, 0.1]))
    def tick(self, seconds: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))
        self._settle()

    @rule(which=st.integers(0, 10))
    def leave(self, which: int) -> None:
        """A waiting caller gives up (its task is cancelled)."""
        waiting = self.waiting()
        if not waiting:
            return
        turn = waiting[which % len(waiting)]
        assert turn.task is not None
        turn.task.cancel()
        self._settle()

    # -- the rules of docs/overload.md ----------------------------------------------------

    @invariant()
    def the_limit_stays_within_its_bounds(self) -> None:
        if not hasattr(self, "gate"):
            return
        limit = self.gate.limit
        assert min(self.min_limit, self.max_runs) <= limit <= self.max_runs, (
            limit,
            self.min_limit,
            self.max_runs,
        )
        assert self.gate.stats()["limit"] == limit

    @invariant()
    def a_retry_after_holds_growth(self) -> None:
        if not hasattr(self, "gate"):
            return
        limit = self.gate.limit
        if time.monotonic() < self.hold_until - TICK:
            assert limit <= self.last_limit, ("grew during a Retry-After", limit, self.last_limit)
        self.last_limit = limit

    @invariant()
    def no_slot_idle_while_a_waiter_waits(self) -> None:
        if not hasattr(self, "gate"):
            return
        stats = self.gate.stats()
        if stats["queued"] > 0:
            assert stats["in_flight"] >= stats["limit"], stats

    @invariant()
    def deadlines_are_kept(self) -> None:
        if not hasattr(self, "gate"):
            return
        now = time.monotonic()
        for turn in self.turns:
            if turn.deadline is None:
                continue
            if turn.started is not None:
                # Granted only while its deadline could still be met.
                assert turn.started <= turn.deadline + TICK, ("granted past its deadline", turn)
            elif turn.outcome is None:
                left = turn.deadline - now
                assert left > -TICK, ("still waiting past its deadline", left)
                if self.estimate is not None:
                    # Infeasible at the estimate since more than a tick: should be refused.
                    assert left > self.estimate / 2 - TICK, (
                        "still waiting with too little of its deadline left",
                        left,
                        self.estimate,
                    )

    @invariant()
    def counters_add_up_and_every_refusal_is_documented(self) -> None:
        if not hasattr(self, "gate"):
            return
        stats = self.gate.stats()
        settled = [t.outcome for t in self.turns if t.outcome is not None]
        admitted = sum(1 for t in self.turns if t.started is not None)
        rejected = [o for o in settled if o.startswith("rejected:")]
        cancelled = sum(1 for o in settled if o == "cancelled")
        assert {r.split(":", 1)[1] for r in rejected} <= DOCUMENTED, rejected
        assert stats["admitted"] == admitted, (stats, admitted)
        assert stats["cancelled"] == cancelled, (stats, cancelled)
        assert stats["shed"] == 0
        # A waiter the gate has just granted or refused (a timer may fire in the very last
        # loop iteration before this check) has not seen it yet: the model still counts it
        # waiting while the gate counts it running or rejected. So the gate is at or past the
        # model, and every arrival is in exactly one place on both sides.
        waiting, running = len(self.waiting()), len(self.running())
        assert stats["rejected"] >= len(rejected) and stats["queued"] <= waiting, (stats, rejected)
        assert stats["in_flight"] >= running, stats
        assert (
            stats["rejected"] + stats["queued"] + stats["in_flight"]
            == len(rejected) + waiting + running
        ), (stats, rejected, waiting, running)


ControllerModel.TestCase.settings = SETTINGS
test_the_controller_against_its_rules = ControllerModel.TestCase


# -- the fleet variant: one learned limit, a Retry-After held fleet-wide ------------------------


class FleetControllerModel(RuleBasedStateMachine):
    """Two replicas (gates with their own ``FleetLimit`` on one key of a real redis-server),
    ``adaptive=``: the fleet's learned value stays within ``[min_limit, max_in_flight]`` and
    never rises while a ``Retry-After`` seen by either replica runs; counters add up on each."""

    url = ""  # set by the test function, from the session's redis-server

    @initialize(cap=st.integers(3, 8))
    def build(self, cap: int) -> None:
        import uuid

        import redis
        from admitgate import FleetLimit

        self.loop = asyncio.new_event_loop()
        self.cap = cap
        self.key = f"model:{uuid.uuid4().hex[:12]}"
        self.redis = redis.Redis.from_url(self.url, decode_responses=True)
        self.gates: list[AdmissionGate] = []
        for name in ("a", "b"):
            gate = build_admission_gate(
                max_concurrent_runs=cap,
                queue_depth=16,
                adaptive=AdaptiveLimit(initial_limit=cap),
                fleet=FleetLimit(self.url, self.key, cap, replica_id=name, lease_ttl_s=3.0),
            )
            assert gate is not None
            self.gates.append(gate)
        self.turns: list[tuple[int, Turn]] = []
        self.hold_until = 0.0
        self.last_learned: int | None = None

    def teardown(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is None:
            return
        for _, turn in self.turns:
            turn.release.set()
        pending = [t.task for _, t in self.turns if t.task is not None and not t.task.done()]
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=5))

        async def shutdown() -> None:
            for gate in self.gates:
                assert gate.fleet is not None
                await gate.fleet.shutdown()

        loop.run_until_complete(shutdown())
        loop.close()

    def learned(self) -> int | None:
        value = self.redis.hget(f"{{{self.key}}}:learned", "limit")
        return None if value is None else int(value)

    async def _turn(self, gate: AdmissionGate, turn: Turn) -> None:
        try:
            async with gate.admit() as admission:
                turn.started = time.monotonic()
                await turn.release.wait()
                throttled, retry_after = turn.throttle
                if throttled:
                    assert admission is not None
                    admission.report_throttled(retry_after)
            turn.outcome = "done"
        except AdmissionRejected as err:
            turn.outcome = f"rejected:{err.reason}"
        turn.ended = time.monotonic()

    def _settle(self, seconds: float = 0.01) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))

    def running(self) -> list[tuple[int, Turn]]:
        return [(g, t) for g, t in self.turns if t.started is not None and t.outcome is None]

    @rule(replica=st.integers(0, 1), n=st.integers(1, 4))
    def arrive(self, replica: int, n: int) -> None:
        for _ in range(n):
            turn = Turn(arrived=time.monotonic(), deadline=None)
            turn.task = self.loop.create_task(self._turn(self.gates[replica], turn))
            self.turns.append((replica, turn))
        self._settle()

    @rule(
        which=st.integers(0, 10),
        outcome=st.sampled_from(["served", "served", "served", "throttled", "hold"]),
    )
    def finish(self, which: int, outcome: str) -> None:
        running = self.running()
        if not running:
            return
        _, turn = running[which % len(running)]
        turn.throttle = {
            "served": (False, None),
            "throttled": (True, None),
            "hold": (True, 1.0),
        }[outcome]
        turn.release.set()
        if outcome == "hold":
            # The hold ends a second after the replica proposed it (server clock); from when
            # the fleet's value reflects it, no raise may land before then.
            self.hold_until = max(self.hold_until, time.monotonic() + 1.0)
        self._settle(0.03)
        self.last_learned = self.learned()

    @rule(seconds=st.sampled_from([0.02, 0.1, 0.3]))
    def tick(self, seconds: float) -> None:
        self._settle(seconds)

    @invariant()
    def the_fleets_value_stays_within_its_bounds_and_holds_during_a_retry_after(self) -> None:
        if not hasattr(self, "gates"):
            return
        learned = self.learned()
        if learned is not None:
            assert 1 <= learned <= self.cap, (learned, self.cap)
            if time.monotonic() < self.hold_until - TICK and self.last_learned is not None:
                assert learned <= self.last_learned, (
                    "the fleet's value rose during a Retry-After",
                    learned,
                    self.last_learned,
                )
        self.last_learned = learned

    @invariant()
    def counters_add_up_on_each_replica(self) -> None:
        if not hasattr(self, "gates"):
            return
        for index, gate in enumerate(self.gates):
            mine = [t for g, t in self.turns if g == index]
            stats = gate.stats()
            settled = [t.outcome for t in mine if t.outcome is not None]
            rejected = [o for o in settled if o.startswith("rejected:")]
            assert {r.split(":", 1)[1] for r in rejected} <= DOCUMENTED, rejected
            assert stats["admitted"] == sum(1 for t in mine if t.started is not None), stats
            assert stats["rejected"] == len(rejected), stats
            running = sum(1 for t in mine if t.started is not None and t.outcome is None)
            assert stats["in_flight"] >= running, stats


def test_the_fleets_learned_limit_against_its_rules(redis_server: Any) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    FleetControllerModel.url = redis_server.url
    run_state_machine_as_test(
        FleetControllerModel,
        settings=settings(
            SETTINGS,
            max_examples=8 if PROFILE == "ci" else 60,
            stateful_step_count=20,
        ),
    )
