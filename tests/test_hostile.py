"""Hostile input and hostile hosts.

* Every public constructor and method, given wrong types, huge ints, NaN, infinities or
  negatives, raises a clear ``ValueError``/``TypeError`` naming the argument; never a crash.
* Empty, 100k-character and non-ASCII session ids simply work (with per-scope limits on).
* A policy or sampler that raises or returns garbage is contained: logged once on the
  ``admitgate`` logger, fails open as the reference does, never lets the ceiling be passed.
* An event loop that closes while turns wait on it does not wedge the gate for other loops.
* After ``os.fork()`` the child's gate starts empty and works; the parent's is untouched.
* A Rust panic surfaces as ``admitgate.InternalError`` (an ``Exception``) and the gate keeps
  working.

Tests whose docstring starts "Regression" pin bugs found while writing this file (now fixed);
each docstring says the scenario and what must happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import admitgate
import pytest
from admitgate._admitgate import _panic_inside_gate
from conftest import in_forked_child, run, settle

NAN, INF = math.nan, math.inf
COUNT_ARGS = ("max_concurrent_runs", "queue_depth", "max_concurrent_runs_per_scope")
BAD_COUNTS = [
    2**64,
    -(2**64),
    2**31,
    -1,
    NAN,
    INF,
    -INF,
    1.5,
    True,
    "abc",
    b"1",
    [],
    {},
    object(),
    10**400,
]
BAD_THRESHOLDS = [NAN, INF, -INF, -1, -0.5, -(2**64), "x", True, [], object()]
BAD_OVERFLOW = [5, b"reject", "nope", NAN, [], object(), "reject!"]


def _ids(values):
    return [repr(v)[:20] for v in values]


def assert_names(exc_info, *names):
    """The message, or a note PyO3 attaches ("while processing 'arg'"), names the argument."""
    text = " ".join([str(exc_info.value), *getattr(exc_info.value, "__notes__", [])])
    assert any(name in text for name in names), f"{text!r} does not name {names}"


def drained(gate):
    return (gate.in_flight, gate.queued, gate.awaiting_human) == (0, 0, 0)


# -- 1. arguments ------------------------------------------------------------------------


@pytest.mark.parametrize("arg", COUNT_ARGS)
@pytest.mark.parametrize("bad", BAD_COUNTS, ids=_ids(BAD_COUNTS))
def test_policy_count_arguments(arg, bad):
    with pytest.raises((ValueError, TypeError)) as info:
        admitgate.ConcurrencyLimitPolicy(**{arg: bad})
    assert_names(info, arg)


@pytest.mark.parametrize("arg", COUNT_ARGS)
@pytest.mark.parametrize("bad", BAD_COUNTS, ids=_ids(BAD_COUNTS))
def test_builder_count_arguments(arg, bad):
    kwargs = {"max_concurrent_runs": 4, arg: bad}
    with pytest.raises((ValueError, TypeError)) as info:
        admitgate.build_admission_gate(**kwargs)
    assert_names(info, arg)


@pytest.mark.parametrize("bad", BAD_OVERFLOW, ids=_ids(BAD_OVERFLOW))
def test_overflow_policy_argument(bad):
    for build in (
        lambda: admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=1, overflow_policy=bad),
        lambda: admitgate.build_admission_gate(max_concurrent_runs=1, overflow_policy=bad),
        lambda: admitgate.build_admission_gate(max_concurrent_runs=0, overflow_policy=bad),
    ):
        with pytest.raises((ValueError, TypeError)) as info:
            build()
        assert_names(info, "overflow_policy")


@pytest.mark.parametrize("arg", ["soft_rss_mb", "hard_rss_mb"])
@pytest.mark.parametrize("bad", BAD_THRESHOLDS + [10**400], ids=_ids(BAD_THRESHOLDS + [10**400]))
def test_memory_policy_thresholds(arg, bad):
    with pytest.raises((ValueError, TypeError)) as info:
        admitgate.MemoryPressurePolicy(**{arg: bad})
    assert_names(info, arg)


@pytest.mark.parametrize("bad", BAD_THRESHOLDS, ids=_ids(BAD_THRESHOLDS))
def test_build_memory_pressure_policy_arguments(bad):
    with pytest.raises((ValueError, TypeError)) as info:
        admitgate.build_memory_pressure_policy(bad)
    assert_names(info, "max_rss_mb")


BAD_RATIOS = [NAN, INF, -INF, "x", True, [], object()]  # negative ratios clamp to 0


@pytest.mark.parametrize("bad", BAD_RATIOS, ids=_ids(BAD_RATIOS))
def test_build_memory_pressure_policy_soft_ratio(bad):
    with pytest.raises((ValueError, TypeError)) as info:
        admitgate.build_memory_pressure_policy(1024, soft_ratio=bad)
    assert_names(info, "soft_ratio")


@pytest.mark.parametrize("value", [2**64, 1e300])
def test_huge_but_finite_thresholds_are_accepted(value):
    policy = admitgate.MemoryPressurePolicy(soft_rss_mb=1.0, hard_rss_mb=value)
    assert policy.hard_rss_mb == float(value)
    assert admitgate.build_memory_pressure_policy(value).hard_rss_mb == float(value)


def test_build_memory_pressure_policy_int_beyond_float_range():
    """Regression. Before the fix, build_memory_pressure_policy(max_rss_mb=10**400) (and soft_ratio=10**400) raise
    OverflowError('int too large to convert to float'), which is neither ValueError nor
    TypeError and does not name the argument; MemoryPressurePolicy(hard_rss_mb=10**400)
    gives the expected ValueError. Expected: ValueError naming max_rss_mb / soft_ratio."""
    wrong = []
    for bad in (10**400, -(10**400)):
        for arg, call in (
            ("max_rss_mb", lambda bad=bad: admitgate.build_memory_pressure_policy(bad)),
            (
                "soft_ratio",
                lambda bad=bad: admitgate.build_memory_pressure_policy(1024, soft_ratio=bad),
            ),
        ):
            try:
                call()
                wrong.append(f"{arg}=±10**400: no error")
            except (ValueError, TypeError) as exc:
                if arg not in str(exc):
                    wrong.append(f"{arg}: {type(exc).__name__} does not name it")
            except Exception as exc:
                wrong.append(f"{arg}: {type(exc).__name__}: {exc}")
    assert not wrong, "\n".join(wrong)


DECIDE_FACTS = ("in_flight", "queued", "scope_in_flight", "scope_queued")
BAD_FACTS = [-1, 2**64, NAN, "x", None]


@pytest.mark.parametrize("fact", DECIDE_FACTS)
@pytest.mark.parametrize("bad", BAD_FACTS, ids=_ids(BAD_FACTS))
def test_decide_bad_facts_raise_never_crash(fact, bad):
    policy = admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=2, queue_depth=1)
    facts = {"in_flight": 0, "queued": 0, fact: bad}
    with pytest.raises((TypeError, ValueError, OverflowError)):
        policy.decide(**facts)
    # Still a working policy afterwards.
    assert policy.decide(in_flight=2, queued=1).value == "reject"


@pytest.mark.parametrize("fact", DECIDE_FACTS)
@pytest.mark.parametrize("bad", [NAN, "x", None], ids=["nan", "str", "None"])
def test_decide_wrong_type_facts_name_the_argument(fact, bad):
    policy = admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=2, queue_depth=1)
    with pytest.raises(TypeError) as info:
        policy.decide(**{"in_flight": 0, "queued": 0, fact: bad})
    assert_names(info, fact)


def test_decide_out_of_range_facts_raise_value_error():
    """Regression. Before the fix, ConcurrencyLimitPolicy.decide(in_flight=-1) or (in_flight=2**64), and the
    same for queued / scope_in_flight / scope_queued, raise OverflowError ("can't convert
    negative int to unsigned" / "int too big to convert"; the argument is only in a note),
    not the ValueError/TypeError every other bad argument gets. Expected: ValueError naming
    the argument (e.g. "in_flight must be >= 0, got -1")."""
    policy = admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=2, queue_depth=1)
    wrong = []
    for fact in DECIDE_FACTS:
        for bad in (-1, 2**64):
            try:
                policy.decide(**{"in_flight": 0, "queued": 0, fact: bad})
                wrong.append(f"{fact}={bad}: no error")
            except (ValueError, TypeError) as exc:
                if fact not in str(exc):
                    wrong.append(f"{fact}={bad}: {exc!r} does not name it")
            except Exception as exc:
                wrong.append(f"{fact}={bad}: {type(exc).__name__}: {exc}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("arg", ["session_id", "scope"])
@pytest.mark.parametrize("bad", [5, b"x", None, object()], ids=["int", "bytes", "None", "object"])
def test_decide_string_facts_wrong_type(arg, bad):
    policy = admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=2)
    with pytest.raises(TypeError):
        policy.decide(in_flight=0, queued=0, **{arg: bad})


def test_decide_is_keyword_only_and_complete():
    policy = admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=2)
    with pytest.raises(TypeError):
        policy.decide(1, 2)
    with pytest.raises(TypeError) as info:
        policy.decide(queued=0)
    assert_names(info, "in_flight")
    with pytest.raises(TypeError):
        policy.decide(in_flight=0, queued=0, bogus=1)


@pytest.mark.parametrize(
    "sample, error",
    [
        (admitgate.ResourceSample(rss_mb="x"), TypeError),
        (admitgate.ResourceSample(rss_mb=NAN), TypeError),
        (admitgate.ResourceSample(rss_mb=[1]), TypeError),
        (admitgate.ResourceSample(rss_mb=True), TypeError),
        (admitgate.ResourceSample(rss_mb=None), None),
        (object(), None),
        (None, None),
    ],
    ids=["str", "nan", "list", "bool", "none", "no-attr", "None-sample"],
)
def test_memory_policy_evaluate_garbage_samples(sample, error):
    policy = admitgate.MemoryPressurePolicy(soft_rss_mb=10, hard_rss_mb=20)
    if error is None:
        assert policy.evaluate(sample).value == "admit"
    else:
        with pytest.raises(error) as info:
            policy.evaluate(sample)
        assert_names(info, "rss_mb")


def test_gate_constructor_arguments():
    policy = admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=2)
    with pytest.raises(TypeError) as info:
        admitgate.AdmissionGate(policy, resource_policy=5)
    assert_names(info, "resource_policy")
    for bad in (5, object(), "sampler"):
        with pytest.raises(TypeError) as info:
            admitgate.AdmissionGate(policy, resource_sampler=bad)
        assert_names(info, "resource_sampler")
    with pytest.raises(TypeError):
        admitgate.AdmissionGate()
    with pytest.raises(TypeError):
        admitgate.AdmissionGate(policy, None)
    with pytest.raises(TypeError):
        admitgate.AdmissionGate(policy, bogus=1)
    for bad in (-1, 2**64, NAN, "x"):

        class Garbage:
            max_concurrent_runs = bad

        with pytest.raises((ValueError, TypeError)) as info:
            admitgate.AdmissionGate(Garbage())
        assert_names(info, "max_concurrent_runs")


def test_gate_method_arguments():
    gate = admitgate.build_admission_gate(max_concurrent_runs=2)
    # session_id takes anything, keyed by str() as in the reference (tests/test_hardening.py).
    for bad in (5, b"x", 1.5, object(), ["a"]):
        with pytest.raises(TypeError) as info:
            gate.admit(transport=bad)
        assert_names(info, "transport")
    for bad in ("", "UPPER", "a-b", "x" * 33, "passthrough"):
        with pytest.raises(ValueError) as info:
            gate.admit(transport=bad)
        assert_names(info, "transport")
    with pytest.raises(TypeError):
        gate.admit("positional")
    with pytest.raises(TypeError):
        gate.admit(session="x")
    with pytest.raises(TypeError) as info:
        gate._resource_sampler = 5
    assert_names(info, "resource_sampler")
    with pytest.raises(TypeError):
        gate.stats(1)
    with pytest.raises(TypeError):
        gate._shed_oldest_waiter(1)
    with pytest.raises(TypeError):
        _panic_inside_gate(5)
    with pytest.raises(TypeError):
        _panic_inside_gate(None)
    with pytest.raises(TypeError):
        admitgate.RssSampler(5)
    for attr in ("in_flight", "queued", "admitted", "rejected", "shed", "cancelled"):
        with pytest.raises(AttributeError):
            setattr(gate, attr, 0)
    policy = admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=2)
    for attr in COUNT_ARGS + ("overflow_policy",):
        with pytest.raises(AttributeError):
            setattr(policy, attr, 5)
    assert gate.stats()["admitted"] == 0 and gate.in_flight == 0


def test_admission_misuse_is_refused_and_leaks_nothing():
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=2)

    async def main():
        admission = gate.admit(session_id="s")
        async with admission:
            with pytest.raises(RuntimeError):
                await admission.__aenter__()
            assert gate.in_flight == 1
        assert gate.in_flight == 0
        # __aexit__ twice is harmless: the slot is returned exactly once.
        await admission.__aexit__(None, None, None)
        assert gate.in_flight == 0

    run(main(), timeout=10.0)
    # A queued admission driven outside any event loop is refused and leaves the queue.
    holder = gate.admit()
    holder.__aenter__()
    assert gate.in_flight == 1
    with pytest.raises(RuntimeError):
        next(gate.admit().__aenter__().__await__())
    assert (gate.queued, gate.cancelled) == (0, 1)
    # A queued wait that is created and dropped also leaves the queue.
    wait = gate.admit().__aenter__()
    assert gate.queued == 1
    del wait
    gc.collect()
    assert (gate.queued, gate.cancelled) == (0, 2)
    run(holder.__aexit__(None, None, None), timeout=10.0)
    assert drained(gate)
    assert (gate.admitted, gate.cancelled) == (2, 2)


def test_abandoned_entered_admission_returns_its_slot():
    """Regression. Before the fix, an entered admission abandoned without __aexit__ never returns its slot, although
    Admission's Drop promises it does ("still returns its slot exactly once"): __aenter__
    takes an extra reference to the Admission that only __aexit__ drops, so the object is
    never freed. Scenario: `stack = AsyncExitStack(); await
    stack.enter_async_context(gate.admit())`, then the stack is dropped without aclose().
    Expected (and what the reference gate does): in_flight returns to 0 and the next turn
    is admitted. Got: in_flight stays 1 forever; with a ceiling of 1 the gateway is dead."""
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1, queue_depth=4, overflow_policy="queue"
    )

    async def main():
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(gate.admit(session_id="s"))
        assert gate.in_flight == 1
        del stack
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.01)
        assert gate.in_flight == 0, "the abandoned turn's slot was never returned"

    run(main(), timeout=10.0)


# -- 2. session ids --------------------------------------------------------------------------

ODD_IDS = [
    "x" * 100_000,
    "y" * 100_000,
    "租户-🚀",
    "é",
    "e\u0301",  # a different string from "é": a different tenant
    "a\x00b",
    "שלום",
    " ",
    "\U0010ffff",
]


def test_odd_session_ids_work_as_separate_tenants():
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=64,
        queue_depth=64,
        overflow_policy="queue",
        max_concurrent_runs_per_scope=1,
    )
    release = None
    ran: list[str] = []

    async def turn(session):
        async with gate.admit(session_id=session):
            ran.append(session)
            await release.wait()

    async def main():
        nonlocal release
        release = asyncio.Event()
        firsts = [asyncio.ensure_future(turn(s)) for s in ODD_IDS + ["", ""]]
        await settle(20)
        # Every tenant's first turn runs; both unscoped ("") turns run (global gate only).
        assert gate.in_flight == len(ODD_IDS) + 2 and gate.queued == 0
        seconds = [asyncio.ensure_future(turn(s)) for s in ODD_IDS]
        await settle(20)
        # Each tenant is at its sub-limit of 1: its second turn waits.
        assert gate.queued == len(ODD_IDS) and gate.in_flight == len(ODD_IDS) + 2
        release.set()
        await asyncio.gather(*firsts, *seconds)

    run(main(), timeout=10.0)
    assert sorted(ran) == sorted(ODD_IDS * 2 + ["", ""])
    assert drained(gate) and gate.admitted == 2 * len(ODD_IDS) + 2


def test_lone_surrogate_session_id():
    """Regression. Before the fix, a session id holding a lone surrogate (json.loads('"\\ud800"') gives one, so a
    client can send it) makes `async with gate.admit(session_id=...)` raise
    UnicodeEncodeError ("surrogates not allowed"), with or without a per-scope limit.
    Expected (what the reference does): the turn is admitted like any other tenant."""
    import json

    session = json.loads('"user-\\ud800"')
    assert session == "user-\ud800"
    wrong = []
    for per_scope in (0, 1):
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=2, max_concurrent_runs_per_scope=per_scope
        )

        async def main(gate=gate):
            async with gate.admit(session_id=session):
                assert gate.in_flight == 1

        try:
            run(main(), timeout=10.0)
        except Exception as exc:
            wrong.append(f"per_scope={per_scope}: {type(exc).__name__}: {exc}")
        assert drained(gate)  # whatever happens, nothing leaks
        if not wrong:
            assert gate.admitted == 1
    assert not wrong, "\n".join(wrong)


# -- 3. hostile policies and samplers ------------------------------------------------------


class _RaisingValue:
    @property
    def value(self):
        raise RuntimeError("value exploded")


DECIDE_GARBAGE = {
    "raises": RuntimeError("policy broke"),
    "int": 42,
    "none": None,
    "unknown-str": "maybe",
    "object": object(),
    "value-raises": _RaisingValue(),
    "bytes": b"admit",
}


class HostilePolicy:
    max_concurrent_runs = 2
    queue_depth = 1
    overflow_policy = "reject"
    max_concurrent_runs_per_scope = 0

    def __init__(self, answer):
        self.answer = answer
        self.calls = 0

    def decide(self, **facts):
        self.calls += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


async def _burst(gate, n, meter, session=""):
    """n turns arrive; returns (tasks, release event); meter tracks concurrency in bodies."""
    release = asyncio.Event()

    async def turn():
        try:
            async with gate.admit(session_id=session):
                meter["now"] += 1
                meter["peak"] = max(meter["peak"], meter["now"])
                await release.wait()
                meter["now"] -= 1
            return "ran"
        except admitgate.AdmissionRejected as exc:
            return exc.reason

    tasks = [asyncio.ensure_future(turn()) for _ in range(n)]
    await settle(20)
    return tasks, release


def _admitgate_warnings(caplog, text):
    return [
        r
        for r in caplog.records
        if r.name == "admitgate" and r.levelno == logging.WARNING and text in r.getMessage()
    ]


@pytest.mark.parametrize("answer", list(DECIDE_GARBAGE.values()), ids=list(DECIDE_GARBAGE))
def test_hostile_policy_is_contained(answer, caplog):
    caplog.set_level(logging.INFO, logger="admitgate")
    policy = HostilePolicy(answer)
    gate = admitgate.AdmissionGate(policy)
    meter = {"now": 0, "peak": 0}

    async def main():
        for _ in range(2):  # two bursts: still logged only once
            tasks, release = await _burst(gate, 6, meter)
            # Fail open (treated as admit): nobody is rejected, the ceiling still holds.
            assert gate.in_flight == 2 and gate.queued == 4
            release.set()
            assert await asyncio.gather(*tasks) == ["ran"] * 6

    run(main(), timeout=10.0)
    assert policy.calls >= 12
    assert meter["peak"] <= 2 and gate.peak_in_flight <= 2
    assert drained(gate) and gate.admitted == 12 and gate.rejected == 0
    assert len(_admitgate_warnings(caplog, "decide")) == 1, caplog.text


SAMPLER_GARBAGE = {
    "raises": ("raise", True),
    "str": ("x", True),
    "nan": (NAN, True),
    "list": ([1], True),
    "bool": (True, True),
    "missing-attr": ("missing", False),  # the reference admits silently too
    "not-a-sample": ("none-object", False),
    "read-not-callable": ("not-callable", True),
}


class HostileSampler:
    def __init__(self, mode):
        self.mode = mode
        if mode == "not-callable":
            self.read = 5

    def read(self):
        if self.mode == "raise":
            raise RuntimeError("sampler broke")
        if self.mode == "missing":
            return object()
        if self.mode == "none-object":
            return None
        return admitgate.ResourceSample(rss_mb=self.mode)


@pytest.mark.parametrize("mode, logged", list(SAMPLER_GARBAGE.values()), ids=list(SAMPLER_GARBAGE))
def test_hostile_sampler_is_contained(mode, logged, caplog):
    caplog.set_level(logging.INFO, logger="admitgate")
    gate = admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=2, queue_depth=1),
        resource_policy=admitgate.MemoryPressurePolicy(soft_rss_mb=10, hard_rss_mb=20),
        resource_sampler=HostileSampler(mode),
    )
    meter = {"now": 0, "peak": 0}

    async def main():
        for _ in range(2):
            tasks, release = await _burst(gate, 5, meter)
            # Fails open on memory; the concurrency policy still applies in full.
            assert (gate.in_flight, gate.queued) == (2, 1)
            release.set()
            assert sorted(await asyncio.gather(*tasks)) == ["queue_full"] * 2 + ["ran"] * 3

    run(main(), timeout=10.0)
    assert meter["peak"] <= 2 and gate.peak_in_flight <= 2
    assert drained(gate) and (gate.admitted, gate.rejected) == (6, 4)
    found = _admitgate_warnings(caplog, "resource")
    assert len(found) == (1 if logged else 0), caplog.text


@pytest.mark.parametrize("answer", ["raise", 42, "soft-ish", None])
def test_hostile_foreign_resource_policy_is_contained(answer, caplog):
    caplog.set_level(logging.INFO, logger="admitgate")

    class Ladder:
        enabled = True
        hard_rss_mb = "not a number"

        def evaluate(self, sample):
            if answer == "raise":
                raise ValueError("ladder broke")
            return answer

    class Sampler:
        def read(self):
            return admitgate.ResourceSample(rss_mb=1.0)

    gate = admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=1, queue_depth=0),
        resource_policy=Ladder(),
        resource_sampler=Sampler(),
    )
    meter = {"now": 0, "peak": 0}

    async def main():
        tasks, release = await _burst(gate, 3, meter)
        release.set()
        assert sorted(await asyncio.gather(*tasks)) == ["queue_full", "queue_full", "ran"]

    run(main(), timeout=10.0)
    assert gate.stats()["max_rss_mb"] == 0.0  # garbage hard_rss_mb does not break stats()
    assert meter["peak"] == 1 and drained(gate)
    assert len(_admitgate_warnings(caplog, "resource")) == 1, caplog.text


def test_reentrant_policy_and_sampler_do_not_deadlock():
    """A policy and a sampler that call back into the gate (stats, shed, admit) while it
    decides: no deadlock (run in a subprocess so a deadlock fails instead of hanging)."""
    code = textwrap.dedent(
        """
        import asyncio, admitgate
        box = {}
        class Policy:
            max_concurrent_runs = 1; queue_depth = 2; overflow_policy = "queue"
            def decide(self, **facts):
                g = box["g"]; g.stats(); g.in_flight; g.peak_in_flight; g.admit(session_id="x")
                return "admit"
        class Sampler:
            def read(self):
                box["g"].stats(); box["g"]._shed_oldest_waiter()
                return admitgate.ResourceSample(rss_mb=1.0)
        g = box["g"] = admitgate.AdmissionGate(
            Policy(), resource_policy=admitgate.MemoryPressurePolicy(10, 20), resource_sampler=Sampler())
        async def main():
            release = asyncio.Event(); out = []
            async def turn():
                try:
                    async with g.admit(session_id="s"):
                        out.append("ran"); await release.wait()
                except admitgate.AdmissionRejected as e:
                    out.append(e.reason)
            tasks = [asyncio.ensure_future(turn()) for _ in range(4)]
            for _ in range(20): await asyncio.sleep(0)
            release.set(); await asyncio.gather(*tasks)
            assert sorted(out) == ["ran", "shed", "shed", "shed"], out
            s = g.stats()
            assert (s["in_flight"], s["queued"], s["admitted"], s["shed"]) == (0, 0, 1, 3), s
        asyncio.run(main())
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# -- 4. event loops that go away -------------------------------------------------------------


def _other_thread(target):
    errors = []

    def wrap():
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=wrap, daemon=True)
    thread.start()
    return thread, errors


