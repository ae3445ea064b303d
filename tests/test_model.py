"""Stateful model test: the real gate against a small pure-Python model of its documented rules.

Hypothesis drives ``admitgate.AdmissionGate`` through its public Python API with random
sequences of arrivals (with or without a scope, under random memory readings), completions,
exceptions and cancellations in running bodies, cancellations of queued turns,
``_shed_oldest_waiter()`` evictions and human-approval waits (entered and left through
praisonaiagents' ``HUMAN_WAIT_SCOPE`` hook, sync and async). After every step the gate's
counters and the fate of every turn (running, parked on a human, waiting, rejected and why,
shed, cancelled, done) must equal the model's.

The model (:class:`Model`) states the documented rules (issue 2, README, core module docs):

* a turn runs at once when a global slot is free, its tenant is below its sub-limit, no
  eligible waiter is ahead of it, and memory is not under pressure (under soft pressure it
  still runs at once when nothing runs at all);
* under soft memory pressure a turn that would run at once without it waits outside
  ``queue_depth``, as long as such waiters are fewer than the free slots;
* otherwise the policy's decision applies: queue in the queue it would join (its tenant's own
  when the tenant is at its sub-limit, else the global one), bounded by ``queue_depth`` (not
  counting waiters held back only by soft pressure), then
  the overflow policy (``reject``, ``queue`` beyond the depth, ``shed_oldest`` evicting that
  queue's oldest waiter); hard memory pressure rejects;
* freed slots go to the oldest eligible waiter (a waiter whose tenant is at its sub-limit is
  skipped); under memory pressure a release only hands its own slot on, and a reading below
  soft (seen at the next arrival) lets waiters fill every free slot first;
* a human wait lends the slot (which goes to the next waiter) and takes it back on exit even
  beyond the ceiling; the excess is repaid by not refilling the next releases.

Profiles: ``ci`` (default, 60 examples) and ``long`` (``HYPOTHESIS_PROFILE=long``, 2000).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import admitgate
from _stateful import stateful_settings
from conftest import FakeSampler, settle
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from praisonaiagents import gateway as reference_gateway
from praisonaiagents.approval.registry import HUMAN_WAIT_SCOPE

SETTINGS = stateful_settings(ci=(60, 40), long=(2000, 60), debug=(200, 40))

SOFT = 500.0
# A reading of each kind; "none" is a sample with rss_mb=None (unknown: admits).
READINGS = {"none": None, "low": 100.0, "soft": 700.0, "hard": 1500.0}
SCOPES = ("", "a", "b")

ADMIT, QUEUE, REJECT = 0, 1, 2


class Boom(Exception):
    """Raised inside a turn's body on purpose."""


