"""admitgate.FleetLimit against a real redis-server: one in-flight cap shared by every replica.

Replicas are real processes (``fleet_replica.py``) sharing one limit key; their turns log run
intervals on ``time.monotonic()`` (one clock for every process on a host), so the union of
intervals shows what the fleet ran at once. Redis is Debian's ``redis-server``, started
without persistence by the session fixtures in ``conftest.py``; the restart tests use their
own instance. Every timing bound is generous: the tests must pass on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import admitgate
import pytest
from admitgate import AdmissionRejected, FleetLimit
from conftest import reap_child, run
from fleet_support import (
    TLS_PASSWORD,
    RedisServer,
    Replica,
    eventually,
    redis_server_binary,
    union_peak,
)


def new_key() -> str:
    """A limit key no other test uses."""
    return f"test:{uuid.uuid4().hex[:12]}"


def holders(key: str) -> str:
    """The Redis sorted set of a limit's leases."""
    return f"{{{key}}}:holders"


def tickets(key: str) -> str:
    """The Redis sorted set of a limit's waiting turns."""
    return f"{{{key}}}:tickets"


def wait_until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """``eventually`` for code outside an event loop."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def assert_nothing_left(server: RedisServer, key: str) -> None:
    """No lease or ticket of ``key`` is left in Redis, and every key it used expires. A turn
    leaving a gate gives its lease back without waiting, so the last releases may still be on
    their way: they are given a moment."""
    r = server.client()
    deadline = time.monotonic() + 5
    while r.zcard(holders(key)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.zcard(holders(key)) == 0, r.zrange(holders(key), 0, -1)
    assert r.zcard(tickets(key)) == 0, r.zrange(tickets(key), 0, -1)
    for name in r.scan_iter(match=f"{{{key}}}:*"):
        assert r.pttl(name) > 0, f"{name} never expires"


@pytest.fixture(scope="module")
def restartable() -> Iterator[RedisServer]:
    """A redis-server of this module's own, which the restart tests kill and start again."""
    server = RedisServer(redis_server_binary(), name="restart")
    server.start()
    yield server
    server.close()


# -- configuration -------------------------------------------------------------------------


SECRET = "hunter2-Secret"


@pytest.mark.parametrize(
    ("kwargs", "arg", "shown"),
    [
        # A URL that does not parse is never echoed, only its scheme (issue 15).
        ({"url": "http://127.0.0.1:6379"}, "url", "http:// URL of 21 characters, not shown"),
        ({"url": f"http://user:{SECRET}@h:1"}, "url", "http:// URL of 30 characters, not shown"),
        ({"url": b"redis://h"}, "url", "a bytes"),
        ({"url": "rediss://h:1/#insecure"}, "url", "#insecure"),
        ({"url": "redis+sentinel://h:1,h:2"}, "url", "needs the monitored primary's name"),
        ({"url": "redis+cluster://h:1/2"}, "url", "only db 0"),
        ({"url": "redis+cluster://h:1,,h:2"}, "url", "empty host"),
        ({"key": ""}, "key", "''"),
        ({"key": "a{b}"}, "key", "'a{b}'"),
        ({"key": 7}, "key", "7"),
        ({"max_in_flight": 0}, "max_in_flight", "0"),
        ({"max_in_flight": -1}, "max_in_flight", "-1"),
        ({"max_in_flight": 1.5}, "max_in_flight", "1.5"),
        ({"max_in_flight": True}, "max_in_flight", "True"),
        ({"max_in_flight_per_scope": 21}, "max_in_flight_per_scope", "21"),
        ({"lease_ttl_s": 0}, "lease_ttl_s", "0"),
        ({"lease_ttl_s": float("nan")}, "lease_ttl_s", "nan"),
        ({"lease_ttl_s": 0.01}, "lease_ttl_s", "0.01"),
        ({"lease_ttl_s": "ten"}, "lease_ttl_s", "'ten'"),
        ({"connect_timeout_s": 120}, "connect_timeout_s", "120"),
        ({"command_timeout_s": 6.0}, "command_timeout_s", "6.0"),
        ({"on_backend_error": "Local"}, "on_backend_error", "'Local'"),
        ({"on_backend_error": 1}, "on_backend_error", "1"),
        ({"durability": "quorum"}, "durability", "'quorum'"),
        ({"durability": 2}, "durability", "2"),
        ({"tls_cert_file": "/tmp/c.pem"}, "tls_cert_file", "needs a rediss:// url"),
        (
            {"url": "rediss://127.0.0.1:1/0", "tls_cert_file": "/tmp/c.pem"},
            "tls_cert_file",
            "needs tls_key_file",
        ),
        (
            {"url": "rediss://127.0.0.1:1/0", "tls_cert_file": "/x/c", "tls_key_file": "/x/k"},
            "tls_cert_file",
            "cannot be read",
        ),
        ({"replica_id": "pod 1"}, "replica_id", "'pod 1'"),
        ({"tls_ca_file": "/nonexistent/ca.pem"}, "tls_ca_file", "needs a rediss:// url"),
        (
            {"url": "rediss://127.0.0.1:1/0", "tls_ca_file": "/nonexistent/ca.pem"},
            "tls_ca_file",
            "'/nonexistent/ca.pem'",
        ),
    ],
)
def test_a_bad_setting_names_the_argument_and_the_value(
    kwargs: dict[str, Any], arg: str, shown: str
) -> None:
    settings: dict[str, Any] = {"url": "redis://127.0.0.1:6379/0", "key": "k", "max_in_flight": 20}
    settings.update(kwargs)
    with pytest.raises(ValueError) as info:
        FleetLimit(**settings)
    message = str(info.value)
    assert message.startswith(arg + " "), message
    assert shown in message, message
    assert SECRET not in message