def test_closed_loop_with_waiters_does_not_wedge_other_loops(caplog):
    caplog.set_level(logging.WARNING, logger="admitgate")
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1, queue_depth=8, overflow_policy="queue"
    )
    keep = []  # A's tasks stay referenced: only the closed loop can tell they are dead

    async def a_waiter():
        async with gate.admit(session_id="a"):
            raise AssertionError("a turn of the closed loop ran")

    def loop_a():
        loop = asyncio.new_event_loop()
        keep.extend(loop.create_task(a_waiter()) for _ in range(3))
        for _ in range(5):
            loop.run_until_complete(asyncio.sleep(0))
        keep.append(loop)
        loop.close()  # without cancelling its tasks

    async def main():
        release = asyncio.Event()

        async def holder():
            async with gate.admit(session_id="b0"):
                await release.wait()

        h = asyncio.ensure_future(holder())
        await settle(20)
        thread, errors = _other_thread(loop_a)
        await asyncio.to_thread(thread.join, 10)
        assert not errors and gate.queued == 3
        ran = []

        async def b_turn(name):
            async with gate.admit(session_id=name):
                ran.append(name)

        bs = [asyncio.ensure_future(b_turn(f"b{i}")) for i in range(2)]
        await settle(20)
        release.set()
        await h
        await asyncio.wait_for(asyncio.gather(*bs), 5)
        assert ran == ["b0", "b1"]

    run(main(), timeout=10.0)
    assert drained(gate)
    assert (gate.admitted, gate.cancelled) == (3, 3)
    assert len(_admitgate_warnings(caplog, "closed")) >= 1


