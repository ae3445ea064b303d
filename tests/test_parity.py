"""Scenario parity: admitgate and the reference gate, side by side.

Every scenario runs once per implementation (the ``impl`` fixture) and asserts the same
observable outcome: decisions, counters, stats, which turns run, which are rejected or
shed, and in what order. Turns are held open with ``asyncio.Event``s, never sleeps, so
each step is deterministic.

The last sections are the four places where the reference breaks PraisonAI's own
documentation (issue 2). Each asserts the documented behaviour on admitgate and, on the
reference, asserts the reference's actual (wrong) behaviour, so neither half can pass
by accident.
"""

from __future__ import annotations

import asyncio
import types

import pytest
from conftest import FakeSampler, run, settle

REF_STATS_KEYS = {
    "max_concurrent_runs",
    "max_concurrent_runs_per_scope",
    "queue_depth",
    "in_flight",
    "queued",
    "awaiting_human",
    "admitted",
    "rejected",
    "shed",
    "max_rss_mb",
}


class Turns:
    """Drives named turns through one gate and records what happens to each.

    A turn's state is ``waiting`` (inside ``admit``), ``running`` (in the body, held
    open until :meth:`finish`), then ``done``, ``failed`` (its body raised),
    ``rejected`` (``AdmissionRejected`` from the gate: rejected or shed) or
    ``cancelled``. ``started`` lists the turns in the order their bodies began.
    """

    def __init__(self, impl: types.SimpleNamespace, gate):
        self.impl = impl
        self.gate = gate
        self.state: dict[str, str] = {}
        self.started: list[str] = []
        self.errors: dict[str, BaseException] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self._release: dict[str, asyncio.Event] = {}
        self._raise: dict[str, BaseException] = {}
        self.concurrent_by_scope: dict[str, int] = {}
        self.peak_by_scope: dict[str, int] = {}

    async def arrive(self, name: str, session_id: str = "", *, raises: BaseException | None = None):
        """Start turn ``name`` and let the gate settle."""
        self.spawn(name, session_id, raises=raises)
        await settle()

    def spawn(self, name: str, session_id: str = "", *, raises: BaseException | None = None):
        """Start turn ``name`` without yielding to the loop."""
        assert name not in self.state, name
        self.state[name] = "waiting"
        self._release[name] = asyncio.Event()
        if raises is not None:
            self._raise[name] = raises
        self.tasks[name] = asyncio.get_running_loop().create_task(self._turn(name, session_id))

    async def _turn(self, name: str, session_id: str) -> None:
        try:
            async with self.gate.admit(session_id=session_id):
                self.state[name] = "running"
                self.started.append(name)
                now = self.concurrent_by_scope.get(session_id, 0) + 1
                self.concurrent_by_scope[session_id] = now
                self.peak_by_scope[session_id] = max(self.peak_by_scope.get(session_id, 0), now)
                try:
                    await self._release[name].wait()
                finally:
                    self.concurrent_by_scope[session_id] -= 1
                if name in self._raise:
                    self.state[name] = "failed"
                    raise self._raise[name]
            self.state[name] = "done"
        except self.impl.AdmissionRejected as exc:
            self.state[name] = "rejected"
            self.errors[name] = exc
        except asyncio.CancelledError:
            self.state[name] = "cancelled"
            raise
        except ValueError as exc:  # the body's own error (raises=...), kept to inspect
            self.errors[name] = exc

    async def finish(self, *names: str) -> None:
        """Let the named running turns end, then settle."""
        for name in names:
            assert self.state[name] == "running", (name, self.state[name])
            self._release[name].set()
            await settle()

    async def cancel(self, name: str) -> None:
        self.tasks[name].cancel()
        await settle()

    async def close(self) -> None:
        """Finish whatever still runs and cancel whatever still waits."""
        for name, state in list(self.state.items()):
            if state == "running":
                self._release[name].set()
            elif state == "waiting":
                self.tasks[name].cancel()
        await settle()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def named(self, state: str) -> list[str]:
        return sorted(name for name, s in self.state.items() if s == state)

    def counters(self) -> dict[str, int]:
        g = self.gate
        return {
            "in_flight": g.in_flight,
            "queued": g.queued,
            "admitted": g.admitted,
            "rejected": g.rejected,
            "shed": g.shed,
        }

    def check_reason(self, name: str, reason: str) -> None:
        """admitgate says why it refused a turn; the reference has no reason."""
        exc = self.errors[name]
        assert isinstance(exc, self.impl.AdmissionRejected)
        assert exc.message == "Busy right now — please resend in a moment."
        if not self.impl.is_reference:
            assert exc.reason == reason, (name, exc.reason)


def make_gate(impl, *args, **kwargs):
    gate = impl.build_admission_gate(*args, **kwargs)
    assert gate is not None and gate.enabled is True
    return gate


def check_stats_shape(impl, stats: dict) -> None:
    assert type(stats) is dict
    assert REF_STATS_KEYS <= set(stats), REF_STATS_KEYS - set(stats)
    if impl.is_reference:
        assert set(stats) == REF_STATS_KEYS
    else:
        assert "cancelled" in stats
    for key, value in stats.items():
        if key == "max_rss_mb":
            assert type(value) is float, (key, value)
        else:
            assert type(value) is int, (key, value)


