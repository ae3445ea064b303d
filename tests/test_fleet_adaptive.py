"""``adaptive=`` with ``fleet=``: one learned limit for the whole fleet, kept in Redis, moved
by any replica's throttles and growth, honoured by every lease, against a real redis-server.

Each test runs several gates (each with its own ``FleetLimit``, so each is a replica with its
own Redis connection, heartbeat and instance id) on one key, in front of one simulated provider
of capacity C: a shared counter that raises the throttle exception beyond C concurrent calls.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from _provider import Provider, RateLimited
from admitgate import AdaptiveLimit, AdmissionRejected, FleetLimit, build_admission_gate
from conftest import in_forked_child, run
from fleet_support import RedisServer, eventually, redis_server_binary


def new_key() -> str:
    return f"learn:{uuid.uuid4().hex[:12]}"


def learned_key(key: str) -> str:
    return f"{{{key}}}:learned"


def replicas(
    url: str, key: str, n: int, cap: int, on_backend_error: str = "local", **adaptive: Any
) -> list[Any]:
    """``n`` gates on one fleet key, each its own replica."""
    return [
        build_admission_gate(
            max_concurrent_runs=64,
            queue_depth=256,
            fleet=FleetLimit(
                url,
                key,
                cap,
                replica_id=f"r{i}",
                lease_ttl_s=3.0,
                command_timeout_s=0.5,
                connect_timeout_s=0.5,
                on_backend_error=on_backend_error,
            ),
            adaptive=AdaptiveLimit(throttle_on=(RateLimited,), **adaptive),
        )
        for i in range(n)
    ]


class Load:
    """Keeps ``per_replica`` turns offered on each gate until stopped; counts what ran."""

    def __init__(self, gates: list[Any], provider: Provider, per_replica: int) -> None:
        self.gates = gates
        self.provider = provider
        self.per_replica = per_replica
        self.running = 0
        self.peak = 0
        self.stopped = False

    async def turn(self, gate: Any) -> None:
        while not self.stopped:
            try:
                async with gate.admit():
                    self.running += 1
                    self.peak = max(self.peak, self.running)
                    try:
                        await self.provider.call()
                    finally:
                        self.running -= 1
            except (RateLimited, AdmissionRejected):
                await asyncio.sleep(0.005)

    def start(self) -> list[asyncio.Task[None]]:
        return [
            asyncio.ensure_future(self.turn(gate))
            for gate in self.gates
            for _ in range(self.per_replica)
        ]


async def stop(load: Load, tasks: list[asyncio.Task[None]], gates: list[Any]) -> None:
    load.stopped = True
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    for gate in gates:
        await gate.fleet.shutdown()


@pytest.fixture(scope="module")
def restartable() -> Iterator[RedisServer]:
    """A redis-server of this module's own, which the restart test kills and starts again."""
    server = RedisServer(redis_server_binary(), name="learn-restart")
    server.start()
    yield server
    server.close()


def test_three_replicas_find_the_providers_capacity_together(redis_server: RedisServer) -> None:
    key, r = new_key(), redis_server.client()
    provider = Provider(capacity=12, service_s=0.02)
    gates = replicas(redis_server.url, key, 3, 64)

    async def main() -> None:
        load = Load(gates, provider, per_replica=12)
        tasks = load.start()
        await asyncio.sleep(1.5)
        # Count the 429s from here on: the search found the capacity by now.
        calls, refused = provider.calls, provider.refused
        await asyncio.sleep(1.5)
        steady_calls, steady_refused = provider.calls - calls, provider.refused - refused
        learned = int(r.hget(learned_key(key), "limit"))
        snapshots = [gate.stats() for gate in gates]
        seen = [s["limit"] for s in snapshots]
        await stop(load, tasks, gates)
        assert 9 <= learned <= 15, (learned, seen)
        # One value for the fleet, which every replica shows (give or take the last change).
        assert all(abs(s - learned) <= 2 for s in seen), (learned, seen)
        assert all(s["limit"] == s["fleet_limit"] for s in snapshots), snapshots
        # Typically 1-2% here (probes, one at a time for the fleet); bounds with room for a
        # loaded CI machine, whose latency spikes read as inflation.
        assert steady_refused <= 0.08 * steady_calls, (steady_refused, steady_calls)
        assert provider.refused <= 0.1 * provider.calls, (provider.refused, provider.calls)
        # The fleet never ran more than the learned limit allowed: the provider's capacity
        # plus the one probe above it at a time.
        assert load.peak <= 64

    run(main(), timeout=30)