@dataclass
class Model:
    """The documented admission rules, on plain Python lists and dicts."""

    ceiling: int
    depth: int
    overflow: str
    per_scope: int
    soft: float
    hard: float
    memory: bool
    foreign_policy: bool
    # (turn, scope, held back only by soft pressure: outside the depth)
    queue: list[tuple[int, str | None, bool]] = field(default_factory=list)
    running: dict[int, str | None] = field(default_factory=dict)
    human: dict[int, str | None] = field(default_factory=dict)
    outcome: dict[int, str] = field(default_factory=dict)
    pressure: int = ADMIT
    admitted: int = 0
    rejected: int = 0
    shed: int = 0
    cancelled: int = 0
    peak: int = 0

    # -- facts -------------------------------------------------------------------------
    def in_flight(self) -> int:
        return len(self.running)

    def scope_running(self, scope: str | None) -> int:
        return sum(1 for s in self.running.values() if s == scope)

    def scope_waiting(self, scope: str | None) -> int:
        return sum(1 for _, s, outside in self.queue if s == scope and not outside)

    def eligible(self, scope: str | None) -> bool:
        return scope is None or self.scope_running(scope) < self.per_scope

    def evaluate(self, rss: float | None) -> int:
        if not self.memory or rss is None:
            return ADMIT
        if self.hard > 0 and rss >= self.hard:
            return REJECT
        if self.soft > 0 and rss >= self.soft:
            return QUEUE
        return ADMIT

    def decide(self, scope: str | None) -> int:
        def overflow(waiting: int) -> int:
            if waiting < self.depth:
                return QUEUE
            return REJECT if self.overflow == "reject" else QUEUE

        if scope is not None and self.scope_running(scope) >= self.per_scope:
            return overflow(self.scope_waiting(scope))
        if self.in_flight() < self.ceiling:
            return ADMIT
        return overflow(sum(1 for *_, outside in self.queue if not outside))

    # -- slot movements -----------------------------------------------------------------
    def _take(self, tid: int, scope: str | None) -> None:
        self.running[tid] = scope
        self.peak = max(self.peak, self.in_flight())

    def dispatch(self, freed: int) -> None:
        budget = freed
        while self.in_flight() < self.ceiling:
            if self.pressure != ADMIT:
                if budget > 0:
                    budget -= 1
                elif self.in_flight() > 0:
                    break
            nxt = next((w for w in self.queue if self.eligible(w[1])), None)
            if nxt is None:
                break
            self.queue.remove(nxt)
            self._take(nxt[0], nxt[1])
            self.admitted += 1

    def arrive(self, tid: int, raw_scope: str, rss: float | None) -> None:
        scope = raw_scope if (self.per_scope > 0 and raw_scope) else None
        self.pressure = self.evaluate(rss)
        if self.pressure == ADMIT:
            self.dispatch(0)
        concurrency = self.decide(scope)
        decision = max(concurrency, self.pressure)
        if decision == REJECT:
            self.rejected += 1
            if concurrency != REJECT:
                self.outcome[tid] = "rejected:memory_pressure"
            else:
                self.outcome[tid] = (
                    "rejected:policy" if self.foreign_policy else "rejected:queue_full"
                )
            return
        scope_blocked = scope is not None and self.scope_running(scope) >= self.per_scope
        eligible_waiter = any(self.eligible(s) for _, s, _ in self.queue)
        if (
            self.in_flight() < self.ceiling
            and not scope_blocked
            and not eligible_waiter
            and (self.pressure == ADMIT or self.in_flight() == 0)
        ):
            self._take(tid, scope)
            self.admitted += 1
            return
        held_back = sum(1 for *_, outside in self.queue if outside)
        outside = (
            self.pressure == QUEUE
            and concurrency == ADMIT
            and not scope_blocked
            and held_back < self.ceiling - self.in_flight()
        )
        if decision == QUEUE and not outside:
            in_depth = [w for w in self.queue if not w[2]]
            if scope_blocked:
                members = [w for w in in_depth if w[1] == scope]
            else:
                members = in_depth
            if len(members) >= self.depth:
                if self.overflow == "shed_oldest":
                    if not members:
                        self.rejected += 1
                        self.outcome[tid] = "rejected:queue_full"
                        return
                    victim = members[0]
                    self.queue.remove(victim)
                    self.shed += 1
                    self.outcome[victim[0]] = "shed"
                elif concurrency == ADMIT and self.overflow == "reject":
                    # Queued only by memory pressure, into a full queue: the overflow policy.
                    self.rejected += 1
                    self.outcome[tid] = "rejected:queue_full"
                    return
        self.queue.append((tid, scope, outside))
        self.dispatch(0)

    def release(self, tid: int) -> None:
        del self.running[tid]
        self.outcome[tid] = "done"
        self.dispatch(1)

    def suspend(self, tid: int) -> None:
        self.human[tid] = self.running.pop(tid)
        self.dispatch(1)

    def resume(self, tid: int) -> None:
        self._take(tid, self.human.pop(tid))

    def end_suspended(self, tid: int) -> None:
        del self.human[tid]
        self.outcome[tid] = "done"

    def withdraw(self, tid: int) -> None:
        entry = next(w for w in self.queue if w[0] == tid)
        self.queue.remove(entry)
        self.cancelled += 1
        self.outcome[tid] = "cancelled"

    def shed_oldest_waiter(self) -> bool:
        if not self.queue:
            return False
        tid, _, _ = self.queue.pop(0)
        self.shed += 1
        self.outcome[tid] = "shed"
        return True

    def fate(self, tid: int) -> str:
        if tid in self.running:
            return "running"
        if tid in self.human:
            return "human"
        if any(t == tid for t, _, _ in self.queue):
            return "waiting"
        return self.outcome[tid]