# --- building and disabled gates ---------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_concurrent_runs": 0},
        {"max_concurrent_runs": None},
        {"max_concurrent_runs": "0"},
        {"max_concurrent_runs": " 0 "},
        {"max_concurrent_runs": 0, "queue_depth": 5, "overflow_policy": "queue"},
        {"max_concurrent_runs": 0, "max_concurrent_runs_per_scope": 4},
    ],
)
def test_unconfigured_build_returns_none(impl, kwargs):
    assert impl.build_admission_gate(**kwargs) is None


def _disabled_gates(impl):
    yield impl.AdmissionGate(None)
    yield impl.AdmissionGate(impl.ConcurrencyLimitPolicy(0))
    yield impl.AdmissionGate(
        None,
        resource_policy=impl.MemoryPressurePolicy(),
        resource_sampler=FakeSampler(10**9),
    )


def test_disabled_gate_passes_through(impl):
    async def scenario():
        for gate in _disabled_gates(impl):
            assert gate.enabled is False
            turns = Turns(impl, gate)
            for i in range(20):
                turns.spawn(f"t{i}")
            await settle()
            assert len(turns.named("running")) == 20
            await turns.close()
            assert turns.named("done") == sorted(f"t{i}" for i in range(20))
            assert turns.counters() == {
                "in_flight": 0,
                "queued": 0,
                "admitted": 0,
                "rejected": 0,
                "shed": 0,
            }
            stats = gate.stats()
            check_stats_shape(impl, stats)
            assert stats["max_concurrent_runs"] == 0 and stats["max_rss_mb"] == 0.0

    run(scenario())


def test_build_with_ceiling(impl):
    gate = make_gate(impl, "32", "128", " Reject ", max_concurrent_runs_per_scope="4")
    stats = gate.stats()
    check_stats_shape(impl, stats)
    assert {k: stats[k] for k in REF_STATS_KEYS} == {
        "max_concurrent_runs": 32,
        "max_concurrent_runs_per_scope": 4,
        "queue_depth": 128,
        "in_flight": 0,
        "queued": 0,
        "awaiting_human": 0,
        "admitted": 0,
        "rejected": 0,
        "shed": 0,
        "max_rss_mb": 0.0,
    }
    assert (gate.in_flight, gate.queued, gate.awaiting_human) == (0, 0, 0)


def test_build_with_explicit_policy_ignores_knobs(impl):
    policy = impl.ConcurrencyLimitPolicy(2, 1)
    gate = impl.build_admission_gate(max_concurrent_runs=0, policy=policy)
    assert gate is not None and gate.enabled is True
    assert gate.stats()["max_concurrent_runs"] == 2
    assert gate.stats()["queue_depth"] == 1


# --- the concurrency ceiling ----------------------------------------------------


def test_reject_at_ceiling_without_queue(impl):
    async def scenario():
        turns = Turns(impl, make_gate(impl, 2))
        for name in "abc":
            await turns.arrive(name)
        assert turns.named("running") == ["a", "b"]
        assert turns.named("rejected") == ["c"]
        turns.check_reason("c", "queue_full")
        assert turns.counters() == {
            "in_flight": 2,
            "queued": 0,
            "admitted": 2,
            "rejected": 1,
            "shed": 0,
        }
        await turns.finish("a")
        await turns.arrive("d")
        assert turns.named("running") == ["b", "d"]
        await turns.close()
        assert turns.counters() == {
            "in_flight": 0,
            "queued": 0,
            "admitted": 3,
            "rejected": 1,
            "shed": 0,
        }

    run(scenario())


def test_reject_at_ceiling_with_queue(impl):
    async def scenario():
        turns = Turns(impl, make_gate(impl, 2, 1, "reject"))
        for name in "abcd":
            await turns.arrive(name)
        assert turns.named("running") == ["a", "b"]
        assert turns.named("waiting") == ["c"]
        assert turns.named("rejected") == ["d"]
        turns.check_reason("d", "queue_full")
        assert turns.counters() == {
            "in_flight": 2,
            "queued": 1,
            "admitted": 2,
            "rejected": 1,
            "shed": 0,
        }
        stats = turns.gate.stats()
        check_stats_shape(impl, stats)
        assert (stats["in_flight"], stats["queued"], stats["rejected"]) == (2, 1, 1)
        await turns.finish("a")
        assert turns.named("running") == ["b", "c"]
        assert turns.counters() == {
            "in_flight": 2,
            "queued": 0,
            "admitted": 3,
            "rejected": 1,
            "shed": 0,
        }
        await turns.finish("b", "c")
        assert turns.started == ["a", "b", "c"]
        assert turns.counters() == {
            "in_flight": 0,
            "queued": 0,
            "admitted": 3,
            "rejected": 1,
            "shed": 0,
        }

    run(scenario())


def test_queue_overflow_waits_beyond_depth(impl):
    async def scenario():
        turns = Turns(impl, make_gate(impl, 1, 1, "queue"))
        for name in "abcde":
            await turns.arrive(name)
        assert turns.named("running") == ["a"]
        assert turns.named("waiting") == ["b", "c", "d", "e"]
        assert turns.counters() == {
            "in_flight": 1,
            "queued": 4,
            "admitted": 1,
            "rejected": 0,
            "shed": 0,
        }
        for name in "abcde":
            await turns.finish(name)
        assert turns.started == list("abcde")
        assert turns.counters() == {
            "in_flight": 0,
            "queued": 0,
            "admitted": 5,
            "rejected": 0,
            "shed": 0,
        }

    run(scenario())