def test_a_429_on_one_replica_lowers_the_limit_the_others_see(redis_server: RedisServer) -> None:
    key, r = new_key(), redis_server.client()
    a, b = replicas(redis_server.url, key, 2, 64, initial_limit=10)

    async def main() -> None:
        release = asyncio.Event()

        async def hold(gate: Any, throttled: bool = False) -> None:
            try:
                async with gate.admit():
                    await release.wait()
                    if throttled:
                        raise RateLimited
            except RateLimited:
                pass

        # Seven turns on A (six held, then the seventh refused by the provider): the refusal
        # says the provider admits six, whatever else A knew.
        held = [asyncio.ensure_future(hold(a)) for _ in range(6)]
        await eventually(lambda: a.stats()["in_flight"] == 6, "six running")
        assert b.stats()["limit"] == 10
        refused = asyncio.ensure_future(hold(a, throttled=True))
        await eventually(lambda: a.stats()["in_flight"] == 7, "seventh running")
        # The refused call ends (the six end with it, after it reported).
        started = time.monotonic()
        release.set()
        await refused
        await eventually(
            lambda: r.hget(learned_key(key), "limit") == "6",
            f"lowered in Redis: {r.hgetall(learned_key(key))} {a.stats()}",
        )
        took = time.monotonic() - started
        await asyncio.gather(*held)
        assert took < 0.5, took
        # B's next call reads it (one acquire): its limit is the fleet's.
        async with b.admit():
            pass
        assert b.stats()["limit"] == 6 == b.limit, b.stats()
        assert b.stats()["fleet_limit"] == 6
        # And B admits no more than six fleet-wide now, whatever its own ceiling (64).
        for gate in (a, b):
            await gate.fleet.shutdown()

    run(main(), timeout=15)


def test_as_turn_reports_a_throttle_with_a_fleet_too(redis_server: RedisServer) -> None:
    # `async with gate.admit() as turn` hands the turn over whether it ran at once or waited for
    # its local slot, then its lease (it was None with fleet=, so report_throttled was out of
    # reach there).
    key, r = new_key(), redis_server.client()
    gate = build_admission_gate(
        max_concurrent_runs=2,
        queue_depth=8,
        fleet=FleetLimit(redis_server.url, key, 16, replica_id="solo", lease_ttl_s=3.0),
        adaptive=AdaptiveLimit(initial_limit=8),
    )
    assert gate is not None

    async def main() -> None:
        release = asyncio.Event()
        turns: list[Any] = []

        async def hold() -> None:
            async with gate.admit() as turn:
                turns.append(turn)
                await release.wait()

        held = [asyncio.ensure_future(hold()) for _ in range(2)]
        await eventually(lambda: len(turns) == 2, "two running")
        queued = asyncio.ensure_future(hold())  # waits for a local slot, then its lease
        await eventually(lambda: gate.stats()["queued"] == 1, "one queued")
        release.set()
        await asyncio.gather(*held, queued)
        assert len(turns) == 3 and all(turn is not None for turn in turns), turns
        async with gate.admit() as turn:
            assert turn is not None
            turn.report_throttled(retry_after_s=1.0)
        await eventually(
            lambda: (
                r.hget(learned_key(key), "limit") is not None
                and int(r.hget(learned_key(key), "limit")) < 8
            ),
            f"lowered in Redis: {r.hgetall(learned_key(key))} {gate.stats()}",
        )
        await gate.fleet.shutdown()

    run(main(), timeout=15)


def test_the_learned_limit_stays_within_min_limit_and_max_in_flight(
    redis_server: RedisServer,
) -> None:
    r = redis_server.client()
    roomy, stingy = Provider(capacity=100, service_s=0.02), Provider(capacity=0, service_s=0.02)
    capped_key, floored_key = new_key(), new_key()
    capped = replicas(redis_server.url, capped_key, 2, 6)
    floored = replicas(redis_server.url, floored_key, 2, 64, min_limit=2)

    async def main() -> None:
        loads = [Load(capped, roomy, per_replica=10), Load(floored, stingy, per_replica=4)]
        tasks = [load.start() for load in loads]
        highest, lowest = 0, 64
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            highest = max(highest, int(r.hget(learned_key(capped_key), "limit") or 0))
            lowest = min(lowest, int(r.hget(learned_key(floored_key), "limit") or 64))
            assert r.zcard(f"{{{capped_key}}}:holders") <= 6
        for load, task in zip(loads, tasks, strict=True):
            await stop(load, task, load.gates)
        assert highest == 6, "never above max_in_flight, and it got there"
        assert lowest == 2, "never below min_limit, and it got there"
        assert loads[0].peak <= 6

    run(main(), timeout=20)