def test_settings_defaults_repr_and_stats_never_show_the_password() -> None:
    url = f"redis://admin:{SECRET}@127.0.0.1:1/0"
    limit = FleetLimit(url, "agent:coordinator", 20, max_in_flight_per_scope=4)
    assert limit.url == "redis://admin:***@127.0.0.1:1/0"
    assert (limit.key, limit.max_in_flight, limit.max_in_flight_per_scope) == (
        "agent:coordinator",
        20,
        4,
    )
    assert (limit.lease_ttl_s, limit.connect_timeout_s, limit.command_timeout_s) == (10, 2, 1)
    assert limit.on_backend_error == "local" and limit.tls_ca_file is None
    assert limit.replica_id.endswith(f"-{os.getpid()}")
    # The default command timeout fits a short TTL (at most half of it).
    assert FleetLimit(url, "k", 1, lease_ttl_s=1.0).command_timeout_s == 0.5
    stats = limit.stats()
    assert set(stats) >= {
        "fleet_in_flight",
        "fleet_max_in_flight",
        "fleet_backend_up",
        "fleet_lease_lost",
        "fleet_borrowed",
        "fleet_outages",
    }
    assert all(type(v) is int for v in stats.values()), stats
    assert stats["fleet_max_in_flight"] == 20 and stats["fleet_backend_up"] == 1
    for shown in (repr(limit), str(limit), limit.url, json.dumps(stats)):
        assert SECRET not in shown
    assert "redis://admin:***@127.0.0.1:1/0" in repr(limit)