def test_shed_oldest_evicts_oldest_waiter(impl):
    async def scenario():
        turns = Turns(impl, make_gate(impl, 1, 2, "shed_oldest"))
        for name in "abc":
            await turns.arrive(name)
        assert turns.named("waiting") == ["b", "c"]
        await turns.arrive("d")  # queue full: the oldest waiter (b) is shed
        assert turns.named("rejected") == ["b"]
        turns.check_reason("b", "shed")
        assert turns.named("waiting") == ["c", "d"]
        assert turns.counters() == {
            "in_flight": 1,
            "queued": 2,
            "admitted": 1,
            "rejected": 0,
            "shed": 1,
        }
        await turns.arrive("e")  # then c
        assert turns.named("rejected") == ["b", "c"]
        assert turns.named("waiting") == ["d", "e"]
        assert turns.counters() == {
            "in_flight": 1,
            "queued": 2,
            "admitted": 1,
            "rejected": 0,
            "shed": 2,
        }
        for name in "ade":
            await turns.finish(name)
        assert turns.started == ["a", "d", "e"]
        assert turns.counters() == {
            "in_flight": 0,
            "queued": 0,
            "admitted": 3,
            "rejected": 0,
            "shed": 2,
        }
        assert turns.gate.stats()["shed"] == 2

    run(scenario())


def test_shed_oldest_with_no_waiter_rejects_newcomer(impl):
    async def scenario():
        turns = Turns(impl, make_gate(impl, 1, 0, "shed_oldest"))
        await turns.arrive("a")
        await turns.arrive("b")
        assert turns.named("rejected") == ["b"]
        assert turns.named("running") == ["a"]
        assert turns.counters() == {
            "in_flight": 1,
            "queued": 0,
            "admitted": 1,
            "rejected": 1,
            "shed": 0,
        }
        await turns.close()

    run(scenario())


def test_shed_oldest_waiter_compat_method(impl):
    async def scenario():
        turns = Turns(impl, make_gate(impl, 1, 5, "shed_oldest"))
        for name in "abc":
            await turns.arrive(name)
        assert turns.gate._shed_oldest_waiter() is True
        await settle()
        assert turns.named("rejected") == ["b"]
        assert turns.named("waiting") == ["c"]
        assert turns.gate.shed == 1
        await turns.finish("a")
        assert turns.gate._shed_oldest_waiter() is False  # nobody waits
        await turns.close()
        assert turns.started == ["a", "c"]

    run(scenario())


def test_waiters_run_in_fifo_order(impl):
    async def scenario():
        turns = Turns(impl, make_gate(impl, 2, 10))
        names = [f"w{i}" for i in range(8)]
        for name in names:
            await turns.arrive(name)
        assert turns.gate.queued == 6
        # Finish in an order unrelated to arrival: slots still go to waiters FIFO.
        await turns.finish("w1")
        await turns.finish("w0")
        assert turns.named("running") == ["w2", "w3"]
        while turns.named("running"):
            await turns.finish(turns.named("running")[-1])
        assert turns.started == names
        assert turns.counters() == {
            "in_flight": 0,
            "queued": 0,
            "admitted": 8,
            "rejected": 0,
            "shed": 0,
        }

    run(scenario())


def test_newcomer_does_not_overtake_waiter(impl):
    async def scenario():
        turns = Turns(impl, make_gate(impl, 1, 5))
        await turns.arrive("a")
        await turns.arrive("b")
        turns._release["a"].set()
        await asyncio.sleep(0)  # a leaves the gate; b has not run yet
        turns.spawn("c")
        await settle()
        await turns.finish("b")
        await turns.finish("c")
        assert turns.started == ["a", "b", "c"]
        assert turns.counters() == {
            "in_flight": 0,
            "queued": 0,
            "admitted": 3,
            "rejected": 0,
            "shed": 0,
        }

    run(scenario())


def test_body_exception_frees_slot(impl):
    async def scenario():
        boom = ValueError("boom")
        turns = Turns(impl, make_gate(impl, 1, 5))
        await turns.arrive("a", raises=boom)
        await turns.arrive("b")
        await turns.finish("a")
        assert turns.errors["a"] is boom  # propagated unchanged
        assert turns.state["a"] == "failed"
        assert turns.named("running") == ["b"]
        assert turns.counters() == {
            "in_flight": 1,
            "queued": 0,
            "admitted": 2,
            "rejected": 0,
            "shed": 0,
        }
        await turns.finish("b")
        await turns.arrive("c")
        assert turns.named("running") == ["c"]
        await turns.close()
        assert turns.counters() == {
            "in_flight": 0,
            "queued": 0,
            "admitted": 3,
            "rejected": 0,
            "shed": 0,
        }

    run(scenario())


def test_cancel_running_turn_frees_slot(impl):
    async def scenario():
        turns = Turns(impl, make_gate(impl, 1, 5))
        await turns.arrive("a")
        await turns.arrive("b")
        await turns.cancel("a")
        assert turns.state["a"] == "cancelled"
        assert turns.named("running") == ["b"]
        assert (turns.gate.in_flight, turns.gate.queued) == (1, 0)
        await turns.close()
        assert turns.gate.in_flight == 0

    run(scenario())


def test_sequential_turns_reuse_one_slot(impl):
    async def scenario():
        gate = make_gate(impl, 1)
        for _ in range(50):
            async with gate.admit(session_id="s"):
                assert gate.in_flight == 1
        assert (gate.admitted, gate.rejected, gate.in_flight, gate.queued) == (
            50,
            0,
            0,
            0,
        )

    run(scenario())


