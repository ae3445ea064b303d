"""Budgets (``admitgate.RateLimit``) through the Python gate: the arguments, the refusal and
its exact retry time, ``on_limit="wait"``, tokens reserved and settled, and generated
sequences of turns checked against what the docs promise (docs/budgets.md):

* requests admitted per identity in any window of length T are at most N;
* a turn the budget refuses never takes a slot (the gate's counters do not move);
* a turn refused by the gate or cancelled before it ran gives its reservation back, so the
  budget's counters add up: ``allowed == ran + returned``, tokens likewise.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Awaitable, Callable

import admitgate
import pytest
from admitgate import AdmissionRejected, RateLimit, build_admission_gate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def on_a_loop(test: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """Runs an async test on a fresh event loop (bounded: a wedged budget fails)."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(asyncio.wait_for(test(), 30))

    return run


# --- arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({}, ValueError, "requests= or tokens="),
        ({"requests": "5/week"}, ValueError, "requests='5/week'"),
        ({"requests": "x/min"}, ValueError, "requests='x/min'"),
        ({"requests": (0, 1)}, ValueError, "requests=(0, 1)"),
        ({"requests": (5, 0)}, ValueError, "requests=(5, 0)"),
        ({"requests": 5}, TypeError, "requests must be"),
        ({"requests": []}, ValueError, "requests must name at least one"),
        ({"tokens": ["1000/min", True]}, TypeError, "tokens must be"),
        ({"requests": "1/s", "key": "user"}, TypeError, "key must be a callable"),
        ({"requests": "1/s", "on_limit": "later"}, ValueError, "on_limit must be"),
        ({"requests": "1/s", "name": "a b"}, ValueError, "name must be"),
        ({"requests": "1/s", "name": ""}, ValueError, "name must be"),
        ({"requests": "1/s", "on_backend_error": "ignore"}, ValueError, "on_backend_error"),
        ({"requests": "1/s", "burst": 0}, ValueError, "burst must be"),
        ({"requests": "1/s", "burst": 1.5}, TypeError, "burst must be"),
        ({"requests": "1/s", "fleet": 6379}, TypeError, "fleet must be"),
    ],
)
def test_every_argument_is_checked_by_name(kwargs, error, named):
    with pytest.raises(error, match=None) as caught:
        RateLimit(**kwargs)
    assert named in str(caught.value), str(caught.value)


def test_a_fleet_url_password_never_shows():
    limit = RateLimit(requests=["60/min", "1000/day"], fleet="redis://:hunter2@127.0.0.1:1/0")
    assert "hunter2" not in repr(limit)
    assert "hunter2" not in str(limit.fleet)
    with pytest.raises(ValueError, match="burst") as caught:
        RateLimit(requests="1/s", fleet="redis://:hunter2@127.0.0.1:1/0", burst=3)
    assert "hunter2" not in str(caught.value)
    assert limit.requests == ["60/min", "1000/day"]
    assert limit.tokens == []
    assert (limit.on_limit, limit.name, limit.on_backend_error, limit.burst) == (
        "reject",
        "default",
        "local",
        None,
    )


def test_admit_checks_cost_and_identity():
    gate = build_admission_gate(rate_limit=RateLimit(requests="10/s"))
    with pytest.raises(ValueError, match="cost must be >= 0, got -1"):
        gate.admit(cost=-1)
    with pytest.raises(TypeError, match="cost must be an int"):
        gate.admit(cost=1.5)
    with pytest.raises(TypeError, match="identity must be a str or bytes, got a int"):
        gate.admit(identity=42)
    two = [RateLimit(requests="1/s"), RateLimit(tokens="9/s")]
    with pytest.raises(ValueError, match='two limits are named "default"'):
        admitgate.AdmissionGate(rate_limit=two)
    with pytest.raises(TypeError, match="rate_limit must be"):
        admitgate.AdmissionGate(rate_limit="60/min")


# --- the refusal -----------------------------------------------------------------------