def in_worker(fn, *args) -> None:
    """Runs ``fn`` on a worker thread and waits for it (deterministic, unlike a pool hop)."""
    worker = threading.Thread(target=fn, args=args)
    worker.start()
    worker.join()


class Turn:
    """One real turn: a task on the machine's loop, steered through a command queue."""

    def __init__(self, tid: int, gate: admitgate.AdmissionGate, scope: str) -> None:
        self.tid = tid
        self.gate = gate
        self.scope = scope
        self.state = "new"
        self.commands: asyncio.Queue[str] = asyncio.Queue()
        self.human_wait = None
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        try:
            self.state = "waiting"
            async with self.gate.admit(session_id=self.scope):
                self.state = "running"
                await self.body()
            self.state = "done"
        except admitgate.AdmissionRejected as exc:
            self.state = "shed" if exc.reason == "shed" else f"rejected:{exc.reason}"
        except Boom:
            self.state = "done"
        except asyncio.CancelledError:
            self.state = "cancelled" if self.state == "waiting" else "done"

    async def body(self) -> None:
        while True:
            command = await self.commands.get()
            if command == "finish":
                return
            if command == "raise":
                raise Boom("body failed")
            if command in ("human_sync", "human_async"):
                factory = HUMAN_WAIT_SCOPE.get()
                assert factory is not None, "HUMAN_WAIT_SCOPE not bound inside the turn"
                self.human_wait = factory()
                if command == "human_sync":
                    # A sync approval runs on a worker thread (as in a thread pool); a sync
                    # wait on the loop's own thread lends nothing (tests/test_hardening.py).
                    in_worker(self.human_wait.__enter__)
                else:
                    await self.human_wait.__aenter__()
                self.state = "human"
            elif command == "resume_sync":
                in_worker(self.human_wait.__exit__, None, None, None)
                self.state = "running"
            elif command == "resume_async":
                await self.human_wait.__aexit__(None, None, None)
                self.state = "running"


class GateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.turns: dict[int, Turn] = {}
        self.model: Model | None = None
        self.gate: admitgate.AdmissionGate | None = None
        self.sampler = FakeSampler(sample_cls=admitgate.ResourceSample)

    @initialize(
        ceiling=st.integers(1, 3),
        depth=st.integers(0, 3),
        overflow=st.sampled_from(["reject", "queue", "shed_oldest"]),
        per_scope=st.integers(0, 2),
        memory=st.sampled_from([None, (SOFT, 1000.0), (SOFT, 0.0)]),
        foreign_policy=st.booleans(),
    )
    def configure(self, ceiling, depth, overflow, per_scope, memory, foreign_policy):
        cls = (
            reference_gateway.ConcurrencyLimitPolicy
            if foreign_policy
            else admitgate.ConcurrencyLimitPolicy
        )
        policy = cls(
            max_concurrent_runs=ceiling,
            queue_depth=depth,
            overflow_policy=overflow,
            max_concurrent_runs_per_scope=per_scope,
        )
        soft, hard = memory or (0.0, 0.0)
        if memory is None:
            self.gate = admitgate.AdmissionGate(policy)
        else:
            self.gate = admitgate.AdmissionGate(
                policy,
                resource_policy=admitgate.MemoryPressurePolicy(soft_rss_mb=soft, hard_rss_mb=hard),
                resource_sampler=self.sampler,
            )
        self.model = Model(
            ceiling=ceiling,
            depth=depth,
            overflow=overflow,
            per_scope=per_scope,
            soft=soft,
            hard=hard,
            memory=memory is not None,
            foreign_policy=foreign_policy,
        )

    # -- helpers ---------------------------------------------------------------------------
    def settle(self) -> None:
        self.loop.run_until_complete(settle(12))

    def send(self, tid: int, command: str) -> None:
        self.turns[tid].commands.put_nowait(command)
        self.settle()

    @staticmethod
    def pick(ids, index: int) -> int:
        ordered = sorted(ids)
        return ordered[index % len(ordered)]

    # -- rules -----------------------------------------------------------------------------
    @rule(
        scopes=st.lists(st.sampled_from(SCOPES), min_size=1, max_size=4),
        reading=st.sampled_from(sorted(READINGS)),
    )
    def arrive(self, scopes, reading):
        """One or more turns arrive in the same loop iteration, under one memory reading."""
        rss = READINGS[reading]
        self.sampler.rss_mb = rss
        first = len(self.turns)
        for offset, scope in enumerate(scopes):
            self.model.arrive(first + offset, scope, rss)

        async def start() -> None:
            for offset, scope in enumerate(scopes):
                self.turns[first + offset] = Turn(first + offset, self.gate, scope)

        self.loop.run_until_complete(start())
        self.settle()

    @precondition(lambda self: self.model is not None and self.model.running)
    @rule(index=st.integers(0, 100), how=st.sampled_from(["finish", "raise", "cancel"]))
    def end_running_turn(self, index, how):
        tid = self.pick(self.model.running, index)
        self.model.release(tid)
        if how == "cancel":
            self.turns[tid].task.cancel()
            self.settle()
        else:
            self.send(tid, how)

    @precondition(lambda self: self.model is not None and self.model.queue)
    @rule(index=st.integers(0, 100))
    def cancel_waiting_turn(self, index):
        tid = self.pick([t for t, _, _ in self.model.queue], index)
        self.model.withdraw(tid)
        self.turns[tid].task.cancel()
        self.settle()

    @precondition(lambda self: self.model is not None)
    @rule()
    def shed_oldest_waiter(self):
        expected = self.model.shed_oldest_waiter()
        assert self.gate._shed_oldest_waiter() is expected
        self.settle()

    @precondition(lambda self: self.model is not None and self.model.running)
    @rule(index=st.integers(0, 100), use_async=st.booleans())
    def enter_human_wait(self, index, use_async):
        tid = self.pick(self.model.running, index)
        self.model.suspend(tid)
        self.send(tid, "human_async" if use_async else "human_sync")

    @precondition(lambda self: self.model is not None and self.model.human)
    @rule(index=st.integers(0, 100), use_async=st.booleans())
    def leave_human_wait(self, index, use_async):
        tid = self.pick(self.model.human, index)
        self.model.resume(tid)
        self.send(tid, "resume_async" if use_async else "resume_sync")

    @precondition(lambda self: self.model is not None and self.model.human)
    @rule(index=st.integers(0, 100), how=st.sampled_from(["finish", "raise"]))
    def end_turn_during_human_wait(self, index, how):
        tid = self.pick(self.model.human, index)
        self.model.end_suspended(tid)
        self.send(tid, how)

    # -- comparison --------------------------------------------------------------------------
    @invariant()
    def gate_matches_model(self):
        if self.model is None:
            return
        m, g = self.model, self.gate
        expected = {
            "in_flight": m.in_flight(),
            "queued": len(m.queue),
            "awaiting_human": len(m.human),
            "admitted": m.admitted,
            "rejected": m.rejected,
            "shed": m.shed,
            "cancelled": m.cancelled,
        }
        stats = g.stats()
        got = {key: stats[key] for key in expected}
        assert got == expected, f"stats {got} != model {expected}"
        props = {key: getattr(g, key) for key in expected}
        assert props == expected, f"properties {props} != model {expected}"
        assert g.peak_in_flight == m.peak
        fates = {tid: turn.state for tid, turn in self.turns.items()}
        model_fates = {tid: m.fate(tid) for tid in self.turns}
        assert fates == model_fates, f"turn fates {fates} != model {model_fates}"
        if g.queued:
            assert g.oldest_wait_seconds is not None and g.oldest_wait_seconds >= 0
        else:
            assert g.oldest_wait_seconds is None

    def teardown(self):
        try:
            if self.gate is None:
                return
            tasks = [t.task for t in self.turns.values() if not t.task.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.settle()
            g = self.gate
            assert (g.in_flight, g.queued, g.awaiting_human) == (0, 0, 0)
            assert g.admitted + g.rejected + g.shed + g.cancelled == len(self.turns)
        finally:
            self.loop.close()


TestGateModel = GateMachine.TestCase
TestGateModel.settings = SETTINGS