def test_rejection_happens_before_the_body(impl):
    async def scenario():
        gate = make_gate(impl, 1)
        entered = []
        async with gate.admit():
            with pytest.raises(impl.AdmissionRejected):
                async with gate.admit(session_id="x"):
                    entered.append(True)
        assert entered == []
        assert (gate.admitted, gate.rejected) == (1, 1)

    run(scenario())


# --- policies the gate does not own ---------------------------------------------


class DuckPolicy:
    """Any object with the reference's attributes and ``decide(**facts)``."""

    def __init__(self, decide, max_concurrent_runs=1, queue_depth=5):
        self.max_concurrent_runs = max_concurrent_runs
        self.queue_depth = queue_depth
        self.overflow_policy = "reject"
        self.max_concurrent_runs_per_scope = 0
        self._decide = decide
        self.calls = []

    def decide(self, **facts):
        self.calls.append(facts)
        return self._decide(**facts)


def test_gate_accepts_core_policy_objects(impl):
    from praisonaiagents.gateway import (
        ConcurrencyLimitPolicy as CoreConcurrencyLimitPolicy,
    )

    async def scenario():
        turns = Turns(impl, impl.AdmissionGate(CoreConcurrencyLimitPolicy(1, 1)))
        for name in "abc":
            await turns.arrive(name)
        assert turns.named("running") == ["a"]
        assert turns.named("waiting") == ["b"]
        assert turns.named("rejected") == ["c"]
        await turns.finish("a")
        await turns.finish("b")
        assert turns.started == ["a", "b"]

    run(scenario())


def test_policy_saying_admit_cannot_exceed_ceiling(impl):
    from praisonaiagents.gateway import AdmissionDecision

    async def scenario():
        policy = DuckPolicy(lambda **_: AdmissionDecision.ADMIT)
        turns = Turns(impl, impl.AdmissionGate(policy))
        for name in "abc":
            await turns.arrive(name)
        assert turns.named("running") == ["a"]
        assert turns.named("waiting") == ["b", "c"]
        assert turns.gate.in_flight == 1
        await turns.finish("a")
        assert turns.named("running") == ["b"]
        await turns.finish("b")
        await turns.finish("c")
        assert turns.started == ["a", "b", "c"]
        assert turns.gate.admitted == 3
        facts = policy.calls[0]
        assert set(facts) == {
            "in_flight",
            "queued",
            "session_id",
            "scope",
            "scope_in_flight",
            "scope_queued",
        }
        assert facts["in_flight"] == 0 and policy.calls[1]["in_flight"] == 1

    run(scenario())


def test_policy_that_raises_is_treated_as_admit(impl):
    def broken(**_):
        raise RuntimeError("policy bug")

    async def scenario():
        turns = Turns(impl, impl.AdmissionGate(DuckPolicy(broken)))
        await turns.arrive("a")
        await turns.arrive("b")
        assert turns.named("running") == ["a"]  # admitted, yet the ceiling holds
        assert turns.named("waiting") == ["b"]
        await turns.finish("a")
        await turns.finish("b")
        assert turns.started == ["a", "b"]
        assert (turns.gate.admitted, turns.gate.rejected) == (2, 0)

    run(scenario())


def test_policy_reject_decision_rejects(impl):
    from praisonaiagents.gateway import AdmissionDecision

    async def scenario():
        turns = Turns(
            impl,
            impl.AdmissionGate(DuckPolicy(lambda **_: AdmissionDecision.REJECT, 4)),
        )
        await turns.arrive("a")
        assert turns.named("rejected") == ["a"]
        assert (turns.gate.admitted, turns.gate.rejected, turns.gate.in_flight) == (
            0,
            1,
            0,
        )

    run(scenario())


# --- memory pressure ---------------------------------------------------------------


def test_resource_only_gate(impl):
    async def scenario():
        policy = impl.MemoryPressurePolicy(soft_rss_mb=100, hard_rss_mb=200)
        gate = impl.build_admission_gate(resource_policy=policy)
        assert gate is not None and gate.enabled is True
        sampler = FakeSampler(50, sample_cls=impl.ResourceSample)
        gate._resource_sampler = sampler
        stats = gate.stats()
        check_stats_shape(impl, stats)
        assert stats["max_concurrent_runs"] == 0 and stats["max_rss_mb"] == 200.0

        turns = Turns(impl, gate)
        for i in range(3):
            await turns.arrive(f"low{i}")
        sampler.rss_mb = 150  # soft pressure with no ceiling: admitted
        for i in range(3):
            await turns.arrive(f"soft{i}")
        sampler.rss_mb = None  # platform cannot tell: admitted
        await turns.arrive("unknown")
        sampler.rss_mb = 200  # hard pressure: rejected
        await turns.arrive("hard0")
        sampler.rss_mb = 10**6
        await turns.arrive("hard1")
        assert turns.named("rejected") == ["hard0", "hard1"]
        turns.check_reason("hard0", "memory_pressure")
        assert len(turns.named("running")) == 7
        assert turns.counters() == {
            "in_flight": 7,
            "queued": 0,
            "admitted": 7,
            "rejected": 2,
            "shed": 0,
        }
        assert sampler.reads >= 9
        await turns.close()
        assert gate.in_flight == 0

    run(scenario())


