"""Stateful model test of priority classes and fair queuing: the real gate against a small
pure-Python model of the rules ``docs/priorities.md`` documents.

Hypothesis builds a gate with two or three classes (random ``min_share`` / ``max_share``),
a ceiling, a depth, an overflow policy and fair queuing on or off, then drives it through
its public API with arrivals of random classes and tenants (several in one loop iteration),
completions, cancellations of queued turns and ``reconfigure`` of the ceiling. After every
step the gate's totals, its ``stats()["classes"]`` and the fate of every turn must equal the
model's, and the invariants hold: no slot idle while a waiter of a class below its cap waits,
no class above its cap, each counter summed over the classes equal to the total.

The model (:class:`Model`) states the rules:

* shares in slots: a guarantee is ``floor(min_share * limit)``, at least 1 when
  ``min_share > 0``; a cap ``floor(max_share * limit)``, at least 1;
* a turn runs at once when a slot is free, its class is below its cap and no waiter could
  take a slot; a class at its cap queues (and meets the overflow policy as a full gate does);
* a free slot goes to the most important class below its guarantee with a waiter, else to
  the most important class with a waiter, among classes below their caps; within a class
  FIFO, or with fair queuing the tenant lane with the smallest virtual start (ties: the
  older head), each turn started moving its tenant's virtual time on by one and the class's
  to that turn's start, a lane joining no earlier than the class's virtual time;
* a full queue refuses nobody while a less important class has a waiter to spare (a class
  at or below its guarantee keeps as many waiters as its guarantee): the least important
  such class's oldest waiter is shed; else ``reject`` refuses, ``shed_oldest`` evicts the newcomer's class's oldest
  (refusing if it has none), ``queue`` waits beyond the depth.

Profiles as ``tests/test_model.py``: ``ci`` (default) and ``long``.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import admitgate
from _stateful import stateful_settings
from conftest import settle
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

SETTINGS = stateful_settings(ci=(60, 40), long=(1000, 60), debug=(100, 40))
TENANTS = ("", "a", "b")
STEP = 1 << 20  # a tenant's virtual time per turn (weight 1)


def slots(share: float, limit: int, at_least_one: bool) -> int:
    n = min(limit, math.floor(share * limit + 1e-9))
    return max(n, 1) if at_least_one else n


@dataclass
class Model:
    limit: int
    depth: int
    overflow: str
    fair: bool
    shares: list[tuple[float, float]]
    # (turn, class, tenant) in arrival order
    queue: list[tuple[int, int, str]] = field(default_factory=list)
    running: dict[int, tuple[int, str]] = field(default_factory=dict)
    outcome: dict[int, str] = field(default_factory=dict)
    counts: list[dict[str, int]] = field(default_factory=list)
    tags: dict[tuple[str, int], int] = field(default_factory=dict)
    filed: set[tuple[str, int]] = field(default_factory=set)
    vtime: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        keys = ("admitted", "rejected", "shed", "cancelled")
        self.counts = [dict.fromkeys(keys, 0) for _ in self.shares]
        self.vtime = [0 for _ in self.shares]

    # -- shares -----------------------------------------------------------------------------
    def guarantee(self, c: int) -> int:
        low = self.shares[c][0]
        return slots(low, self.limit, low > 0)

    def cap(self, c: int) -> int:
        return slots(self.shares[c][1], self.limit, True)

    def kept(self, c: int) -> int:
        """Waiters a class keeps from more important newcomers: at or below its guarantee,
        as many as its guarantee; above it, none."""
        return self.guarantee(c) if self.in_flight(c) <= self.guarantee(c) else 0

    def in_flight(self, c: int | None = None) -> int:
        return sum(1 for k, _ in self.running.values() if c is None or k == c)

    def waiting(self, c: int) -> list[tuple[int, int, str]]:
        return [w for w in self.queue if w[1] == c]

    def open_classes(self) -> list[int]:
        return [
            c
            for c in range(len(self.shares))
            if self.waiting(c) and self.in_flight(c) < self.cap(c)
        ]

    # -- fair queuing ------------------------------------------------------------------------
    def forget_if_idle(self, tenant: str) -> None:
        if not tenant:
            return
        busy = any(t == tenant for _, t in self.running.values()) or any(
            w[2] == tenant for w in self.queue
        )
        if not busy:
            for key in [k for k in self.tags if k[0] == tenant]:
                del self.tags[key]

    def refile(self, tenant: str, c: int) -> None:
        key = (tenant, c)
        has = any(w[1] == c and w[2] == tenant for w in self.queue)
        if has and key not in self.filed:
            self.tags[key] = max(self.tags.get(key, 0), self.vtime[c])
            self.filed.add(key)
        elif not has:
            self.filed.discard(key)

    def started(self, tenant: str, c: int) -> None:
        key = (tenant, c)
        if key not in self.filed:
            self.tags[key] = max(self.tags.get(key, 0), self.vtime[c])
        self.vtime[c] = max(self.vtime[c], self.tags.get(key, 0))
        self.tags[key] = self.tags.get(key, 0) + STEP

    # -- moves --------------------------------------------------------------------------------
    def next_waiter(self) -> tuple[int, int, str] | None:
        open_ = self.open_classes()
        if not open_:
            return None
        short = [c for c in open_ if self.in_flight(c) < self.guarantee(c)]
        c = min(short or open_)
        members = self.waiting(c)
        if not self.fair:
            return members[0]
        heads: dict[str, tuple[int, int, str]] = {}
        for w in members:
            heads.setdefault(w[2], w)
        return min(heads.values(), key=lambda w: (self.tags[(w[2], c)], w[0]))

    def dispatch(self) -> None:
        while self.in_flight() < self.limit:
            nxt = self.next_waiter()
            if nxt is None:
                return
            tid, c, tenant = nxt
            self.queue.remove(nxt)
            self.refile(tenant, c)
            self.started(tenant, c)
            self.running[tid] = (c, tenant)
            self.counts[c]["admitted"] += 1

    def arrive(self, tid: int, c: int, tenant: str) -> None:
        tenant = tenant if self.fair else ""
        self.dispatch()
        class_full = self.in_flight(c) >= self.cap(c)
        waiting = len(self.queue)
        # A less important class spares the waiters beyond those it keeps for its guarantee.
        lower = [k for k in range(c + 1, len(self.shares)) if len(self.waiting(k)) > self.kept(k)]
        if self.in_flight() < self.limit and not class_full:
            concurrency = "admit"
        elif waiting < self.depth or self.overflow != "reject":
            concurrency = "queue"
        else:
            concurrency = "reject"
        sheds_lower = concurrency == "reject" and bool(lower)
        if concurrency == "reject" and not sheds_lower:
            self.counts[c]["rejected"] += 1
            self.outcome[tid] = "rejected:queue_full"
            return
        if concurrency == "admit" and not self.open_classes():
            if self.fair:
                self.started(tenant, c)
            self.running[tid] = (c, tenant)
            self.counts[c]["admitted"] += 1
            return
        if waiting >= self.depth and (self.overflow == "shed_oldest" or sheds_lower):
            victim_class = max(lower) if lower else c
            members = self.waiting(victim_class)
            if not members:
                self.counts[c]["rejected"] += 1
                self.outcome[tid] = "rejected:queue_full"
                return
            victim = members[0]
            self.queue.remove(victim)
            self.refile(victim[2], victim_class)
            self.forget_if_idle(victim[2])
            self.counts[victim_class]["shed"] += 1
            self.outcome[victim[0]] = "shed"
        self.queue.append((tid, c, tenant))
        self.refile(tenant, c)
        self.dispatch()

    def release(self, tid: int) -> None:
        _, tenant = self.running.pop(tid)
        self.outcome[tid] = "done"
        self.forget_if_idle(tenant)
        self.dispatch()

    def withdraw(self, tid: int) -> None:
        entry = next(w for w in self.queue if w[0] == tid)
        self.queue.remove(entry)
        self.refile(entry[2], entry[1])
        self.forget_if_idle(entry[2])
        self.counts[entry[1]]["cancelled"] += 1
        self.outcome[tid] = "cancelled"

    def fate(self, tid: int) -> str:
        if tid in self.running:
            return "running"
        if any(w[0] == tid for w in self.queue):
            return "waiting"
        return self.outcome[tid]


class Turn:
    """One real turn: a task that waits for ``finish``."""

    def __init__(self, gate: admitgate.AdmissionGate, priority: str, tenant: str) -> None:
        self.state = "new"
        self.finish = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self.run(gate, priority, tenant))

    async def run(self, gate: admitgate.AdmissionGate, priority: str, tenant: str) -> None:
        try:
            self.state = "waiting"
            async with gate.admit(session_id=tenant, priority=priority):
                self.state = "running"
                await self.finish.wait()
            self.state = "done"
        except admitgate.AdmissionRejected as exc:
            assert exc.priority == priority
            self.state = "shed" if exc.reason == "shed" else f"rejected:{exc.reason}"
        except asyncio.CancelledError:
            self.state = "cancelled" if self.state == "waiting" else "done"


NAMES = ("gold", "silver", "bronze")


class PriorityMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.turns: dict[int, Turn] = {}
        self.model: Model | None = None
        self.gate: admitgate.AdmissionGate | None = None

    @initialize(
        limit=st.integers(1, 5),
        depth=st.integers(0, 4),
        overflow=st.sampled_from(["reject", "queue", "shed_oldest"]),
        fair=st.booleans(),
        shares=st.lists(
            st.tuples(st.sampled_from([0.0, 0.2, 0.3]), st.sampled_from([0.25, 0.5, 1.0])).filter(
                lambda share: share[0] <= share[1]
            ),
            min_size=2,
            max_size=3,
        ),
    )
    def configure(self, limit, depth, overflow, fair, shares):
        classes = [
            admitgate.PriorityClass(NAMES[i], min_share=low, max_share=high)
            for i, (low, high) in enumerate(shares)
        ]
        self.gate = admitgate.build_admission_gate(
            max_concurrent_runs=limit,
            queue_depth=depth,
            overflow_policy=overflow,
            priorities=classes,
            fairness="tenant" if fair else "none",
        )
        self.model = Model(limit, depth, overflow, fair, list(shares))

    def settle(self) -> None:
        self.loop.run_until_complete(settle(12))

    @rule(
        arrivals=st.lists(
            st.tuples(st.integers(0, 2), st.sampled_from(TENANTS)), min_size=1, max_size=4
        )
    )
    def arrive(self, arrivals):
        arrivals = [(c % len(self.model.shares), t) for c, t in arrivals]
        first = len(self.turns)
        for offset, (c, tenant) in enumerate(arrivals):
            self.model.arrive(first + offset, c, tenant)

        async def start() -> None:
            for offset, (c, tenant) in enumerate(arrivals):
                self.turns[first + offset] = Turn(self.gate, NAMES[c], tenant)

        self.loop.run_until_complete(start())
        self.settle()

    @precondition(lambda self: self.model is not None and self.model.running)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        tid = sorted(self.model.running)[index % len(self.model.running)]
        self.model.release(tid)
        self.turns[tid].finish.set()
        self.settle()

    @precondition(lambda self: self.model is not None and self.model.queue)
    @rule(index=st.integers(0, 100))
    def cancel_waiting(self, index):
        tid = sorted(w[0] for w in self.model.queue)[index % len(self.model.queue)]
        self.model.withdraw(tid)
        self.turns[tid].task.cancel()
        self.settle()

    @precondition(lambda self: self.model is not None)
    @rule(limit=st.integers(1, 5))
    def reconfigure_limit(self, limit):
        # Only raise or keep the depth-free part: a lower limit is reached as turns end.
        self.model.limit = limit
        self.gate.reconfigure(max_concurrent_runs=limit)
        self.model.dispatch()
        self.settle()

    @invariant()
    def gate_matches_model(self):
        if self.model is None:
            return
        m, g = self.model, self.gate
        stats = g.stats()
        classes = stats["classes"]
        for c, name in enumerate(NAMES[: len(m.shares)]):
            expected = {
                "in_flight": m.in_flight(c),
                "queued": len(m.waiting(c)),
                **m.counts[c],
            }
            assert classes[name] == expected, f"class {name}: {classes[name]} != {expected}"
        for key in ("in_flight", "queued", "admitted", "rejected", "shed", "cancelled"):
            assert stats[key] == sum(cls[key] for cls in classes.values()), key
        fates = {tid: turn.state for tid, turn in self.turns.items()}
        assert fates == {tid: m.fate(tid) for tid in self.turns}
        # No slot idle while a waiter of a class below its cap waits; no class over its cap
        # (a lowered limit is reached as turns end).
        if stats["in_flight"] < m.limit:
            assert not m.open_classes()

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
            s = self.gate.stats()
            assert (s["in_flight"], s["queued"]) == (0, 0)
            assert s["admitted"] + s["rejected"] + s["shed"] + s["cancelled"] == len(self.turns)
        finally:
            self.loop.close()


TestPriorityModel = PriorityMachine.TestCase
TestPriorityModel.settings = SETTINGS