def test_redis_restarted_mid_run_never_lets_the_fleet_over_its_cap(
    restartable: RedisServer,
) -> None:
    key, r = new_key(), restartable.client()
    provider = Provider(capacity=6, service_s=0.02)
    gates = replicas(restartable.url, key, 2, 8, on_backend_error="reject")

    async def main() -> None:
        load = Load(gates, provider, per_replica=10)
        tasks = load.start()
        await eventually(lambda: r.exists(learned_key(key)) == 1, "learned")
        await asyncio.sleep(0.5)
        restartable.restart()
        # The fleet forgets its limit and leases; the next turn seeds it again.
        await eventually(lambda: r.exists(learned_key(key)) == 1, "seeded again", timeout=8)
        await asyncio.sleep(0.5)
        await stop(load, tasks, gates)
        assert load.peak <= 8, load.peak
        assert int(r.hget(learned_key(key), "limit")) <= 8

    run(main(), timeout=30)


def test_a_fleet_without_adaptive_leaves_no_learned_limit(redis_server: RedisServer) -> None:
    key, r = new_key(), redis_server.client()
    gate = build_admission_gate(max_concurrent_runs=4, fleet=FleetLimit(redis_server.url, key, 3))

    async def main() -> None:
        async with gate.admit():
            pass
        await gate.fleet.shutdown()

    run(main())
    assert r.exists(learned_key(key)) == 0
    assert "fleet_limit" not in gate.stats() and gate.stats()["limit"] == 4
    assert gate.fleet.stats()["fleet_limit"] == 0


def test_min_limit_above_the_fleet_cap_is_refused_naming_both(redis_server: RedisServer) -> None:
    fleet = FleetLimit(redis_server.url, new_key(), 4)
    with pytest.raises(
        ValueError, match=r"^AdaptiveLimit\(min_limit=9\) exceeds the fleet's max_in_flight=4$"
    ):
        build_admission_gate(
            max_concurrent_runs=16, fleet=fleet, adaptive=AdaptiveLimit(min_limit=9)
        )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_learns_on_its_own_runtime(redis_server: RedisServer) -> None:
    key, r = new_key(), redis_server.client()
    (gate,) = replicas(redis_server.url, key, 1, 64, initial_limit=8)

    async def turns(n: int, throttle_at: int | None = None) -> None:
        release = asyncio.Event()
        entered: list[int] = []

        async def one(i: int) -> None:
            try:
                async with gate.admit():
                    entered.append(i)
                    await release.wait()
                    if i == throttle_at:
                        raise RateLimited
            except RateLimited:
                pass

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        # Every body running (each with its lease), not only holding its local slot: a turn
        # still waiting for its lease starts after the release, with fewer running.
        await eventually(lambda: len(entered) == n, "running")
        release.set()
        await asyncio.gather(*tasks)

    # The parent learns (seeds 8) with a proposal in flight at the fork, perhaps.
    run(turns(4))
    assert r.hget(learned_key(key), "limit") == "8"

    def child() -> None:
        # Five running, the last refused: the child's own runtime sends the lower (to 4).
        asyncio.run(turns(5, throttle_at=4))
        deadline = time.monotonic() + 5
        while r.hget(learned_key(key), "limit") != "4":
            assert time.monotonic() < deadline, r.hgetall(learned_key(key))
            time.sleep(0.01)
        assert gate.limit == 4, gate.stats()

    code, message = in_forked_child(child)
    assert code == 0, message
    # The parent reads the child's lower with its next lease.
    run(turns(1))
    assert gate.limit == 4 == gate.stats()["fleet_limit"]

    async def close() -> None:
        await gate.fleet.shutdown()

    run(close())


def test_reconfigure_bounds_the_replica_and_close_stops_proposing(
    redis_server: RedisServer,
) -> None:
    key, r = new_key(), redis_server.client()
    (gate,) = replicas(redis_server.url, key, 1, 64, initial_limit=8)

    async def main() -> None:
        async with gate.admit():
            pass
        await eventually(lambda: r.hget(learned_key(key), "limit") == "8", "seeded")
        # A lower max_concurrent_runs bounds this replica's own ceiling; the fleet's value,
        # which other replicas share, is not this replica's to change by reconfiguring.
        gate.reconfigure(max_concurrent_runs=3)
        async with gate.admit():
            pass
        assert gate.stats()["max_concurrent_runs"] == 3
        assert gate.limit == 8 == gate.stats()["fleet_limit"]
        assert r.hget(learned_key(key), "limit") == "8"
        # After shutdown nothing is sent: a throttle on a turn that still ends changes nothing.
        await gate.fleet.shutdown()
        before = r.hgetall(learned_key(key))
        with pytest.raises((RateLimited, AdmissionRejected)):
            async with gate.admit():
                raise RateLimited
        await asyncio.sleep(0.1)
        assert r.hgetall(learned_key(key)) == before

    run(main())