def test_resource_gate_with_explicit_sampler(impl):
    async def scenario():
        sampler = FakeSampler(300, sample_cls=impl.ResourceSample)
        gate = impl.AdmissionGate(
            None,
            resource_policy=impl.MemoryPressurePolicy(hard_rss_mb=256),
            resource_sampler=sampler,
        )
        assert gate.enabled is True
        with pytest.raises(impl.AdmissionRejected):
            async with gate.admit(session_id="u"):
                pytest.fail("body ran under hard pressure")
        sampler.rss_mb = 255.9
        async with gate.admit(session_id="u"):
            assert gate.in_flight == 1
        assert (gate.admitted, gate.rejected) == (1, 1)
        assert gate.stats()["max_rss_mb"] == 256.0

    run(scenario())


def test_hard_pressure_rejects_with_free_slots(impl):
    async def scenario():
        gate = impl.build_admission_gate(
            4, 10, resource_policy=impl.build_memory_pressure_policy(1000)
        )
        sampler = FakeSampler(100, sample_cls=impl.ResourceSample)
        gate._resource_sampler = sampler
        turns = Turns(impl, gate)
        await turns.arrive("a")
        sampler.rss_mb = 1000
        await turns.arrive("b")
        assert turns.named("rejected") == ["b"]
        turns.check_reason("b", "memory_pressure")
        assert turns.counters() == {
            "in_flight": 1,
            "queued": 0,
            "admitted": 1,
            "rejected": 1,
            "shed": 0,
        }
        assert gate.stats()["max_rss_mb"] == 1000.0
        await turns.close()

    run(scenario())


def test_soft_pressure_on_idle_gate_admits_at_once(impl):
    async def scenario():
        gate = impl.build_admission_gate(2, 4, resource_policy=impl.MemoryPressurePolicy(100, 200))
        gate._resource_sampler = FakeSampler(150, sample_cls=impl.ResourceSample)
        turns = Turns(impl, gate)
        await turns.arrive("a")
        assert turns.named("running") == ["a"]
        assert turns.counters() == {
            "in_flight": 1,
            "queued": 0,
            "admitted": 1,
            "rejected": 0,
            "shed": 0,
        }
        await turns.close()

    run(scenario())


# --- stats --------------------------------------------------------------------------


def test_stats_shape_through_a_busy_period(impl):
    async def scenario():
        gate = impl.build_admission_gate(
            2, 1, "shed_oldest", resource_policy=impl.MemoryPressurePolicy(0, 512.5)
        )
        gate._resource_sampler = FakeSampler(1, sample_cls=impl.ResourceSample)
        turns = Turns(impl, gate)
        snapshots = [gate.stats()]
        for name in "abcd":
            await turns.arrive(name)
            snapshots.append(gate.stats())
        await turns.finish("a")
        await turns.finish("b")
        await turns.finish("d")
        snapshots.append(gate.stats())
        for stats in snapshots:
            check_stats_shape(impl, stats)
            assert stats["max_rss_mb"] == 512.5
        assert [(s["in_flight"], s["queued"], s["admitted"], s["shed"]) for s in snapshots] == [
            (0, 0, 0, 0),
            (1, 0, 1, 0),
            (2, 0, 2, 0),
            (2, 1, 2, 0),
            (2, 1, 2, 1),
            (0, 0, 3, 1),
        ]
        assert gate.stats() is not gate.stats()

    run(scenario())


# =====================================================================================
# Divergence 1: per-scope fairness is enforced (the reference lets a tenant take all).
# =====================================================================================


def test_divergence_per_scope_burst_of_ten(impl):
    async def scenario():
        gate = make_gate(impl, 32, 128, "reject", max_concurrent_runs_per_scope=4)
        turns = Turns(impl, gate)
        burst = [f"A{i}" for i in range(10)]
        for name in burst:
            await turns.arrive(name, "tenant-a")
        await turns.arrive("B0", "tenant-b")
        await turns.arrive("B1", "tenant-b")
        if impl.is_reference:
            # Known reference failure: all ten of tenant A's turns run at once.
            assert turns.peak_by_scope["tenant-a"] == 10
            assert len(turns.named("running")) == 12
            assert gate.queued == 0
            await turns.close()
            return
        assert turns.named("running") == ["A0", "A1", "A2", "A3", "B0", "B1"]
        assert turns.named("waiting") == burst[4:]
        assert turns.counters() == {
            "in_flight": 6,
            "queued": 6,
            "admitted": 6,
            "rejected": 0,
            "shed": 0,
        }
        # As A's turns finish, its waiters start one at a time, in order.
        for done in burst:
            await turns.finish(done)
            assert turns.peak_by_scope["tenant-a"] <= 4
        assert turns.started == ["A0", "A1", "A2", "A3", "B0", "B1"] + burst[4:]
        await turns.finish("B0", "B1")
        assert turns.counters() == {
            "in_flight": 0,
            "queued": 0,
            "admitted": 12,
            "rejected": 0,
            "shed": 0,
        }

    run(scenario())