@on_a_loop
async def test_a_refusal_carries_the_exact_retry_time_and_takes_no_slot():
    gate = build_admission_gate(
        max_concurrent_runs=5, rate_limit=RateLimit(requests=(2, 0.5), name="chat")
    )
    first = time.monotonic()
    for _ in range(2):
        async with gate.admit(session_id="alice") as turn:
            assert isinstance(turn, admitgate._admitgate.Admission)
    with pytest.raises(AdmissionRejected) as caught:
        async with gate.admit(session_id="alice"):
            pass
    refusal = caught.value
    assert refusal.reason == "rate_limited"
    assert refusal.retry_after_s == refusal.retry_after
    # Exact: the first admission leaves the window 0.5 s after it was made.
    assert 0.5 - (time.monotonic() - first) - 0.02 <= refusal.retry_after <= 0.5
    stats = gate.stats()
    assert (stats["admitted"], stats["rejected"], stats["in_flight"]) == (2, 0, 0)
    assert stats["rate_limits"]["chat"]["limited"] == 1
    # Another identity is not limited; the same one is, until the retry time, then is not.
    async with gate.admit(session_id="bob"):
        pass
    await asyncio.sleep(refusal.retry_after + 0.01)
    async with gate.admit(session_id="alice"):
        pass


@on_a_loop
async def test_identity_and_key_choose_the_budget():
    by_tenant = RateLimit(requests="1/min", key=lambda session: session.split("/")[0])
    gate = build_admission_gate(rate_limit=by_tenant)
    async with gate.admit(session_id="acme/alice"):
        pass
    with pytest.raises(AdmissionRejected):
        async with gate.admit(session_id="acme/bob"):
            pass
    # identity= overrides the key.
    async with gate.admit(session_id="acme/bob", identity=b"sk-other"):
        pass


@on_a_loop
async def test_wait_waits_within_the_queue_timeout_and_refuses_past_it():
    limit = RateLimit(requests=(1, 0.3), on_limit="wait", name="w")
    gate = build_admission_gate(
        max_concurrent_runs=2, queue_depth=4, queue_timeout_s=1.0, rate_limit=limit
    )
    started = time.monotonic()
    for _ in range(3):
        async with gate.admit(session_id="k"):
            pass
    assert time.monotonic() - started >= 0.59
    assert gate.stats()["rate_limits"]["w"]["waited"] == 2
    # A deadline shorter than the wait: refused at once with the exact time.
    asked = time.monotonic()
    with pytest.raises(AdmissionRejected) as caught:
        async with gate.admit(session_id="k", deadline_s=0.05):
            pass
    assert caught.value.reason == "rate_limited"
    assert time.monotonic() - asked < 0.05
    assert caught.value.retry_after > 0.1


@on_a_loop
async def test_a_waiting_turn_cancelled_gives_its_place_back():
    limit = RateLimit(requests=(1, 60), tokens="100/min", on_limit="wait", name="w")
    gate = build_admission_gate(rate_limit=limit)
    async with gate.admit(session_id="k", cost=10):
        pass
    other = RateLimit(requests="1/min", tokens="100/min", on_limit="wait", name="first")
    both = admitgate.AdmissionGate(rate_limit=[other, limit])
    waiting = asyncio.ensure_future(both.admit(session_id="k", cost=10).__aenter__())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # The first limit's hold was given back when the second refused (before the wait).
    assert other.stats()["returned"] == 1
    assert other.stats()["tokens_returned"] == 10


# --- tokens ----------------------------------------------------------------------------


@on_a_loop
async def test_usage_is_settled_and_the_edges_are_as_documented():
    limit = RateLimit(tokens="1000/min", name="t")
    gate = build_admission_gate(rate_limit=limit)
    async with gate.admit(session_id="a", cost=900) as turn:
        turn.report_usage(tokens=100)
        turn.report_usage(tokens=999)  # only the first report counts
    # The refund made room: 900 fits again.
    async with gate.admit(session_id="a", cost=800) as turn:
        pass  # unreported: keeps its estimate
    with pytest.raises(AdmissionRejected) as caught:
        async with gate.admit(session_id="a", cost=200):
            pass
    assert caught.value.retry_after is not None
    # A cost above the whole window never fits: refused at once, no retry time.
    with pytest.raises(AdmissionRejected) as caught:
        async with gate.admit(session_id="b", cost=1001):
            pass
    assert (caught.value.reason, caught.value.retry_after) == ("rate_limited", None)
    # A debt beyond the window holds the identity for one window from the report, no longer.
    async with gate.admit(session_id="c", cost=10) as turn:
        turn.report_usage(tokens=5000)
    with pytest.raises(AdmissionRejected) as caught:
        async with gate.admit(session_id="c", cost=1):
            pass
    assert 59.0 <= caught.value.retry_after <= 60.0
    s = limit.stats()
    assert (s["settled"], s["tokens_settled"], s["tokens_reserved"]) == (2, 5100, 1710)


