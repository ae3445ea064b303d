"""Overload control through the Python API: AdaptiveLimit, queue_discipline, deadline_s,
turn.report_throttled, stats()["limit"], and the simulator binding."""

from __future__ import annotations

import asyncio
import threading
import time

import admitgate
import pytest
from _provider import Provider, RateLimited
from admitgate import AdaptiveLimit, AdmissionRejected, build_admission_gate

# -- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_limit": 0}, "min_limit must be >= 1, got 0"),
        ({"min_limit": -3}, "min_limit must be >= 1, got -3"),
        ({"min_limit": -1}, "min_limit must be >= 1, got -1"),
        ({"initial_limit": -2}, "initial_limit must be >= 1, got -2"),
        ({"initial_limit": 0}, "initial_limit must be >= 1, got 0"),
        ({"initial_limit": "x"}, "initial_limit must be an integer, got 'x'"),
        ({"min_limit": 5, "initial_limit": 2}, "initial_limit (2) must be >= min_limit (5)"),
    ],
)
def test_adaptive_limit_refuses_bad_values_naming_them(kwargs, message):
    with pytest.raises(ValueError) as err:
        AdaptiveLimit(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("bad", [42, "RateLimited", (RateLimited, int), [object]])
def test_throttle_on_must_be_exception_types(bad):
    with pytest.raises(TypeError, match="throttle_on must be an exception type or a tuple"):
        AdaptiveLimit(throttle_on=bad)


def test_throttle_on_accepts_one_type_or_a_list():
    assert AdaptiveLimit(throttle_on=RateLimited).throttle_on == (RateLimited,)
    assert AdaptiveLimit(throttle_on=[RateLimited, OSError]).throttle_on == (RateLimited, OSError)
    assert repr(AdaptiveLimit(throttle_on=RateLimited)) == (
        "AdaptiveLimit(min_limit=1, initial_limit=None, throttle_on=(RateLimited,))"
    )


def test_gate_arguments_are_checked():
    with pytest.raises(
        ValueError, match=r"queue_discipline must be one of \('fifo', 'adaptive'\), got 'lifo'"
    ):
        build_admission_gate(max_concurrent_runs=4, queue_discipline="lifo")
    with pytest.raises(
        TypeError, match="adaptive must be an admitgate.AdaptiveLimit or None, got 3"
    ):
        build_admission_gate(max_concurrent_runs=4, adaptive=3)
    with pytest.raises(ValueError, match="adaptive= needs max_concurrent_runs >= 1"):
        build_admission_gate(max_concurrent_runs=0, adaptive=AdaptiveLimit())
    with pytest.raises(
        ValueError, match=r"AdaptiveLimit\(min_limit=9\) exceeds max_concurrent_runs=4"
    ):
        build_admission_gate(max_concurrent_runs=4, adaptive=AdaptiveLimit(min_limit=9))
    gate = build_admission_gate(max_concurrent_runs=4)
    for bad in (-1, float("nan"), float("inf"), "soon", True):
        with pytest.raises(ValueError, match="deadline_s must be"):
            gate.admit(deadline_s=bad)


def test_a_gate_without_overload_control_is_unchanged():
    async def main():
        gate = build_admission_gate(max_concurrent_runs=2, queue_depth=2)
        assert gate.adaptive is None and gate.queue_discipline == "fifo"
        # The turn is yielded on every gate (issue 24); reporting on it changes nothing here.
        async with gate.admit() as turn:
            assert isinstance(turn, admitgate._admitgate.Admission)
            turn.report_throttled(retry_after_s=1.0)
        assert gate.stats()["limit"] == 2 == gate.limit

    asyncio.run(main())


# -- the adaptive ceiling -------------------------------------------------------------------


def test_learns_a_capacity_it_was_not_told_with_few_429s():
    provider = Provider(capacity=5)

    async def main():
        gate = build_admission_gate(
            max_concurrent_runs=64,
            queue_depth=64,
            adaptive=AdaptiveLimit(throttle_on=(RateLimited,)),
        )
        assert gate.stats()["limit"] == 4

        async def turn():
            try:
                async with gate.admit():
                    await provider.call()
            except (RateLimited, AdmissionRejected):
                pass

        for _ in range(35):
            await asyncio.gather(*(turn() for _ in range(12)))
        return gate

    gate = asyncio.run(main())
    assert gate.stats()["limit"] == gate.limit
    assert 4 <= gate.limit <= 6, gate.stats()
    assert provider.refused <= 0.05 * provider.calls, (provider.refused, provider.calls)


def test_report_throttled_moves_the_ceiling_and_retry_after_holds_growth():
    async def main():
        gate = build_admission_gate(
            max_concurrent_runs=16, queue_depth=16, adaptive=AdaptiveLimit(initial_limit=8)
        )
        turns = [gate.admit() for _ in range(4)]
        entered = [await t.__aenter__() for t in turns]
        assert entered == turns, "as turn gives the admission"
        entered[3].report_throttled(retry_after_s=30)
        for t in turns:
            await t.__aexit__(None, None, None)
        # The refused call started with 3 others running: the provider admits 3.
        assert gate.limit == 3
        with pytest.raises(ValueError, match="retry_after_s must be a number of seconds >= 0"):
            entered[0].report_throttled(retry_after_s=-1)

    asyncio.run(main())


def test_reconfigure_moves_the_adaptive_ceilings_bound_both_ways():
    """Issue 22 item 16. Fails before the fix: after ``reconfigure(max_concurrent_runs=64)``
    ``stats()`` said 64 but the limit stayed at the construction-time 8 with turns waiting."""

    async def rounds(gate, n: int, width: int) -> None:
        async def turn():
            async with gate.admit():
                await asyncio.sleep(0.005)

        for _ in range(n):
            await asyncio.gather(*(turn() for _ in range(width)))

    async def main():
        gate = build_admission_gate(
            max_concurrent_runs=8, queue_depth=256, adaptive=AdaptiveLimit(initial_limit=8)
        )
        await rounds(gate, 3, 40)
        assert gate.limit == 8
        gate.reconfigure(max_concurrent_runs=64)
        assert gate.stats()["max_concurrent_runs"] == 64
        await rounds(gate, 12, 80)
        assert gate.limit > 8, gate.stats()
        assert gate.limit <= 64
        gate.reconfigure(max_concurrent_runs=3)
        assert gate.limit == 3
        # Raised again, it starts from 3 (what it may run now), not from a bound it hid.
        gate.reconfigure(max_concurrent_runs=64)
        assert gate.limit == 3
        await rounds(gate, 12, 80)
        assert 3 < gate.limit <= 64, gate.stats()

    asyncio.run(main())


def test_time_waiting_for_a_person_is_not_provider_latency():
    """Issue 22 item 15. Fails before the fix: a turn that lent its slot to a human-approval
    wait was timed from its start to its end, wait included, so with 20 ms of provider time
    per turn the waits read as latency inflation and lowered the ceiling (16 to 9-10)."""
    from praisonaiagents.approval.registry import HUMAN_WAIT_SCOPE

    async def main():
        gate = build_admission_gate(
            max_concurrent_runs=16, queue_depth=64, adaptive=AdaptiveLimit(initial_limit=16)
        )

        async def turn(person_s: float) -> None:
            async with gate.admit():
                await asyncio.sleep(0.01)  # the provider
                if person_s:
                    async with HUMAN_WAIT_SCOPE.get()():
                        await asyncio.sleep(person_s)  # a person decides; the slot is lent
                await asyncio.sleep(0.01)  # the provider again

        for _ in range(12):
            await asyncio.gather(*(turn(0) for _ in range(16)))
        for _ in range(10):
            await asyncio.gather(*(turn(0.2) for _ in range(16)))
        return gate

    gate = asyncio.run(main())
    assert gate.limit == 16, gate.stats()
    assert gate.stats()["awaiting_human"] == 0


def test_an_unrelated_error_does_not_count_as_a_throttle():
    async def main():
        gate = build_admission_gate(
            max_concurrent_runs=16,
            queue_depth=16,
            adaptive=AdaptiveLimit(initial_limit=8, throttle_on=RateLimited),
        )
        for exc in (KeyError, RateLimited):
            with pytest.raises(exc):
                async with gate.admit():
                    async with gate.admit():
                        raise exc
        return gate.limit

    # KeyError left the limit alone; the RateLimited call started with one other running.
    assert asyncio.run(main()) == 1


def test_admit_sync_reports_a_throttle_too():
    gate = build_admission_gate(
        max_concurrent_runs=8, adaptive=AdaptiveLimit(initial_limit=8, throttle_on=RateLimited)
    )
    with gate.admit_sync(), gate.admit_sync():
        with pytest.raises(RateLimited), gate.admit_sync():
            raise RateLimited
    assert gate.limit == 2


# -- deadlines ------------------------------------------------------------------------------


def test_deadline_refuses_a_turn_that_cannot_finish_and_never_one_that_runs_at_once():
    async def main():
        gate = build_admission_gate(max_concurrent_runs=1, queue_depth=8)
        # A deadline already passed: a turn that runs at once still runs.
        async with gate.admit(deadline_s=0):
            await asyncio.sleep(0.05)  # teaches a 50 ms service time
        async with gate.admit():
            # The slot is taken: 10 ms is less than a turn takes.
            with pytest.raises(AdmissionRejected) as err:
                async with gate.admit(deadline_s=0.01):
                    pass
            assert err.value.reason == "deadline"
            assert admitgate.REJECTION_REASONS["deadline"] == (504, "DEADLINE_EXCEEDED")
            # 80 ms is enough to queue, but not to wait 60 ms for the slot.
            waiter = asyncio.ensure_future(gate.admit(deadline_s=0.08).__aenter__())
            await asyncio.sleep(0.06)
            assert waiter.done()
            assert waiter.exception().reason == "deadline"
            # No hint while waiting either: a deadline is not a reason to retry sooner.
            assert waiter.exception().retry_after is None
        stats = gate.stats()
        assert (stats["admitted"], stats["rejected"]) == (2, 2)

    asyncio.run(main())


def test_admit_sync_deadline_refuses_while_waiting():
    gate = build_admission_gate(max_concurrent_runs=1, queue_depth=4)
    with gate.admit_sync():
        pass
    held = threading.Event()
    release = threading.Event()

    def holder():
        with gate.admit_sync():
            held.set()
            release.wait(2)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(2)
    try:
        with pytest.raises(AdmissionRejected) as err, gate.admit_sync(deadline_s=0.05):
            pass
        assert err.value.reason == "deadline"
    finally:
        release.set()
        thread.join()


def test_a_waiters_deadline_is_rechecked_against_the_estimate_as_it_moves():
    """Issue 22 item 13. Fails before the fix: the check was frozen at enqueue as "deadline
    minus the estimate then". A waiter queued under a slow estimate was refused at that time
    although turns had become fast (1 s left, turns of 10 ms); one queued under a fast estimate
    was granted although turns had become slow (0.2 s left, turns of ~0.6 s)."""

    async def run(scope: str, seconds: float, gate) -> None:
        # A deadline turns the gate's timing on (a gate without overload control reads no
        # clock): every turn here is timed, so the estimate follows them.
        async with gate.admit(session_id=scope, deadline_s=60):
            await asyncio.sleep(seconds)

    async def became_fast():
        gate = build_admission_gate(
            max_concurrent_runs=4, max_concurrent_runs_per_scope=1, queue_depth=8
        )
        await asyncio.gather(*(run(f"slow{i}", 0.4, gate) for i in range(3)))
        release = asyncio.Event()

        async def holder():
            async with gate.admit(session_id="a"):
                await release.wait()

        held = asyncio.ensure_future(holder())
        await asyncio.sleep(0.01)
        # 1 s of deadline, 0.4 s expected: before, refused at 0.6 s whatever came after.
        waiter = asyncio.ensure_future(gate.admit(session_id="a", deadline_s=1.0).__aenter__())
        began = time.monotonic()
        while time.monotonic() - began < 0.8:
            await run("b", 0.005, gate)  # turns become fast: the estimate falls
        assert not waiter.done(), waiter
        release.set()
        await held
        admission = await waiter  # granted: 0.2 s left is ample for 10 ms turns
        await admission.__aexit__(None, None, None)

    async def became_slow():
        gate = build_admission_gate(
            max_concurrent_runs=10, max_concurrent_runs_per_scope=1, queue_depth=8
        )
        await run("x", 0.01, gate)
        release = asyncio.Event()

        async def holder():
            async with gate.admit(session_id="a"):
                await release.wait()

        held = asyncio.ensure_future(holder())
        await asyncio.sleep(0.01)
        began = time.monotonic()
        waiter = asyncio.ensure_future(gate.admit(session_id="a", deadline_s=1.2).__aenter__())
        # Turns become slow: eight of 0.9 s end together, the estimate grows to ~0.6 s.
        await asyncio.gather(*(run(f"b{i}", 0.9, gate) for i in range(8)))
        # 0.3 s left, a turn expected to take 0.6 s: refused now, not granted at 1.19 s.
        await asyncio.sleep(0.02)
        assert waiter.done(), "still waiting with a deadline it can no longer meet"
        assert waiter.exception().reason == "deadline"
        assert time.monotonic() - began < 1.0
        release.set()
        await held

    asyncio.run(became_fast())
    asyncio.run(became_slow())


def test_admit_sync_rechecks_a_waiters_deadline_as_the_estimate_falls():
    """Item 13 for ``admit_sync``: the blocked thread's look at its deadline is re-armed."""
    gate = build_admission_gate(
        max_concurrent_runs=2, max_concurrent_runs_per_scope=1, queue_depth=4
    )
    for _ in range(2):
        with gate.admit_sync(session_id="slow", deadline_s=60):  # timed: see above
            time.sleep(0.4)
    held, release = threading.Event(), threading.Event()

    def holder():
        with gate.admit_sync(session_id="a"):
            held.set()
            release.wait(5)

    def fast_turns():
        began = time.monotonic()
        while time.monotonic() - began < 0.8:
            with gate.admit_sync(session_id="b", deadline_s=60):
                time.sleep(0.005)
        release.set()

    threads = [threading.Thread(target=holder), threading.Thread(target=fast_turns)]
    threads[0].start()
    held.wait(2)
    threads[1].start()
    try:
        # Queued with 1 s of deadline under a 0.4 s estimate: before, refused at 0.6 s; now
        # granted when the holder leaves at ~0.8 s (0.2 s left, turns of 5 ms).
        with gate.admit_sync(session_id="a", deadline_s=1.0):
            pass
    finally:
        release.set()
        for thread in threads:
            thread.join()


# -- the adaptive queue ---------------------------------------------------------------------


def test_a_standing_queue_serves_the_newest_first_and_refuses_the_stale():
    async def main():
        gate = build_admission_gate(
            max_concurrent_runs=1, queue_depth=32, queue_discipline="adaptive"
        )
        async with gate.admit():
            await asyncio.sleep(0.02)  # a 20 ms service time
        outcomes: dict[int, str] = {}

        async def turn(i: int) -> None:
            try:
                async with gate.admit():
                    outcomes[i] = (
                        f"ran {len([o for o in outcomes.values() if o.startswith('ran')])}"
                    )
                    await asyncio.sleep(0.02)
            except AdmissionRejected as err:
                outcomes[i] = err.reason

        tasks = []
        async with gate.admit():
            # Eight waiters, 10 ms apart: the queue stands for 80 ms (> 2 service times).
            for i in range(8):
                tasks.append(asyncio.ensure_future(turn(i)))
                await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return outcomes

    outcomes = asyncio.run(main())
    # The newest waiter ran first; the oldest, waiting far past the cap, were refused.
    assert outcomes[7] == "ran 0", outcomes
    assert outcomes[0] == outcomes[1] == "timeout", outcomes


def test_under_a_standing_queue_each_waiter_leaves_at_about_one_service_time():
    """Issue 22 item 17. Fails before the fix: the cap applied only when a slot was handed
    out, so with both slots held for 0.4 s (service time 50 ms) every waiter sat until they
    were freed, and then all were refused at once (the newest too) with the freed slots left
    idle. Now a timer refuses each at about one service time after the queue stands, and the
    newest waiters left when slots free take them."""

    async def main():
        gate = build_admission_gate(
            max_concurrent_runs=2, queue_depth=64, queue_discipline="adaptive"
        )
        for _ in range(3):
            async with gate.admit():
                await asyncio.sleep(0.05)  # a 50 ms service time
        release = asyncio.Event()
        waits: dict[int, tuple[str, float]] = {}

        async def holder():
            async with gate.admit():
                await release.wait()

        async def waiter(i: int) -> None:
            began = time.monotonic()
            try:
                async with gate.admit():
                    waits[i] = ("ran", time.monotonic() - began)
                    await asyncio.sleep(0.05)
            except AdmissionRejected as err:
                waits[i] = (err.reason, time.monotonic() - began)

        holders = [asyncio.ensure_future(holder()) for _ in range(2)]
        await asyncio.sleep(0.01)
        began = time.monotonic()
        tasks = []
        for i in range(10):
            tasks.append(asyncio.ensure_future(waiter(i)))
            await asyncio.sleep(0.04)
        # The last two arrive just before the slots free: they are served, not refused.
        late = [asyncio.ensure_future(waiter(10 + i)) for i in range(2)]
        await asyncio.sleep(0.005)
        release.set()
        await asyncio.gather(*holders, *tasks, *late)
        return began, waits

    began, waits = asyncio.run(main())
    # Each waiter that came well before the slots freed left at its cap; the last of them
    # (10 ms from the release, due 50 ms after it came) may also be served, on a machine slow
    # enough to run the two newest turns before its timer.
    for i in range(10):
        outcome, waited = waits[i]
        assert outcome == "timeout" or (i == 9 and outcome == "ran"), waits
        # At most the standing interval (two service times) and one more, plus timer slack;
        # before, each waited until the slots were freed (the first 0.4 s).
        assert outcome == "ran" or waited < 0.1 + 0.05 + 0.06, (i, waits)
    assert waits[10][0] == waits[11][0] == "ran", waits


def test_fifo_is_todays_order():
    async def main():
        gate = build_admission_gate(max_concurrent_runs=1, queue_depth=32)
        order: list[int] = []

        async def turn(i: int) -> None:
            async with gate.admit():
                order.append(i)
                await asyncio.sleep(0.005)

        tasks = []
        async with gate.admit():
            for i in range(8):
                tasks.append(asyncio.ensure_future(turn(i)))
                await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == list(range(8))


# -- the simulator binding ------------------------------------------------------------------


def test_simulate_runs_candidates_side_by_side():
    from admitgate import _admitgate

    scenario = {"capacity": [(0.0, 8)], "patience_s": 0.2, "load": 10.0, "duration_s": 6.0}
    reports = _admitgate._simulate(
        scenario,
        [
            {"name": "fixed", "ceiling": "fixed", "max_concurrent_runs": 8},
            {
                "name": "adaptive",
                "ceiling": "adaptive",
                "max_concurrent_runs": 64,
                "queue_depth": 128,
                "queue_discipline": "adaptive",
            },
        ],
    )
    fixed, adaptive = reports
    assert adaptive["goodput"] >= 0.9 > fixed["goodput"]
    assert adaptive["provider_429s"] <= 0.03 * adaptive["provider_calls"]
    assert adaptive["phase_limits"] == [(8, 8)]
    with pytest.raises(ValueError, match="ceiling must be one of"):
        _admitgate._simulate(scenario, [{"ceiling": "magic"}])


# -- front doors ----------------------------------------------------------------------------


def test_the_http_front_door_reads_envoys_deadline_header():
    from admitgate._frontdoor import header_deadline_s
    from admitgate.asgi import AdmissionMiddleware

    assert header_deadline_s([(b"x-envoy-expected-rq-timeout-ms", b"1500")]) == 1.5
    for bad in (b"", b"-1", b"1e3", "²".encode(), b"9" * 11):
        assert header_deadline_s([(b"x-envoy-expected-rq-timeout-ms", bad)]) is None

    gate = build_admission_gate(max_concurrent_runs=1, queue_depth=4)

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware = AdmissionMiddleware(app, gate, gate_methods="all")

    async def request(headers):
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "GET",
            "path": "/tasks/abc",
            "root_path": "",
            "query_string": b"",
            "headers": headers,
        }
        await middleware(scope, receive, send)
        return sent[0]

    async def main():
        deadline = [(b"x-envoy-expected-rq-timeout-ms", b"0")]
        # A request that runs at once runs, whatever its deadline.
        assert (await request(deadline))["status"] == 200
        async with gate.admit():
            start = await request(deadline)
        assert start["status"] == 504
        assert (b"admitgate-reason", b"deadline") in start["headers"]

    asyncio.run(main())
    assert gate.stats()["rejected"] == 1