def test_divergence_per_scope_queue_is_bounded(impl):
    """The tenant's own queue is bounded by queue_depth, then the overflow policy applies."""

    async def scenario():
        gate = make_gate(impl, 32, 1, "reject", max_concurrent_runs_per_scope=1)
        turns = Turns(impl, gate)
        for name in ("A0", "A1", "A2"):
            await turns.arrive(name, "a")
        await turns.arrive("B0", "b")
        if impl.is_reference:
            assert turns.named("running") == ["A0", "A1", "A2", "B0"]
            assert gate.rejected == 0
            await turns.close()
            return
        assert turns.named("running") == ["A0", "B0"]
        assert turns.named("waiting") == ["A1"]
        assert turns.named("rejected") == ["A2"]
        turns.check_reason("A2", "queue_full")
        await turns.finish("A0")
        assert turns.named("running") == ["A1", "B0"]
        await turns.close()
        assert turns.counters() == {
            "in_flight": 0,
            "queued": 0,
            "admitted": 3,
            "rejected": 1,
            "shed": 0,
        }

    run(scenario())


def test_divergence_per_scope_shed_oldest_within_tenant(impl):
    async def scenario():
        gate = make_gate(impl, 32, 1, "shed_oldest", max_concurrent_runs_per_scope=1)
        turns = Turns(impl, gate)
        for name in ("A0", "A1", "A2"):
            await turns.arrive(name, "a")
        await turns.arrive("B0", "b")
        if impl.is_reference:
            assert turns.named("running") == ["A0", "A1", "A2", "B0"]
            assert gate.shed == 0
            await turns.close()
            return
        assert turns.named("running") == ["A0", "B0"]
        assert turns.named("rejected") == ["A1"]  # A's oldest waiter made room for A2
        turns.check_reason("A1", "shed")
        assert turns.named("waiting") == ["A2"]
        assert turns.counters() == {
            "in_flight": 2,
            "queued": 1,
            "admitted": 2,
            "rejected": 0,
            "shed": 1,
        }
        await turns.finish("A0")
        assert turns.named("running") == ["A2", "B0"]
        await turns.close()

    run(scenario())


def test_divergence_waiting_tenant_is_skipped_not_dropped(impl):
    """A freed slot goes to the oldest *eligible* waiter (global ceiling 2, per-scope 1)."""

    async def scenario():
        gate = make_gate(impl, 2, 10, "reject", max_concurrent_runs_per_scope=1)
        turns = Turns(impl, gate)
        await turns.arrive("A0", "a")
        await turns.arrive("B0", "b")
        await turns.arrive("A1", "a")  # waits (global full, and A at its sub-limit)
        await turns.arrive("C0", "c")  # waits (global full)
        assert turns.named("waiting") == ["A1", "C0"]
        await turns.finish("B0")  # A is still at its sub-limit: C0 goes first
        if impl.is_reference:
            assert turns.named("running") == ["A0", "A1"]
            assert turns.peak_by_scope["a"] == 2
            await turns.close()
            return
        assert turns.named("running") == ["A0", "C0"]
        assert turns.named("waiting") == ["A1"]
        await turns.finish("A0")
        assert turns.named("running") == ["A1", "C0"]
        await turns.close()
        assert turns.started == ["A0", "B0", "C0", "A1"]

    run(scenario())


def test_empty_session_id_falls_through_to_global(impl):
    async def scenario():
        gate = make_gate(impl, 3, 0, "reject", max_concurrent_runs_per_scope=1)
        turns = Turns(impl, gate)
        for name in "abcd":
            await turns.arrive(name, "")
        assert turns.named("running") == ["a", "b", "c"]
        assert turns.named("rejected") == ["d"]
        await turns.close()

    run(scenario())


# =====================================================================================
# Divergence 2: cancellation never leaks a slot (the reference's gateway goes dead).
# =====================================================================================


def _check_accounting(turns: Turns, arrivals: int) -> None:
    gate = turns.gate
    assert gate.queued == 0
    total = gate.admitted + gate.rejected + gate.shed + gate.cancelled
    assert total == arrivals, gate.stats()
    assert gate.stats()["cancelled"] == gate.cancelled


def test_divergence_cancelled_waiter_does_not_leak_slot(impl):
    async def scenario():
        gate = make_gate(impl, 1, 5)
        turns = Turns(impl, gate)
        await turns.arrive("a")
        await turns.arrive("b")
        await turns.cancel("b")
        assert turns.state["b"] == "cancelled"
        assert (gate.in_flight, gate.queued) == (1, 0)
        await turns.finish("a")
        await turns.arrive("c")
        if impl.is_reference:
            # Known reference failure: b's orphaned acquire took the freed slot for good;
            # the gate reports itself idle, yet c can never run.
            assert (gate.in_flight, gate.queued) == (0, 0)
            assert turns.state["c"] == "waiting"
            await turns.close()
            return
        assert turns.named("running") == ["c"]
        assert gate.cancelled == 1
        await turns.finish("c")
        for name in "defg":  # and the gate keeps working
            await turns.arrive(name)
            await turns.finish(name)
        _check_accounting(turns, 7)
        assert (gate.admitted, gate.cancelled) == (6, 1)

    run(scenario())


def test_divergence_wait_for_timeout_does_not_leak_slot(impl):
    async def scenario():
        gate = make_gate(impl, 1, 5)
        turns = Turns(impl, gate)
        await turns.arrive("a")

        async def impatient():
            async with gate.admit(session_id="impatient"):
                pytest.fail("the timed-out turn ran")

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(impatient(), 0.01)
        await settle()
        assert gate.queued == 0
        await turns.finish("a")
        await turns.arrive("b")
        if impl.is_reference:
            assert turns.state["b"] == "waiting"
            assert gate.in_flight == 0
            await turns.close()
            return
        assert turns.named("running") == ["b"]
        await turns.finish("b")
        _check_accounting(turns, 3)
        assert gate.cancelled == 1

    run(scenario())