def test_loop_shut_down_by_asyncio_run_withdraws_its_waiters():
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1, queue_depth=8, overflow_policy="queue"
    )

    def loop_a():
        async def main():
            async def waiter():
                async with gate.admit(session_id="a"):
                    pass

            for _ in range(3):
                asyncio.ensure_future(waiter())
            await settle(20)
            # main returns with its waiters pending: asyncio.run cancels them.

        asyncio.run(main())

    async def main():
        release = asyncio.Event()

        async def holder():
            async with gate.admit():
                await release.wait()

        h = asyncio.ensure_future(holder())
        await settle(20)
        thread, errors = _other_thread(loop_a)
        await asyncio.to_thread(thread.join, 10)
        assert not errors
        assert (gate.queued, gate.cancelled) == (0, 3)
        release.set()
        await h
        async with gate.admit():
            assert gate.in_flight == 1

    run(main(), timeout=10.0)
    assert drained(gate) and gate.admitted == 2


def test_paused_loop_keeps_its_slot_and_resumes_it():
    """A loop that is not running (not closed) is indistinguishable from a busy one: a slot
    freed on another loop, in another thread, is granted to its waiter and claimed when the
    loop runs again; nothing is lost."""
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1, queue_depth=4, overflow_policy="queue"
    )
    held, go = threading.Event(), threading.Event()

    def loop_b():
        async def holder():
            async with gate.admit(session_id="b"):
                held.set()
                assert await asyncio.to_thread(go.wait, 10)

        asyncio.run(holder())

    thread, errors = _other_thread(loop_b)
    assert held.wait(10)
    loop = asyncio.new_event_loop()
    ran = []

    async def turn():
        async with gate.admit(session_id="a"):
            ran.append(threading.get_ident())

    try:
        w = loop.create_task(turn())
        loop.run_until_complete(settle(20))
        assert (gate.in_flight, gate.queued) == (1, 1)
        go.set()  # B releases while loop A is idle, not running
        thread.join(10)
        assert not errors and not thread.is_alive()
        assert (gate.in_flight, gate.queued, gate.admitted) == (1, 0, 1)  # granted, unclaimed
        loop.run_until_complete(asyncio.wait_for(w, 5))
    finally:
        loop.close()
    assert ran == [threading.get_ident()]
    assert drained(gate) and gate.admitted == 2