def test_the_grpc_front_door_passes_the_calls_deadline():
    import grpc
    import grpc.aio
    from _grpc_a2a import A2AServer, LoopThread, user_message
    from a2a.types import a2a_pb2_grpc
    from admitgate.grpc import AdmissionInterceptor

    gate = build_admission_gate(max_concurrent_runs=1, queue_depth=4)
    server = A2AServer([AdmissionInterceptor(gate)])
    loop = LoopThread()

    async def scenario():
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.target) as ch:
                stub = a2a_pb2_grpc.A2AServiceStub(ch)
                # One turn of about 100 ms teaches the service time.
                first = stub.SendMessage(user_message("hold:teach"), timeout=10)
                await server.executor.started("teach")
                await asyncio.sleep(0.1)
                server.executor.release("teach")
                await first
                held = stub.SendMessage(user_message("hold:busy"), timeout=10)
                await server.executor.started("busy")
                started = loop_time()
                # 300 ms of deadline: it queues, and is refused once less than a turn is left.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.SendMessage(user_message("late"), timeout=0.3)
                assert loop_time() - started < 0.28
                assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert dict(refused.value.trailing_metadata())["admitgate-reason"] == "deadline"
                server.executor.release("busy")
                await held
        finally:
            server.executor.release_all()
            await server.stop()

    def loop_time():
        return asyncio.get_running_loop().time()

    try:
        loop.run(scenario())
    finally:
        loop.close()
    assert gate.transport_stats()["grpc"]["rejected"]["deadline"] == 1