def test_divergence_cancel_as_slot_is_granted_passes_it_on(impl):
    async def scenario():
        gate = make_gate(impl, 1, 5)
        turns = Turns(impl, gate)
        for name in "abc":
            await turns.arrive(name)
        # a leaves the gate (its slot goes to b), and in the same instant, before b
        # can run, b is cancelled: the slot must pass to c.
        turns._release["a"].set()
        while turns.state["a"] == "running":
            await asyncio.sleep(0)
        turns.tasks["b"].cancel()
        await settle()
        assert turns.state["b"] == "cancelled"
        assert "b" not in turns.started
        if impl.is_reference:
            assert turns.state["c"] == "waiting"
            assert (gate.in_flight, gate.queued) == (0, 1)
            await turns.close()
            return
        assert turns.named("running") == ["c"]
        await turns.finish("c")
        await turns.arrive("d")
        await turns.finish("d")
        _check_accounting(turns, 4)
        assert gate.in_flight == 0

    run(scenario())


def test_divergence_many_cancelled_waiters_with_ceiling_two(impl):
    async def scenario():
        gate = make_gate(impl, 2, 50, "queue")
        turns = Turns(impl, gate)
        for i in range(12):
            await turns.arrive(f"t{i}")
        for i in range(2, 12, 2):  # cancel every other waiter
            await turns.cancel(f"t{i}")
        assert gate.queued == 5
        order = []
        while turns.named("running"):
            name = turns.named("running")[0]
            order.append(name)
            await turns.finish(name)
        if impl.is_reference:
            assert len(order) < 7  # leaked slots strand live waiters
            assert turns.named("waiting")
            await turns.close()
            return
        assert turns.started == ["t0", "t1", "t3", "t5", "t7", "t9", "t11"]
        _check_accounting(turns, 12)
        assert gate.cancelled == 5

    run(scenario())


# =====================================================================================
# Divergence 3: soft memory pressure applies backpressure while slots are free.
# =====================================================================================


def _soft_gate(impl, depth=10, overflow="reject"):
    gate = make_gate(impl, 4, depth, overflow, resource_policy=impl.MemoryPressurePolicy(100, 200))
    sampler = FakeSampler(50, sample_cls=impl.ResourceSample)
    gate._resource_sampler = sampler
    return gate, sampler


def test_divergence_soft_pressure_queues_with_free_slots(impl):
    async def scenario():
        gate, sampler = _soft_gate(impl)
        turns = Turns(impl, gate)
        await turns.arrive("a")
        sampler.rss_mb = 150
        await turns.arrive("b")
        await turns.arrive("c")
        if impl.is_reference:
            # Known reference failure: soft pressure changes nothing while slots are free.
            assert turns.named("running") == ["a", "b", "c"]
            assert (gate.in_flight, gate.queued) == (3, 0)
            await turns.close()
            return
        assert turns.named("running") == ["a"]
        assert turns.named("waiting") == ["b", "c"]
        assert turns.counters() == {
            "in_flight": 1,
            "queued": 2,
            "admitted": 1,
            "rejected": 0,
            "shed": 0,
        }
        await turns.finish("a")  # one finishes, one is dispatched
        assert turns.named("running") == ["b"]
        assert turns.named("waiting") == ["c"]
        await turns.finish("b")
        await turns.finish("c")
        assert turns.started == ["a", "b", "c"]
        assert turns.counters() == {
            "in_flight": 0,
            "queued": 0,
            "admitted": 3,
            "rejected": 0,
            "shed": 0,
        }

    run(scenario())


def test_divergence_soft_pressure_refuses_nobody_while_slots_are_free(impl):
    async def scenario():
        gate, sampler = _soft_gate(impl, depth=1, overflow="reject")
        turns = Turns(impl, gate)
        await turns.arrive("a")
        sampler.rss_mb = 199.9
        await turns.arrive("b")
        await turns.arrive("c")
        if impl.is_reference:
            assert turns.named("running") == ["a", "b", "c"]
            assert gate.rejected == 0
            await turns.close()
            return
        # Soft pressure holds back turns that would run at once outside the depth: nobody
        # is refused while slots are free (issue 8), the turns wait instead of running.
        assert turns.named("running") == ["a"]
        assert turns.named("waiting") == ["b", "c"]
        await turns.finish("a")  # one out, the oldest waiter in
        assert turns.named("running") == ["b"]
        await turns.finish("b")
        await turns.finish("c")
        assert turns.started == ["a", "b", "c"]
        assert (gate.admitted, gate.rejected, gate.in_flight) == (3, 0, 0)

    run(scenario())


def test_divergence_soft_pressure_shed_oldest_evicts_no_held_back_turn(impl):
    async def scenario():
        gate, sampler = _soft_gate(impl, depth=1, overflow="shed_oldest")
        turns = Turns(impl, gate)
        await turns.arrive("a")
        sampler.rss_mb = 150
        await turns.arrive("b")
        await turns.arrive("c")
        if impl.is_reference:
            assert turns.named("running") == ["a", "b", "c"]
            assert gate.shed == 0
            await turns.close()
            return
        # Held back outside the depth: nobody to evict, nobody refused.
        assert turns.named("waiting") == ["b", "c"]
        assert (gate.shed, gate.rejected) == (0, 0)
        await turns.close()

    run(scenario())