def test_loop_stopped_then_closed_hands_on_the_slot_it_was_granted():
    """Regression. Before the fix, a waiter's loop stops running (its thread leaves run_forever), a slot is freed on
    another loop and granted to that waiter (call_soon_threadsafe succeeds: the loop is not
    closed yet), then the stopped loop is closed without its tasks being cancelled. close()
    drops the pending callback, the granted slot is never claimed nor handed on: in_flight
    stays 1 with nothing running and every later turn waits forever (ceiling 1: a dead
    gateway). Expected: the next waiter on a live loop gets the slot."""
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1, queue_depth=5, overflow_policy="queue"
    )
    box = {}

    async def a_waiter():
        async with gate.admit(session_id="a"):
            pass

    def loop_a(started, close_now):
        loop = box["loop"] = asyncio.new_event_loop()
        box["task"] = loop.create_task(a_waiter())
        loop.call_soon(started.set)
        loop.run_forever()  # returns once stopped
        close_now.wait(10)
        loop.close()

    async def main():
        release = asyncio.Event()

        async def holder():
            async with gate.admit(session_id="b0"):
                await release.wait()

        h = asyncio.ensure_future(holder())
        await settle(20)
        started, close_now = threading.Event(), threading.Event()
        thread = threading.Thread(target=loop_a, args=(started, close_now), daemon=True)
        thread.start()
        assert await asyncio.to_thread(started.wait, 10)
        await asyncio.sleep(0.05)
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        while box["loop"].is_running():
            await asyncio.sleep(0.005)
        assert gate.queued == 1
        release.set()
        await h  # the slot goes to A's waiter, whose loop is stopped
        close_now.set()
        await asyncio.to_thread(thread.join, 10)

        async def b_turn():
            async with gate.admit(session_id="b1"):
                pass

        try:
            await asyncio.wait_for(b_turn(), 2)
            wedged = False
        except asyncio.TimeoutError:
            wedged = True
        assert not wedged, f"gate wedged after the stopped loop closed: {gate.stats()}"

    run(main(), timeout=10.0)
    assert drained(gate)