def test_no_thread_starts_before_the_first_fleet_call(redis_server: RedisServer) -> None:
    script = f"""
import asyncio, json, os
import admitgate
threads = lambda: len(os.listdir("/proc/self/task"))
gate = admitgate.build_admission_gate(max_concurrent_runs=2)
async def turn():
    async with gate.admit(session_id="a"):
        pass
asyncio.run(turn())
assert not admitgate._admitgate._fleet_runtime_running(), "a gate without fleet= starts nothing"
before = threads()
limit = admitgate.FleetLimit({redis_server.url!r}, "threads", 1)
limit.stats()
built = (threads(), admitgate._admitgate._fleet_runtime_running())
async def use():
    lease = await limit.acquire()
    await lease.release()
asyncio.run(use())
used = (threads(), admitgate._admitgate._fleet_runtime_running())
print(json.dumps([before, built, used]))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    before, built, used = json.loads(done.stdout)
    assert built == [before, False], "an unused FleetLimit starts no thread"
    assert used[1] is True and used[0] > before


# -- one replica ---------------------------------------------------------------------------


def test_acquire_try_acquire_and_release(redis_server: RedisServer) -> None:
    key = new_key()
    r = redis_server.client()

    async def scenario() -> None:
        limit = FleetLimit(redis_server.url, key, 2)
        a = await limit.acquire()
        b = await limit.acquire("tenant")
        assert (a.scope, b.scope, a.reclaimed) == ("", "tenant", None)
        assert a.id.startswith(limit.replica_id + "#") and a.id != b.id
        assert set(r.zrange(holders(key), 0, -1)) == {a.id, b.id}
        assert await limit.try_acquire() is None
        stats = limit.stats()
        assert (stats["fleet_in_flight"], stats["fleet_replica_held"]) == (2, 2)
        waiter = asyncio.ensure_future(limit.acquire())
        await eventually(lambda: limit.stats()["fleet_replica_waiting"] == 1, "queued")
        assert not waiter.done() and r.zcard(tickets(key)) == 1
        await a.release()
        assert a.released and "released" in repr(a)
        c = await asyncio.wait_for(waiter, 5)
        await a.release()  # a second release does nothing
        assert set(r.zrange(holders(key), 0, -1)) == {b.id, c.id}
        for lease in (b, c):
            await lease.release()
        assert limit.stats()["fleet_in_flight"] == 0

    run(scenario(), timeout=20)
    assert_nothing_left(redis_server, key)


def test_a_cancelled_wait_withdraws_its_ticket_and_never_leaks_a_lease(
    redis_server: RedisServer,
) -> None:
    key = new_key()
    r = redis_server.client()

    async def scenario() -> None:
        limit = FleetLimit(redis_server.url, key, 1)
        held = await limit.acquire()
        for _ in range(3):
            waiter = asyncio.ensure_future(limit.acquire("s"))
            await eventually(lambda: r.zcard(tickets(key)) == 1, "ticket queued")
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            await eventually(
                lambda: r.zcard(tickets(key)) == 0 and limit.stats()["fleet_replica_waiting"] == 0,
                "ticket withdrawn",
            )
        # Cancellation racing the grant of the room it waits for: whichever wins, the room is
        # never lost (with a cap of 1, a leaked lease would block the next acquire forever).
        for i in range(20):
            waiter = asyncio.ensure_future(limit.acquire())
            await eventually(lambda: limit.stats()["fleet_replica_waiting"] == 1, "queued")
            released = asyncio.ensure_future(held.release())
            for _ in range(i % 4):
                await asyncio.sleep(0)
            waiter.cancel()
            await released
            try:
                held = await waiter
            except asyncio.CancelledError:
                held = await asyncio.wait_for(limit.acquire(), 5)
        await held.release()

    run(scenario(), timeout=45)
    assert_nothing_left(redis_server, key)


def test_a_dropped_lease_is_given_back(redis_server: RedisServer) -> None:
    key = new_key()
    r = redis_server.client()

    async def scenario() -> None:
        limit = FleetLimit(redis_server.url, key, 1)
        lease = await limit.acquire()
        lease_id = lease.id
        assert r.zscore(holders(key), lease_id) is not None
        del lease
        gc.collect()
        await eventually(lambda: r.zscore(holders(key), lease_id) is None, "given back")
        again = await asyncio.wait_for(limit.acquire(), 5)
        await again.release()

    run(scenario(), timeout=20)
    assert_nothing_left(redis_server, key)


def test_lend_and_reclaim_borrow_over_the_cap_and_the_next_release_repays(
    redis_server: RedisServer,
) -> None:
    key = new_key()
    r = redis_server.client()
    borrowed = f"{{{key}}}:borrowed"

    async def scenario() -> None:
        mine = FleetLimit(redis_server.url, key, 1)
        other = FleetLimit(redis_server.url, key, 1)
        parked = await mine.acquire()
        await mine.lend(parked)  # a person decides meanwhile
        assert parked.released
        theirs = await asyncio.wait_for(other.acquire(), 5)  # the room was used
        resumed = await asyncio.wait_for(mine.reclaim(), 5)  # never waits in line
        assert resumed.reclaimed == "borrowed"
        assert mine.stats()["fleet_borrowed"] == 1 and r.get(borrowed) == "1"
        assert r.zcard(holders(key)) == 2
        waiter = asyncio.ensure_future(other.acquire())
        await eventually(lambda: other.stats()["fleet_replica_waiting"] == 1, "queued")
        await theirs.release()  # repays the borrow instead of freeing room
        assert r.get(borrowed) in (None, "0")
        await asyncio.sleep(0.2)
        assert not waiter.done(), "the cap holds again after the repayment"
        await resumed.release()
        last = await asyncio.wait_for(waiter, 5)
        await last.release()
        room = await mine.reclaim()
        assert room.reclaimed == "taken"
        await room.release()

    run(scenario(), timeout=20)
    assert_nothing_left(redis_server, key)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_rebuilds_the_runtime_and_never_releases_the_parents_leases(
    redis_server: RedisServer,
) -> None:
    key = new_key()
    r = redis_server.client()
    limit = FleetLimit(redis_server.url, key, 3)

    async def take() -> admitgate.FleetLease:
        return await limit.acquire()

    lease = run(take())
    parent_id = lease.id
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 3
        try:
            assert lease.released, "the parent's lease is not the child's"
            del lease  # dropped in the child: must not give the parent's lease back
            gc.collect()

            async def child() -> None:
                mine = await limit.acquire()
                assert mine.id.startswith(f"{limit.replica_id}#")
                assert limit.replica_id.endswith(f"-{os.getpid()}")
                await mine.release()

            run(child(), timeout=20)
            time.sleep(0.2)
            code = 0 if r.zscore(holders(key), parent_id) is not None else 1
        finally:
            os._exit(code)
    assert reap_child(pid, 30) == 0
    assert r.zrange(holders(key), 0, -1) == [parent_id]

    async def parent() -> None:
        await lease.release()
        again = await limit.acquire()
        await again.release()

    run(parent(), timeout=20)
    assert_nothing_left(redis_server, key)


# -- a fleet of processes ------------------------------------------------------------------


class Holder:
    """Turns of an in-process gate that stay inside it until ``leave`` is set."""

    def __init__(self, gate: admitgate.AdmissionGate):
        self.gate = gate
        self.entered = 0
        self.leave = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    async def _turn(self, session: str) -> None:
        async with self.gate.admit(session_id=session):
            self.entered += 1
            await self.leave.wait()

    def start(self, n: int, session: str = "") -> None:
        """Starts ``n`` turns."""
        self.tasks += [asyncio.ensure_future(self._turn(session)) for _ in range(n)]

    async def finish(self) -> None:
        """Lets every turn leave and waits for them."""
        self.leave.set()
        await asyncio.gather(*self.tasks)


def test_three_replicas_share_the_cap_and_hand_off_promptly(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    key = new_key()
    fleet = {"url": redis_server.url, "key": key, "max_in_flight": 6}
    gate = {"max_concurrent_runs": 8, "queue_depth": 16}  # each replica's own ceiling
    replicas.extend(Replica(fleet, gate=gate) for _ in range(3))
    for replica in replicas:
        replica.expect("ready")
    for replica in replicas:
        replica.send({"cmd": "turns", "n": 10, "hold": 0.05})
    turns = [turn for replica in replicas for turn in replica.expect("turns")["turns"]]
    assert len(turns) == 30, "every turn ran"
    peak = union_peak([(t["start"], t["end"]) for t in turns])
    assert peak == 6, f"the fleet ran {peak} turns at once with a cap of 6"
    # Hand-off: a turn that waited starts soon after the release that made room for it (a
    # waiter that learnt of it only by its 1 s re-check would lag by ~0.5 s on average).
    ends = sorted(t["end"] for t in turns)
    lags = []
    for t in turns:
        before = [e for e in ends if e <= t["start"]]
        if before and before[-1] > t["arrive"]:
            lags.append(t["start"] - before[-1])
    lags.sort()
    assert len(lags) >= 15, lags
    median = lags[len(lags) // 2]
    assert median < 0.25, f"median hand-off {median:.3f} s"
    total = max(t["end"] for t in turns) - min(t["arrive"] for t in turns)
    assert total < 10, f"30 turns of 50 ms under a cap of 6 took {total:.2f} s"
    for replica in replicas:
        stats = replica.ask({"cmd": "stats"}, "stats")["gate"]
        assert (stats["admitted"], stats["rejected"], stats["cancelled"]) == (10, 0, 0)
        assert (stats["in_flight"], stats["queued"]) == (0, 0)
    assert_nothing_left(redis_server, key)


def test_a_killed_replicas_leases_come_back_within_the_lease_ttl(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    key = new_key()
    ttl = 2.0
    fleet = {"url": redis_server.url, "key": key, "max_in_flight": 3, "lease_ttl_s": ttl}
    holder = Replica(fleet)
    replicas.append(holder)
    holder_id = holder.expect("ready")["replica_id"]
    holder.ask({"cmd": "hold", "n": 3}, "held")
    r = redis_server.client()
    held = r.zrange(holders(key), 0, -1)
    assert len(held) == 3 and all(i.startswith(holder_id + "#") for i in held), held

    async def scenario() -> float:
        limit = FleetLimit(redis_server.url, key, 3, lease_ttl_s=ttl)
        gate = admitgate.build_admission_gate(max_concurrent_runs=3, fleet=limit)
        assert gate is not None
        waiting = Holder(gate)
        waiting.start(3)
        await eventually(lambda: limit.stats()["fleet_replica_waiting"] == 3, "queued")
        assert (gate.in_flight, gate.admitted) == (3, 0), "slots held, leases awaited"
        holder.signal(signal.SIGKILL)
        killed = time.monotonic()
        await eventually(lambda: waiting.entered == 3, "all three in", ttl + 8)
        took = time.monotonic() - killed
        assert not set(r.zrange(holders(key), 0, -1)) & set(held)
        await waiting.finish()
        assert (gate.admitted, gate.in_flight) == (3, 0)
        return took

    took = run(scenario(), timeout=30)
    # Expiry after at most the TTL since the last renewal, then the waiters' 1 s re-check.
    assert took < ttl + 1.0 + 3.0, f"took {took:.2f} s"
    assert_nothing_left(redis_server, key)


def test_per_scope_slices_hold_fleet_wide(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    key = new_key()
    fleet = {
        "url": redis_server.url,
        "key": key,
        "max_in_flight": 6,
        "max_in_flight_per_scope": 2,
    }
    gate = {"max_concurrent_runs": 6, "queue_depth": 8}
    replicas.extend(Replica(fleet, gate=gate) for _ in range(2))
    for replica in replicas:
        replica.expect("ready")
    for replica in replicas:
        replica.send({"cmd": "turns", "n": 5, "hold": 0.1, "scope": "noisy", "tag": "noisy"})
    replicas[1].send(
        {"cmd": "turns", "n": 2, "hold": 0.1, "scope": "quiet", "delay": 0.1, "tag": "quiet"}
    )
    batches = [replicas[0].expect("turns")] + [replicas[1].expect("turns") for _ in range(2)]
    noisy = [t for b in batches if b["tag"] == "noisy" for t in b["turns"]]
    quiet = [t for b in batches if b["tag"] == "quiet" for t in b["turns"]]
    assert {t["scope"] for t in noisy} == {"noisy"} and len(noisy) == 10
    assert {t["scope"] for t in quiet} == {"quiet"} and len(quiet) == 2
    assert union_peak([(t["start"], t["end"]) for t in noisy]) == 2
    # The quiet tenant is not stuck behind the noisy tenant's backlog: the fleet has room.
    for t in quiet:
        assert t["start"] - t["arrive"] < 0.5, quiet
    assert_nothing_left(redis_server, key)


def test_turns_start_in_fleet_arrival_order_across_unequal_backlogs(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    key = new_key()
    fleet = {"url": redis_server.url, "key": key, "max_in_flight": 2}
    big = Replica(fleet, gate={"max_concurrent_runs": 8})
    small = Replica(fleet, gate={"max_concurrent_runs": 8})
    replicas.extend([big, small])
    big.expect("ready")
    small.expect("ready")
    big.send({"cmd": "turns", "n": 8, "hold": 0.2})
    small.send({"cmd": "turns", "n": 2, "hold": 0.2, "delay": 0.3})
    first = big.expect("turns")["turns"]
    later = small.expect("turns")["turns"]
    handoff = 0.1  # far above a hand-off on one host
    assert min(t["arrive"] for t in later) - max(t["arrive"] for t in first) > handoff
    assert union_peak([(t["start"], t["end"]) for t in first + later]) <= 2
    # Every turn of the big backlog arrived earlier, so it starts before the small one's,
    # although the small replica's turns were waiting while the big one's ran.
    assert max(t["start"] for t in first) <= min(t["start"] for t in later), (first, later)
    assert_nothing_left(redis_server, key)


def test_a_paused_holder_past_its_ttl_is_counted_as_lease_lost(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    key = new_key()
    ttl = 1.0
    fleet = {"url": redis_server.url, "key": key, "max_in_flight": 1, "lease_ttl_s": ttl}
    paused = Replica(fleet)
    replicas.append(paused)
    paused.expect("ready")
    paused.ask({"cmd": "hold", "n": 1}, "held")

    async def take_over() -> Holder:
        limit = FleetLimit(redis_server.url, key, 1, lease_ttl_s=ttl)
        gate = admitgate.build_admission_gate(fleet=limit)
        assert gate is not None
        taker = Holder(gate)
        taker.start(1)
        await eventually(lambda: limit.stats()["fleet_replica_waiting"] == 1, "queued")
        paused.signal(signal.SIGSTOP)  # a GC pause, a frozen VM...
        await eventually(lambda: taker.entered == 1, "took the expired lease", ttl + 6)
        paused.signal(signal.SIGCONT)
        return taker

    async def scenario() -> None:
        taker = await take_over()
        deadline = time.monotonic() + 10
        while True:
            answer = paused.ask({"cmd": "stats"}, "stats")
            if answer["gate"]["fleet_lease_lost"] == 1:
                break
            assert time.monotonic() < deadline, answer
            await asyncio.sleep(0.1)
        assert answer["stats"]["fleet_lease_lost"] == 1
        await taker.finish()

    run(scenario(), timeout=30)
    wait_until(
        lambda: any("expired under its turn" in line for line in paused.stderr),
        "a warning on the admitgate logger",
    )
    paused.ask({"cmd": "release"}, "released")  # a lost lease's release sends nothing
    wait_until(lambda: redis_server.client().zcard(holders(key)) == 0, "nothing held")


# -- outages and restarts ------------------------------------------------------------------


def outage_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [rec for rec in caplog.records if rec.name == "admitgate" and "unreachable" in rec.msg]


def test_redis_restart_and_outage_with_local_admission(
    restartable: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    key = new_key()
    caplog.set_level(logging.INFO, logger="admitgate")
    r = restartable.client()
    limit = FleetLimit(
        restartable.url,
        key,
        4,
        lease_ttl_s=1.5,
        connect_timeout_s=0.5,
        command_timeout_s=0.5,
    )

    async def scenario() -> None:
        held = [await limit.acquire() for _ in range(2)]
        # A restart without persistence mid-run forgets every lease: the heartbeat re-takes.
        restartable.restart()
        await eventually(
            lambda: set(r.zrange(holders(key), 0, -1)) == {lease.id for lease in held},
            "leases re-taken after a restart",
        )
        await eventually(lambda: limit.stats()["fleet_lease_retaken"] == 2, "counted")
        # An outage: admissions decide locally, without a round trip once it is known. (A
        # heartbeat may have found the restart above down: count from here.)
        outages, warned = limit.stats()["fleet_outages"], len(outage_records(caplog))
        restartable.stop()
        started = time.monotonic()
        local = [await asyncio.wait_for(limit.acquire(), 5) for _ in range(2)]
        assert time.monotonic() - started < 4, "bounded by connect + command timeouts"
        stats = limit.stats()
        assert (stats["fleet_backend_up"], stats["fleet_outages"]) == (0, outages + 1)
        assert stats["fleet_replica_held"] == 4
        await eventually(lambda: len(outage_records(caplog)) == warned + 1, "a warning")
        restartable.start()
        await eventually(lambda: limit.stats()["fleet_backend_up"] == 1, "recovery", 15)
        every = {lease.id for lease in held + local}
        await eventually(
            lambda: set(r.zrange(holders(key), 0, -1)) == every,
            "leases of the outage registered",
        )
        for lease in held + local:
            await lease.release()
        assert len(outage_records(caplog)) == warned + 1, "warned once per outage"

    run(scenario(), timeout=45)
    messages = [rec.getMessage() for rec in caplog.records if rec.name == "admitgate"]
    assert any("is back after" in m for m in messages), messages
    assert limit.stats()["fleet_lease_lost"] == 0
    assert_nothing_left(restartable, key)


def test_redis_outage_with_reject_refuses_and_re_takes_running_leases(
    restartable: RedisServer,
) -> None:
    key = new_key()
    r = restartable.client()
    limit = FleetLimit(
        restartable.url,
        key,
        2,
        on_backend_error="reject",
        lease_ttl_s=1.5,
        connect_timeout_s=0.5,
        command_timeout_s=0.5,
    )

    async def scenario() -> None:
        running = [await limit.acquire() for _ in range(2)]
        waiter = asyncio.ensure_future(limit.acquire())
        await eventually(lambda: limit.stats()["fleet_replica_waiting"] == 1, "queued")
        restartable.stop()
        started = time.monotonic()
        with pytest.raises(AdmissionRejected) as refused:
            await asyncio.wait_for(limit.acquire(), 5)
        assert time.monotonic() - started < 4, "bounded by connect + command timeouts"
        assert refused.value.reason == "fleet_unavailable"
        assert refused.value.retry_after is not None and refused.value.retry_after > 0
        with pytest.raises(AdmissionRejected):
            await asyncio.wait_for(waiter, 5)  # a waiting turn is refused too
        assert limit.stats()["fleet_backend_up"] == 0
        restartable.start()
        await eventually(lambda: limit.stats()["fleet_backend_up"] == 1, "recovery", 15)
        await eventually(
            lambda: set(r.zrange(holders(key), 0, -1)) == {lease.id for lease in running},
            "running leases re-taken",
        )
        await running.pop().release()
        running.append(await asyncio.wait_for(limit.acquire(), 5))
        for lease in running:
            await lease.release()

    run(scenario(), timeout=45)
    assert_nothing_left(restartable, key)


# -- TLS -----------------------------------------------------------------------------------


def test_rediss_with_a_password_hands_off_and_never_shows_the_password(
    redis_tls_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="admitgate")
    key = new_key()
    url = redis_tls_server.url
    assert url.startswith("rediss://") and TLS_PASSWORD in url
    tls = {"tls_ca_file": redis_tls_server.ca_file, "connect_timeout_s": 3.0}
    first = FleetLimit(url, key, 1, **tls)
    second = FleetLimit(url, key, 1, **tls)
    wrong = FleetLimit(
        url.replace(TLS_PASSWORD, "wr0ng-Pa55word"), key, 1, on_backend_error="reject", **tls
    )
    untrusted = FleetLimit(url, key, 1, connect_timeout_s=3.0)  # no CA: the cert is unknown

    async def scenario() -> list[str]:
        await first.connect()
        lease = await first.acquire()
        waiter = asyncio.ensure_future(second.acquire())
        await eventually(lambda: second.stats()["fleet_replica_waiting"] == 1, "queued")
        await lease.release()
        handed = await asyncio.wait_for(waiter, 5)
        await handed.release()
        shown = [repr(first), first.url, str(first.stats())]
        for bad in (wrong, untrusted):
            with pytest.raises(ConnectionError) as failed:
                await bad.connect()
            shown.append(str(failed.value))
        with pytest.raises(AdmissionRejected) as refused:
            await wrong.acquire()
        shown.append(repr(refused.value))
        return shown

    shown = run(scenario(), timeout=30)
    wait_until(lambda: len(outage_records(caplog)) >= 2, "outage warnings")
    shown += [rec.getMessage() for rec in caplog.records]
    for text in shown:
        assert TLS_PASSWORD not in text and "wr0ng-Pa55word" not in text, text
    assert redis_tls_server.client().zcard(holders(key)) == 0