def test_divergence_waiters_take_free_slots_when_pressure_falls(impl):
    """A release with RSS back below soft lets every waiter that fits take a slot."""

    async def scenario():
        gate, sampler = _soft_gate(impl)
        turns = Turns(impl, gate)
        await turns.arrive("a")
        await turns.arrive("b")
        sampler.rss_mb = 150
        for name in "cde":
            await turns.arrive(name)
        if impl.is_reference:
            assert turns.named("running") == ["a", "b", "c", "d"]
            assert turns.named("waiting") == ["e"]  # only the real ceiling held it
            await turns.close()
            return
        assert turns.named("waiting") == ["c", "d", "e"]
        await turns.finish("a")  # still under soft pressure: one out, one in
        assert turns.named("running") == ["b", "c"]
        sampler.rss_mb = 50
        await turns.finish("b")  # pressure gone: both waiters fit in the free slots
        assert turns.named("running") == ["c", "d", "e"]
        assert turns.named("waiting") == []
        assert turns.started == ["a", "b", "c", "d", "e"]
        await turns.close()
        assert (gate.admitted, gate.in_flight, gate.queued) == (5, 0, 0)

    run(scenario())


def test_divergence_soft_waiter_takes_the_free_slot_before_a_newcomer(impl):
    async def scenario():
        gate = make_gate(impl, 2, 10, resource_policy=impl.MemoryPressurePolicy(100, 200))
        sampler = FakeSampler(50, sample_cls=impl.ResourceSample)
        gate._resource_sampler = sampler
        turns = Turns(impl, gate)
        await turns.arrive("a")
        sampler.rss_mb = 150
        await turns.arrive("b")
        if impl.is_reference:
            assert turns.named("running") == ["a", "b"]
            await turns.close()
            return
        assert turns.named("waiting") == ["b"]
        sampler.rss_mb = 50
        await turns.arrive("c")  # one free slot: it is b's, c waits behind
        assert turns.named("running") == ["a", "b"]
        assert turns.named("waiting") == ["c"]
        await turns.finish("a")
        assert turns.started == ["a", "b", "c"]
        await turns.close()

    run(scenario())


def test_divergence_newcomer_does_not_overtake_soft_pressure_waiters(impl):
    """RSS falls with nobody finishing: a newcomer goes behind the turns already waiting."""

    async def scenario():
        gate, sampler = _soft_gate(impl)
        turns = Turns(impl, gate)
        await turns.arrive("a")
        sampler.rss_mb = 150
        await turns.arrive("b")
        await turns.arrive("c")
        if impl.is_reference:
            assert turns.named("running") == ["a", "b", "c"]
            await turns.close()
            return
        assert turns.named("waiting") == ["b", "c"]
        sampler.rss_mb = 50
        await turns.arrive("d")
        assert turns.named("running") == ["a", "b", "c", "d"]
        assert turns.started == ["a", "b", "c", "d"]
        await turns.close()
        assert (gate.admitted, gate.in_flight, gate.queued) == (4, 0, 0)

    run(scenario())


# =====================================================================================
# Divergence 4: misconfiguration fails fast (the reference silently drops protection).
# test_validation.py covers every argument; these are the cases the issue names.
# =====================================================================================

NAN = float("nan")
INF = float("inf")

MISCONFIGURATIONS = [
    pytest.param(
        "build_memory_pressure_policy",
        (-1,),
        {},
        "max_rss_mb",
        id="negative-max_rss_mb",
    ),
    pytest.param(
        "build_memory_pressure_policy",
        ("1gb",),
        {},
        "max_rss_mb",
        id="non-numeric-max_rss_mb",
    ),
    pytest.param("build_memory_pressure_policy", (NAN,), {}, "max_rss_mb", id="nan-max_rss_mb"),
    pytest.param("build_memory_pressure_policy", (INF,), {}, "max_rss_mb", id="inf-max_rss_mb"),
    pytest.param("MemoryPressurePolicy", (), {"hard_rss_mb": NAN}, "hard_rss_mb", id="nan-hard"),
    pytest.param("MemoryPressurePolicy", (), {"soft_rss_mb": INF}, "soft_rss_mb", id="inf-soft"),
    pytest.param("build_admission_gate", (True,), {}, "max_concurrent_runs", id="bool-ceiling"),
    pytest.param("build_admission_gate", (2.5,), {}, "max_concurrent_runs", id="float-ceiling"),
    pytest.param("build_admission_gate", (2**31,), {}, "max_concurrent_runs", id="huge-ceiling"),
    pytest.param("build_admission_gate", (4, 2**40), {}, "queue_depth", id="huge-depth"),
    pytest.param("build_admission_gate", (0, -1), {}, "queue_depth", id="ceiling0-negative-depth"),
    pytest.param(
        "build_admission_gate",
        (0, 0, "drop_newest"),
        {},
        "overflow_policy",
        id="ceiling0-bad-overflow",
    ),
]


@pytest.mark.parametrize("factory,args,kwargs,argument", MISCONFIGURATIONS)
def test_divergence_misconfiguration_fails_fast(impl, factory, args, kwargs, argument):
    build = getattr(impl, factory)
    if impl.is_reference:
        result = build(*args, **kwargs)  # known reference failure: no error at all
        if factory == "build_memory_pressure_policy" and args[0] in (-1, "1gb"):
            assert result is None  # memory protection silently off
        return
    with pytest.raises(ValueError) as info:
        build(*args, **kwargs)
    assert argument in str(info.value)