def test_admit_sync_passes_the_budget_on_its_thread():
    limit = RateLimit(requests=(1, 0.2), on_limit="wait", name="s")
    gate = build_admission_gate(max_concurrent_runs=1, queue_depth=2, rate_limit=limit)
    started = time.monotonic()
    for _ in range(2):
        with gate.admit_sync(session_id="x", cost=0) as turn:
            assert turn is not None
    assert time.monotonic() - started >= 0.19
    refused = RateLimit(requests="1/min", name="r")
    sync_gate = build_admission_gate(rate_limit=refused)
    with sync_gate.admit_sync(session_id="x"):
        pass
    with pytest.raises(AdmissionRejected) as caught:
        with sync_gate.admit_sync(session_id="x"):
            pass
    assert caught.value.reason == "rate_limited"


@on_a_loop
async def test_the_event_loop_is_not_blocked_by_a_waiting_turn():
    limit = RateLimit(requests=(1, 0.3), on_limit="wait")
    gate = build_admission_gate(rate_limit=limit)
    ticks: list[float] = []

    async def ticker() -> None:
        for _ in range(30):
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    async def turns() -> None:
        for _ in range(2):
            async with gate.admit(session_id="z"):
                pass

    await asyncio.gather(ticker(), turns())
    # The second turn waited ~0.3 s for its budget: a wait that blocked the loop would show as
    # one gap that long. (The bound leaves room for a loaded host's preemption; admitgate's
    # own time on the loop is bounded in tests/test_budget_fleet.py.)
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert max(gaps) < 0.2, max(gaps)


# --- generated sequences -----------------------------------------------------------------

N = 3
WINDOW = 0.25
IDENTITIES = ["a", "b", "c"]

turn_plans = st.lists(
    st.tuples(
        st.sampled_from(IDENTITIES),
        st.integers(min_value=0, max_value=60),  # cost
        st.sampled_from(["run", "hold", "cancel_queued", "report"]),
        st.floats(min_value=0.0, max_value=0.06),  # pause before it arrives
    ),
    min_size=1,
    max_size=25,
)


