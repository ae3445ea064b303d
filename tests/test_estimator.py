"""A gate's ``estimator=`` (``admitgate.RecentUsage`` or a callable): what a turn that passes no
``cost=`` reserves in its budgets, checked against what docs/budgets.md promises:

* every new argument is checked by name, with the bad value (never an identity);
* without ``estimator=`` nothing changes: a turn without ``cost=`` reserves 0;
* an explicit ``cost=`` wins; a bad estimate refuses the turn, which then reserves nothing;
* ``RecentUsage`` answers what a reference model of the documented rule answers, for
  generated sequences of turns, local and fleet-wide (a real redis-server), and the budget's
  counters add up: what a limit holds per identity is the estimates reserved, minus the
  refunds, plus the debts (probed exactly: one token more is refused, exactly the room fits);
* the same with threads and an event loop reporting at once;
* its memory stays within ``max_identities`` with many identities, and the recent ones are kept.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import admitgate
import pytest
from admitgate import AdmissionRejected, RateLimit, RecentUsage, build_admission_gate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MAX_AMOUNT = 2**48


def on_a_loop(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Runs an async test on a fresh event loop (bounded: a wedged gate fails)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 60))

    return run


class Model:
    """The documented rule of ``RecentUsage``, in the same floating-point steps: per identity
    the larger of the last report and the decayed average (rounded up); for an identity with
    no report the decayed average of all reports, or ``initial`` before any; on a gate, capped
    at the largest cost its token limits admit."""

    def __init__(self, initial: int, half_life: int, cap: int = MAX_AMOUNT) -> None:
        self.initial = initial
        self.weight = 1.0 - 0.5 ** (1.0 / half_life)
        self.cap = cap
        self.mine: dict[str, tuple[float, int]] = {}
        self.everyone: float | None = None

    def estimate(self, identity: str) -> int:
        if identity in self.mine:
            average, last = self.mine[identity]
            value = max(math.ceil(average), last)
        elif self.everyone is not None:
            value = math.ceil(self.everyone)
        else:
            value = self.initial
        return min(value, self.cap)

    def report(self, identity: str, tokens: int) -> None:
        w = self.weight
        self.everyone = (
            tokens if self.everyone is None else self.everyone + w * (tokens - self.everyone)
        )
        if identity in self.mine:
            average, _ = self.mine[identity]
            self.mine[identity] = (average + w * (tokens - average), tokens)
        else:
            self.mine[identity] = (float(tokens), tokens)


async def assert_holds(gate: admitgate.AdmissionGate, identity: str, held: int, limit: int) -> None:
    """The token limit holds exactly ``held`` for ``identity``: one token more than the room is
    refused (recording nothing), exactly the room is admitted (then the window is full)."""
    room = limit - held
    assert room >= 0, (identity, held)
    with pytest.raises(AdmissionRejected) as caught:
        async with gate.admit(session_id=identity, cost=room + 1):
            pass
    assert caught.value.reason == "rate_limited", (identity, held)
    async with gate.admit(session_id=identity, cost=room) as turn:
        assert turn.cost == room


# --- arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"initial": -1}, ValueError, "initial must be 0 to 281474976710656 (tokens), got -1"),
        (
            {"initial": 2**48 + 1},
            ValueError,
            "initial must be 0 to 281474976710656 (tokens), got 281474976710657",
        ),
        ({"initial": "500"}, TypeError, "initial must be an int, got '500'"),
        ({"initial": True}, TypeError, "initial must be an int, got True"),
        ({"initial": 5.0}, TypeError, "initial must be an int, got 5.0"),
        (
            {"initial": 1, "half_life": 0},
            ValueError,
            "half_life must be 1 to 1000000 (reports), got 0",
        ),
        (
            {"initial": 1, "half_life": 10**7},
            ValueError,
            "half_life must be 1 to 1000000 (reports), got 10000000",
        ),
        ({"initial": 1, "half_life": 2.5}, TypeError, "half_life must be an int, got 2.5"),
        (
            {"initial": 1, "max_identities": 1},
            ValueError,
            "max_identities must be 2 to 16777216, got 1",
        ),
        (
            {"initial": 1, "max_identities": 2**24 + 1},
            ValueError,
            "max_identities must be 2 to 16777216, got 16777217",
        ),
        ({"initial": 1, "max_identities": -5}, ValueError, "max_identities must be 2 to"),
    ],
)
def test_every_argument_of_recent_usage_is_checked_by_name(kwargs, error, named):
    with pytest.raises(error) as caught:
        RecentUsage(**kwargs)
    assert named in str(caught.value), str(caught.value)


def test_recent_usage_shows_its_settings_and_defaults():
    usage = RecentUsage(2000)
    assert (usage.initial, usage.half_life, usage.max_identities) == (2000, 8, 65536)
    assert repr(usage) == "RecentUsage(initial=2000, half_life=8, max_identities=65536)"
    assert usage("any-session", "alice") == 2000
    assert usage.stats() == {"identities": 0, "reports": 0, "forgotten": 0, "bytes": 0}
    with pytest.raises(TypeError, match="identity must be a str or bytes, got a int"):
        usage("s", 42)
    with pytest.raises(TypeError, match="tokens must be an int"):
        usage.report("alice", tokens="many")


def test_the_gate_checks_estimator_by_name():
    tokens = RateLimit(tokens="1000/min", name="t")
    with pytest.raises(
        TypeError, match=r"estimator must be an admitgate.RecentUsage, a callable .*got 5"
    ):
        build_admission_gate(rate_limit=tokens, estimator=5)
    # An estimator without a budget that counts tokens would estimate for nothing: refused,
    # not dropped, even where build_admission_gate would otherwise build no gate.
    with pytest.raises(
        ValueError, match=r"^estimator=RecentUsage\(initial=7, .*got no rate_limit$"
    ):
        build_admission_gate(estimator=RecentUsage(7))
    with pytest.raises(ValueError, match=r"estimator=.*got no token limit"):
        build_admission_gate(rate_limit=RateLimit(requests="5/min"), estimator=RecentUsage(7))
    with pytest.raises(ValueError, match="estimator="):
        admitgate.AdmissionGate(None, estimator=RecentUsage(7))
    usage = RecentUsage(7)
    gate = admitgate.AdmissionGate(None, rate_limit=tokens, estimator=usage)
    assert gate.estimator is usage
    assert build_admission_gate(rate_limit=tokens).estimator is None


# --- the gate ----------------------------------------------------------------------------


@on_a_loop
async def test_without_an_estimator_a_turn_without_cost_reserves_nothing():
    limit = RateLimit(tokens="1000/min", name="plain")
    gate = build_admission_gate(max_concurrent_runs=2, rate_limit=limit)
    turn = gate.admit(session_id="a")
    assert turn.cost is None  # not yet through its budgets
    async with turn:
        assert turn.cost == 0
        turn.report_usage(tokens=300)
    async with gate.admit(session_id="a", cost=40) as turn:
        assert turn.cost == 40
    s = limit.stats()
    assert (s["allowed"], s["tokens_reserved"], s["tokens_settled"]) == (2, 40, 300)
    # A gate without budgets: cost= is only recorded on the turn.
    plain = build_admission_gate(max_concurrent_runs=1)
    async with plain.admit(session_id="a") as turn:
        assert turn.cost is None


@on_a_loop
async def test_recent_usage_estimates_learns_and_an_explicit_cost_wins():
    usage = RecentUsage(initial=500, half_life=1)
    limit = RateLimit(tokens="10_000/min", name="learn")
    gate = build_admission_gate(rate_limit=limit, estimator=usage)
    async with gate.admit(session_id="alice") as turn:
        assert turn.cost == 500
        turn.report_usage(tokens=2000)
        turn.report_usage(tokens=9000)  # only the first report counts, for the estimate too
    async with gate.admit(session_id="alice") as turn:
        assert turn.cost == 2000
        turn.report_usage(tokens=1000)
    async with gate.admit(session_id="alice") as turn:
        assert turn.cost == 1500  # half_life 1: half way back down
    # An explicit cost wins, 0 included; its report still teaches.
    async with gate.admit(session_id="alice", cost=0) as turn:
        assert turn.cost == 0
        turn.report_usage(tokens=1000)
    async with gate.admit(session_id="alice") as turn:
        assert turn.cost == 1250
    async with gate.admit(session_id="bob") as turn:  # no report of bob's: everyone's average
        assert turn.cost == 1250  # 2000, then half way to 1000, twice
    assert usage.stats()["reports"] == 3
    s = limit.stats()
    assert s["tokens_reserved"] == 500 + 2000 + 1500 + 0 + 1250 + 1250
    # admit_sync takes the same path (on a thread: never on the loop's).

    def sync_turn() -> int | None:
        with gate.admit_sync(session_id="carol") as turn:
            return turn.cost

    assert await asyncio.to_thread(sync_turn) == 1250


@on_a_loop
async def test_a_learned_estimate_never_exceeds_what_the_gate_can_admit():
    usage = RecentUsage(initial=100)
    small = RateLimit(tokens=["5000/min", "800/s"], name="small")
    gcra = RateLimit(tokens="100_000/h", burst=3000, name="gcra")
    gate = build_admission_gate(rate_limit=[small, gcra], estimator=usage)
    usage.report("dave", tokens=50_000)  # one huge report
    assert usage("s", "dave") == 50_000
    async with gate.admit(session_id="dave") as turn:
        assert turn.cost == 800  # the smallest token window: it fits, it is not refused forever
    # A callable's answer and an explicit cost are not capped: above a window, never fits.
    with pytest.raises(AdmissionRejected) as caught:
        async with gate.admit(session_id="erin", cost=900):
            raise AssertionError("ran over its window")
    assert (caught.value.reason, caught.value.retry_after) == ("rate_limited", None)


@on_a_loop
async def test_a_callable_gets_the_session_and_the_identity_the_budget_keys_on():
    seen: list[tuple[Any, Any]] = []

    def estimate(session_id: Any, identity: Any) -> int:
        seen.append((session_id, identity))
        return 70

    requests = RateLimit(requests="100/min", key=lambda s: "requests-" + s, name="r")
    tokens = RateLimit(tokens="1000/min", key=lambda s: s.split(":")[0].encode(), name="t")
    gate = build_admission_gate(rate_limit=[requests, tokens], estimator=estimate)
    assert gate.estimator is estimate
    async with gate.admit(session_id="acme:alice") as turn:
        assert turn.cost == 70
    async with gate.admit(session_id="acme:alice", identity="key-9") as turn:
        pass
    async with gate.admit(session_id="acme:alice", cost=5) as turn:  # not asked
        assert turn.cost == 5
    plain = build_admission_gate(rate_limit=RateLimit(tokens="1000/min"), estimator=estimate)
    async with plain.admit(session_id="bob"):
        pass
    assert seen == [("acme:alice", b"acme"), ("acme:alice", "key-9"), ("bob", "bob")]
    assert tokens.stats()["tokens_reserved"] == 70 + 70 + 5


@pytest.mark.parametrize(
    ("answer", "error", "shown"),
    [
        (-1, ValueError, "returned -1: an estimate must be 0 to 281474976710656 (tokens)"),
        (2**48 + 1, ValueError, "returned 281474976710657"),
        (2.5, TypeError, "returned 2.5: an estimate must be an int (tokens)"),
        ("100", TypeError, "returned '100'"),
        (None, TypeError, "returned None"),
        (True, TypeError, "returned True"),
    ],
)
@on_a_loop
async def test_a_bad_estimate_refuses_the_turn_naming_the_estimator_and_the_value(
    answer, error, shown
):
    def estimator(session_id: str, identity: str) -> Any:
        return answer

    limit = RateLimit(tokens="1000/min", name="bad")
    gate = build_admission_gate(max_concurrent_runs=1, rate_limit=limit, estimator=estimator)
    with pytest.raises(error) as caught:
        async with gate.admit(session_id="secret-api-key-123"):
            raise AssertionError("the turn ran")
    message = str(caught.value)
    assert message.startswith("estimator <function "), message
    assert "estimator" in message and shown in message, message
    assert "secret-api-key-123" not in message

    def sync_turn() -> None:
        with gate.admit_sync(session_id="secret-api-key-123"):
            raise AssertionError("the turn ran")

    with pytest.raises(error):
        await asyncio.to_thread(sync_turn)
    # The turns reserved nothing and took no slot.
    assert limit.stats()["allowed"] == 0
    assert gate.stats()["admitted"] == 0 and gate.stats()["in_flight"] == 0


@on_a_loop
async def test_an_estimator_that_raises_refuses_the_turn_with_its_exception():
    calls = 0

    def estimator(session_id: str, identity: str) -> int:
        nonlocal calls
        calls += 1
        raise LookupError("no price list")

    limit = RateLimit(tokens="1000/min", name="raises")
    gate = build_admission_gate(max_concurrent_runs=1, rate_limit=limit, estimator=estimator)
    with pytest.raises(LookupError, match="no price list"):
        async with gate.admit(session_id="a"):
            raise AssertionError("the turn ran")
    assert calls == 1
    assert limit.stats()["allowed"] == 0 and gate.stats()["in_flight"] == 0
    # The gate is untouched: the next turn with a cost runs.
    async with gate.admit(session_id="a", cost=10):
        pass


@on_a_loop
async def test_an_estimator_may_call_back_into_the_gate():
    """The callable runs with no lock held: reading the gate, its budget and a RecentUsage
    from inside it neither deadlocks nor fails."""
    usage = RecentUsage(initial=40)
    limit = RateLimit(tokens="1000/min", name="reentrant")
    gate: admitgate.AdmissionGate | None = None

    def estimator(session_id: str, identity: str) -> int:
        assert gate is not None
        gate.stats()
        limit.stats()
        usage.report(identity, tokens=10)
        return usage(session_id, identity) + 1

    gate = build_admission_gate(max_concurrent_runs=2, rate_limit=limit, estimator=estimator)
    async with gate.admit(session_id="a") as turn:
        assert turn.cost == 11


# --- generated sequences -----------------------------------------------------------------

IDENTITIES = ["ann", "ben", "cy"]
TOKEN_LIMIT = 1_000_000  # per hour: nothing leaves the window during a test

turns = st.lists(
    st.tuples(
        st.sampled_from(IDENTITIES),
        st.one_of(st.none(), st.integers(min_value=0, max_value=400)),  # cost=, or estimated
        st.sampled_from(["report", "silent", "refused"]),
        st.integers(min_value=0, max_value=2000),  # the usage it reports
    ),
    min_size=1,
    max_size=30,
)


async def run_turns(
    plan: list[tuple[str, int | None, str, int]], *, fleet: str | None, half_life: int
) -> None:
    usage = RecentUsage(initial=300, half_life=half_life)
    limit = RateLimit(tokens=(TOKEN_LIMIT, 3600), fleet=fleet, name=f"est-{uuid.uuid4().hex[:12]}")
    gate = build_admission_gate(
        max_concurrent_runs=1, queue_depth=0, rate_limit=limit, estimator=usage
    )
    assert gate is not None
    model = Model(initial=300, half_life=half_life)
    held = dict.fromkeys(IDENTITIES, 0)
    reserved = returned = settled = reports = 0
    for identity, cost, outcome, used in plan:
        expected = cost if cost is not None else model.estimate(identity)
        if outcome == "refused":
            # The one slot taken: the turn passes its budget, then the gate refuses it
            # (queue_full), and what it reserved goes back.
            async with gate.admit(session_id="blocker", cost=0):
                with pytest.raises(AdmissionRejected) as caught:
                    async with gate.admit(session_id=identity, cost=cost):
                        raise AssertionError("ran past a full gate")
                assert caught.value.reason == "queue_full"
            reserved += expected
            returned += expected
            continue
        async with gate.admit(session_id=identity, cost=cost) as turn:
            assert turn.cost == expected, (identity, cost, model.mine.get(identity))
            reserved += expected
            if outcome == "report":
                turn.report_usage(tokens=used)
                model.report(identity, used)
                held[identity] += used  # the estimate refunded, or the excess a debt
                settled += used
                reports += 1
            else:
                held[identity] += expected  # an unreported turn keeps its estimate

    s = limit.stats()
    assert (s["tokens_reserved"], s["tokens_returned"], s["tokens_settled"]) == (
        reserved,
        returned,
        settled,
    )
    assert usage.stats()["reports"] == reports
    if fleet is not None:
        # A fleet budget's settle is a round trip sent after report_usage returns.
        await asyncio.sleep(0.5)
    for identity in IDENTITIES:
        await assert_holds(gate, identity, held[identity], TOKEN_LIMIT)


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(plan=turns, half_life=st.sampled_from([1, 3, 8]))
def test_generated_turns_are_estimated_as_documented_and_the_budget_adds_up(plan, half_life):
    asyncio.run(asyncio.wait_for(run_turns(plan, fleet=None, half_life=half_life), 30))


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(plan=turns)
def test_generated_turns_add_up_across_the_fleet(redis_server, plan):
    asyncio.run(asyncio.wait_for(run_turns(plan, fleet=redis_server.url, half_life=2), 30))


# --- concurrency -------------------------------------------------------------------------


@pytest.mark.parametrize("fleet", [False, True], ids=["local", "fleet"])
def test_threads_and_a_loop_reporting_at_once_keep_the_books(request, fleet):
    """admit_sync on four threads and async turns on a loop share one gate and one
    RecentUsage, reporting as they go: every turn reserved what it says (``turn.cost``), the
    estimator counted every report, and what the budget holds per identity is exactly the
    sum of the usage reported and the estimates never reported."""
    url = request.getfixturevalue("redis_server").url if fleet else None
    usage = RecentUsage(initial=50, half_life=2, max_identities=4)
    limit = RateLimit(tokens=(TOKEN_LIMIT, 3600), fleet=url, name=f"conc-{uuid.uuid4().hex[:12]}")
    gate = build_admission_gate(
        max_concurrent_runs=3, queue_depth=256, rate_limit=limit, estimator=usage
    )
    assert gate is not None
    books: list[tuple[str, int, int | None]] = []  # (identity, reserved, reported)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def record(identity: str, turn: Any, n: int) -> None:
        used = (n * 37) % 500 if n % 3 else None
        if used is not None:
            turn.report_usage(tokens=used)
        with lock:
            books.append((identity, turn.cost, used))

    def sync_worker(k: int) -> None:
        try:
            for n in range(40):
                identity = IDENTITIES[(n + k) % 3]
                with gate.admit_sync(session_id=identity) as turn:
                    time.sleep(0.0005)
                    record(identity, turn, n + k)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    async def loop_turns() -> None:
        async def one(n: int) -> None:
            identity = IDENTITIES[n % 3]
            async with gate.admit(session_id=identity) as turn:
                await asyncio.sleep(0)
                record(identity, turn, n)

        await asyncio.gather(*(one(n) for n in range(80)))

    threads = [threading.Thread(target=sync_worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    asyncio.run(asyncio.wait_for(loop_turns(), 60))
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(books) == 4 * 40 + 80
    reported = [b for b in books if b[2] is not None]
    assert usage.stats()["reports"] == len(reported)
    s = limit.stats()
    assert s["tokens_reserved"] == sum(b[1] for b in books)
    assert s["tokens_settled"] == sum(b[2] for b in reported)
    assert s["tokens_returned"] == 0
    held = dict.fromkeys(IDENTITIES, 0)
    for identity, cost, used in books:
        held[identity] += cost if used is None else used

    async def probe() -> None:
        if fleet:
            await asyncio.sleep(0.5)  # the last settles' round trips
        for identity in IDENTITIES:
            await assert_holds(gate, identity, held[identity], TOKEN_LIMIT)

    asyncio.run(asyncio.wait_for(probe(), 30))


# --- memory ------------------------------------------------------------------------------


def test_memory_stays_within_max_identities_and_recent_identities_are_kept():
    usage = RecentUsage(initial=10, max_identities=1000)
    high = 0
    for i in range(100_000):
        usage.report(f"user-{i}", tokens=i % 700)
        if i % 400 == 0:
            # Reported every 400 new identities (< max_identities / 2): never forgotten.
            usage.report("regular", tokens=77_777)
        if i % 97 == 0:
            s = usage.stats()
            assert s["identities"] <= 1000, s
            high = max(high, s["bytes"])
            assert usage("s", "regular") == 77_777, i
    s = usage.stats()
    assert s["identities"] <= 1000 and s["forgotten"] >= 100_000 - 1000, s
    # The documented bound: about 58 bytes per identity of the cap.
    assert high <= 58 * 1000 + 256, high
    # A forgotten identity is estimated from everyone's average again.
    assert usage("s", "user-0") == usage("s", "never-seen")


def test_the_default_cap_holds_about_3_3_mb_at_most():
    usage = RecentUsage(initial=10)
    for i in range(3 * 65536):
        usage.report(i.to_bytes(4, "little"), tokens=5)
    s = usage.stats()
    assert s["identities"] <= 65536 and s["bytes"] <= 3_400_000, s


@on_a_loop
async def test_many_identities_through_a_gate_stay_within_the_cap():
    usage = RecentUsage(initial=10, max_identities=100)
    limit = RateLimit(tokens="1000/min", name="many")
    gate = build_admission_gate(rate_limit=limit, estimator=usage)
    for i in range(3000):
        async with gate.admit(session_id=f"s-{i}") as turn:
            turn.report_usage(tokens=3)
    s = usage.stats()
    assert s["identities"] <= 100 and s["reports"] == 3000 and s["forgotten"] >= 2900, s
    assert "s-1" not in repr(usage) and "s-1" not in repr(s)