# -- 5. fork ---------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_starts_with_an_empty_gate():
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1,
        queue_depth=4,
        overflow_policy="queue",
        resource_policy=admitgate.MemoryPressurePolicy(soft_rss_mb=1e6, hard_rss_mb=2e6),
    )
    loop = asyncio.new_event_loop()
    release = asyncio.Event()

    async def turn():
        async with gate.admit(session_id="parent"):
            await release.wait()

    tasks = [loop.create_task(turn()) for _ in range(3)]
    loop.run_until_complete(settle(20))
    before = gate.stats()
    assert (before["in_flight"], before["queued"], before["admitted"]) == (1, 2, 1)

    def child():
        s = gate.stats()
        counters = {
            k: s[k]
            for k in (
                "in_flight",
                "queued",
                "awaiting_human",
                "admitted",
                "rejected",
                "shed",
                "cancelled",
            )
        }
        assert set(counters.values()) == {0}, counters
        assert gate.oldest_wait_seconds is None
        assert gate.peak_in_flight == 0
        sample = gate._resource_sampler.read()
        assert sample.rss_mb is not None and 1 < sample.rss_mb < 1e5, sample

        async def main():
            meter = {"now": 0, "peak": 0}

            async def t():
                async with gate.admit(session_id="child"):
                    meter["now"] += 1
                    meter["peak"] = max(meter["peak"], meter["now"])
                    await asyncio.sleep(0)
                    meter["now"] -= 1

            await asyncio.wait_for(asyncio.gather(*(t() for _ in range(5))), 5)
            assert meter["peak"] == 1

        asyncio.run(main())
        s = gate.stats()
        assert (s["in_flight"], s["queued"], s["admitted"]) == (0, 0, 5), s

    code, message = in_forked_child(child)
    assert code == 0, message
    # The parent's gate was not touched by the child.
    assert gate.stats() == before
    release.set()
    loop.run_until_complete(asyncio.wait_for(asyncio.gather(*tasks), 5))
    loop.close()
    assert drained(gate) and gate.admitted == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_ignores_the_parents_turns_ending():
    """The parent's turn ending in the child (its coroutine finishing, or being collected)
    must not return a slot to the child's gate: that would let the child over-admit."""
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=4)
    parent_turn = gate.admit(session_id="parent")
    loop = asyncio.new_event_loop()
    loop.run_until_complete(parent_turn.__aenter__())
    assert gate.in_flight == 1

    def child():
        assert gate.in_flight == 0

        async def main():
            async with gate.admit(session_id="child"):
                assert gate.in_flight == 1
                await parent_turn.__aexit__(None, None, None)
                assert gate.in_flight == 1, "the parent's exit returned the child's slot"
                with pytest.raises(admitgate.AdmissionRejected):
                    # The only slot is still the child's: once the queue is full, the
                    # next arrival is rejected (it would run if the slot had been freed).
                    await asyncio.wait_for(_fill_and_overflow(gate), 2)

        asyncio.run(main())
        s = gate.stats()
        assert (s["in_flight"], s["queued"]) == (0, 0), s

    code, message = in_forked_child(child)
    assert code == 0, message
    loop.run_until_complete(parent_turn.__aexit__(None, None, None))
    loop.close()
    assert drained(gate)