def _conservative_violations(spans: dict[str, list[tuple[float, float]]]) -> list[str]:
    """Identities with N+1 admissions certainly inside one window: the last admission's
    decision ended less than WINDOW after the first's began (decision times are only known
    to lie between the call and its return)."""
    bad = []
    for identity, admitted in spans.items():
        admitted.sort()
        for first, last in zip(admitted, admitted[N:], strict=False):
            if last[1] - first[0] < WINDOW:
                bad.append(identity)
    return bad


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(plans=turn_plans)
def test_generated_turns_keep_the_budget_and_the_counters_add_up(plans):
    async def scenario() -> None:
        limit = RateLimit(requests=(N, WINDOW), tokens=(200, WINDOW), name="gen")
        gate = build_admission_gate(
            max_concurrent_runs=1,
            queue_depth=1,
            overflow_policy="reject",
            queue_timeout_s=2.0,
            rate_limit=limit,
        )
        spans: dict[str, list[tuple[float, float]]] = {i: [] for i in IDENTITIES}
        ran = 0
        ran_tokens = 0
        refused_by_budget = 0
        held: list[asyncio.Task[None]] = []

        async def one(identity: str, cost: int, what: str) -> None:
            nonlocal ran, ran_tokens, refused_by_budget
            before = time.monotonic()
            try:
                async with gate.admit(session_id=identity, cost=cost) as turn:
                    spans[identity].append((before, time.monotonic()))
                    ran += 1
                    ran_tokens += cost
                    if what == "report":
                        turn.report_usage(tokens=cost // 2)
                    if what == "hold":
                        await asyncio.sleep(0.05)
            except AdmissionRejected as refusal:
                if refusal.reason == "rate_limited":
                    refused_by_budget += 1
                else:
                    assert refusal.reason in ("queue_full", "timeout"), refusal.reason

        for identity, cost, what, pause in plans:
            await asyncio.sleep(pause)
            if what == "cancel_queued":
                task = asyncio.ensure_future(one(identity, cost, "run"))
                await asyncio.sleep(0)
                if not task.done():
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
            elif what == "hold":
                held.append(asyncio.ensure_future(one(identity, cost, what)))
                await asyncio.sleep(0)
            else:
                await one(identity, cost, what)
        await asyncio.gather(*held)

        assert _conservative_violations(spans) == []
        s = limit.stats()
        g = gate.stats()
        # Nothing the budget refused reached the gate; everything it allowed ran or came back.
        assert s["limited"] == refused_by_budget
        assert s["allowed"] == ran + s["returned"]
        assert s["tokens_reserved"] == ran_tokens + s["tokens_returned"]
        assert g["admitted"] == ran
        assert g["in_flight"] == 0 and g["queued"] == 0

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_threads_and_loops_together_keep_the_budget():
    """admit_sync on threads and async turns on two loops share one budget exactly."""
    limit = RateLimit(requests=(5, 0.5), name="mixed")
    gate = build_admission_gate(rate_limit=limit)
    admitted: list[tuple[float, float]] = []
    lock = threading.Lock()

    def sync_worker() -> None:
        for _ in range(20):
            before = time.monotonic()
            try:
                with gate.admit_sync(session_id="one"):
                    with lock:
                        admitted.append((before, time.monotonic()))
            except AdmissionRejected:
                pass
            time.sleep(0.01)

    def loop_worker() -> None:
        async def run() -> None:
            for _ in range(20):
                before = time.monotonic()
                try:
                    async with gate.admit(session_id="one"):
                        with lock:
                            admitted.append((before, time.monotonic()))
                except AdmissionRejected:
                    pass
                await asyncio.sleep(0.01)

        asyncio.run(run())

    threads = [threading.Thread(target=f) for f in (sync_worker, loop_worker, loop_worker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    admitted.sort()
    for first, last in zip(admitted, admitted[5:], strict=False):
        # Six admissions certainly within one window would break "5 per 0.5 s".
        assert last[1] - first[0] >= 0.5
    s = limit.stats()
    assert s["allowed"] == len(admitted)
    assert s["allowed"] + s["limited"] == 60


@on_a_loop
async def test_metrics_export_each_limit_without_identities():
    prometheus_client = pytest.importorskip("prometheus_client")
    import admitgate.metrics

    chat = RateLimit(requests="1/min", tokens="500/min", name="chat")
    gate = build_admission_gate(max_concurrent_runs=2, rate_limit=chat)
    registry = prometheus_client.CollectorRegistry()
    admitgate.metrics.register(gate, registry=registry)
    async with gate.admit(session_id="secret-user-id", cost=100) as turn:
        turn.report_usage(tokens=40)
    with pytest.raises(AdmissionRejected):
        async with gate.admit(session_id="secret-user-id", cost=1):
            pass
    text = prometheus_client.generate_latest(registry).decode()
    assert 'admitgate_rate_limit_allowed_total{limit="chat"} 1.0' in text
    assert 'admitgate_rate_limit_limited_total{limit="chat"} 1.0' in text
    assert 'admitgate_rate_limit_tokens_reserved_total{limit="chat"} 100.0' in text
    assert 'admitgate_rate_limit_tokens_settled_total{limit="chat"} 40.0' in text
    assert 'admitgate_rate_limit_keys{limit="chat"} 1.0' in text
    assert 'admitgate_rejected_total{reason="rate_limited",transport="direct"} 1.0' in text, text
    assert "secret-user-id" not in text
    # A gate without a budget exports no budget family.
    plain = prometheus_client.CollectorRegistry()
    admitgate.metrics.register(build_admission_gate(max_concurrent_runs=2), registry=plain)
    assert "admitgate_rate_limit_" not in prometheus_client.generate_latest(plain).decode()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_with_an_empty_budget():
    limit = RateLimit(requests="1/min", name="forked")
    gate = build_admission_gate(rate_limit=limit)
    with gate.admit_sync(session_id="k"):
        pass
    pid = os.fork()
    if pid == 0:  # the child: its budget is its own, empty
        code = 1
        try:
            with gate.admit_sync(session_id="k"):
                code = 0 if limit.stats()["allowed"] == 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's is untouched.
    with pytest.raises(AdmissionRejected):
        with gate.admit_sync(session_id="k"):
            pass