async def _fill_and_overflow(gate):
    """Fills the queue of a gate whose only slot is held, then overflows it."""
    waiters = [asyncio.ensure_future(_one_turn(gate)) for _ in range(4)]
    await asyncio.sleep(0)
    try:
        async with gate.admit():
            pass
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


async def _one_turn(gate):
    async with gate.admit():
        pass


# -- 6. panics ---------------------------------------------------------------------------------


def test_internal_error_is_an_ordinary_exception():
    assert issubclass(admitgate.InternalError, Exception)
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    try:
        _panic_inside_gate(gate)
    except Exception as exc:  # what BotOS's guards catch
        assert isinstance(exc, admitgate.InternalError)
        assert "panic" in str(exc)
    else:
        pytest.fail("no InternalError")


def test_gate_keeps_working_after_a_panic():
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1, queue_depth=4, overflow_policy="queue"
    )
    order = []

    async def main():
        release = asyncio.Event()

        async def turn(name, wait=False):
            async with gate.admit(session_id=name):
                order.append(name)
                if wait:
                    await release.wait()

        first = asyncio.ensure_future(turn("first", wait=True))
        second = asyncio.ensure_future(turn("second"))
        await settle(20)
        for _ in range(3):
            with pytest.raises(admitgate.InternalError):
                _panic_inside_gate(gate)
        # The state survived the panics intact.
        assert (gate.in_flight, gate.queued, gate.admitted) == (1, 1, 1)
        release.set()
        await asyncio.gather(first, second)
        await turn("third")
        assert gate._shed_oldest_waiter() is False

    run(main(), timeout=10.0)
    assert order == ["first", "second", "third"]
    assert drained(gate) and gate.admitted == 3


def test_panics_racing_other_threads_leave_counters_exact():
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=2, queue_depth=2, overflow_policy="queue"
    )
    panics = []
    stop = threading.Event()

    def panicker():
        while not stop.is_set():
            try:
                _panic_inside_gate(gate)
            except admitgate.InternalError:
                panics.append(1)
            time.sleep(0)

    def worker():
        async def main():
            async def turn():
                async with gate.admit(session_id="w"):
                    await asyncio.sleep(0)

            await asyncio.gather(*(turn() for _ in range(100)))

        asyncio.run(main())

    p = threading.Thread(target=panicker, daemon=True)
    p.start()
    workers = [threading.Thread(target=worker, daemon=True) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(20)
    stop.set()
    p.join(5)
    assert not any(w.is_alive() for w in workers), "a worker is stuck"
    assert panics
    assert drained(gate) and gate.admitted == 300 and gate.peak_in_flight <= 2


def test_closed_loop_cascade_through_many_waiters_uses_constant_stack():
    """Regression. Before the fix, each waiter found on a closed loop withdrew and woke the
    next one recursively: 20,000 such waiters overflowed the stack and killed the process
    (SIGSEGV) when the slot holder left. Now the cascade is a loop, and logs one warning."""
    script = textwrap.dedent(
        """
        import asyncio, logging, sys
        import admitgate
        warnings = []
        class Catch(logging.Handler):
            def emit(self, record):
                warnings.append(record.getMessage())
        logging.getLogger("admitgate").addHandler(Catch())
        N = 30_000
        gate = admitgate.build_admission_gate(
            max_concurrent_runs=1, queue_depth=N, overflow_policy="queue"
        )
        loop = asyncio.new_event_loop()
        async def waiter():
            async with gate.admit():
                pass
        async def fill():
            holder = gate.admit()
            await holder.__aenter__()
            tasks = [asyncio.ensure_future(waiter()) for _ in range(N)]
            await asyncio.sleep(0)
            return holder, tasks
        holder, tasks = loop.run_until_complete(fill())
        assert gate.queued == N
        loop.close()
        asyncio.run(holder.__aexit__(None, None, None))
        s = gate.stats()
        assert (s["in_flight"], s["queued"], s["cancelled"]) == (0, 0, N), s
        assert sum("closed" in w for w in warnings) == 1, warnings
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip().endswith("ok")
