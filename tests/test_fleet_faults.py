"""Faults on a working fleet, with real replica processes and a real redis-server: a replica
paused (SIGSTOP) or killed (SIGKILL) while turns wait, and a seeded load run with a kill, a
pause and a Redis restart without persistence.

What the fleet promises here (and the docs state): a slow or late reply is not a dead server;
no turn starts on a grant that expired while its replica was paused; room stops going to a
dead or paused replica's tickets once one grant to it goes unclaimed for ``command_timeout``;
after a pause, at most the turns that were running when it began run over the cap.
"""

from __future__ import annotations

import random
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fleet_support import RedisServer, Replica, redis_server_binary, union_peak


@pytest.fixture(scope="module")
def restartable() -> Iterator[RedisServer]:
    """A redis-server of this module's own, which the load run restarts."""
    server = RedisServer(redis_server_binary(), name="faults")
    server.start()
    yield server
    server.close()


def new_key() -> str:
    return f"test:faults:{uuid.uuid4().hex[:8]}"


def wait_until(check: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.01)


def peak_within(intervals: list[tuple[float, float]], start: float, end: float) -> int:
    """The most intervals overlapping at any instant of ``[start, end)``."""
    clipped = [(max(s, start), min(e, end)) for s, e in intervals if s < end and e > start]
    return union_peak([(s, e) for s, e in clipped if s < e])


def busiest_moment(
    tagged: list[tuple[str, float, float]], start: float, end: float, began: float
) -> tuple[float, dict[str, int]]:
    """When in ``[start, end)`` the most turns ran (seconds after ``began``), and how many of
    them each replica ran then: what a failed bound prints, to tell whose turns were over."""
    moments = [max(s, start) for _, s, e in tagged if s < end and e > start]
    best: tuple[float, dict[str, int]] = (0.0, {})
    for t in moments:
        counts: dict[str, int] = {}
        for name, s, e in tagged:
            if s <= t < e:
                counts[name] = counts.get(name, 0) + 1
        if sum(counts.values()) > sum(best[1].values()):
            best = (round(t - began, 3), counts)
    return best


def two_replicas_with_the_room_held(
    redis_server: RedisServer, replicas: list[Replica], ttl: float
) -> tuple[str, Replica, Replica]:
    """Two replicas of a fresh limit of 4 (`command_timeout_s` 0.2 s): the first holds all 4
    leases, the second is ready. Returns the key and both."""
    key = new_key()
    fleet = {
        "url": redis_server.url,
        "key": key,
        "max_in_flight": 4,
        "lease_ttl_s": ttl,
        "command_timeout_s": 0.2,
    }
    holder, other = Replica(fleet, via="limit"), Replica(fleet, via="limit")
    replicas.extend([holder, other])
    holder.expect("ready")
    other.expect("ready")
    holder.ask({"cmd": "hold", "n": 4}, "held")
    return key, holder, other


def test_a_pause_longer_than_the_command_timeout_is_not_an_outage(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    fleet = {
        "url": redis_server.url,
        "key": new_key(),
        "max_in_flight": 4,
        "lease_ttl_s": 6.0,
        "command_timeout_s": 0.2,
    }
    paused = Replica(fleet, via="limit")
    replicas.append(paused)
    paused.expect("ready")
    # Calls back to back, so that one is in flight when the process stops.
    paused.send({"cmd": "load", "clients": 20, "duration": 4.0, "hold": [0.0005, 0.002]})
    time.sleep(0.5)
    for _ in range(2):
        paused.signal(signal.SIGSTOP)
        time.sleep(1.5)  # over two command timeouts, well inside the lease TTL
        paused.signal(signal.SIGCONT)
        time.sleep(0.2)
    stats = paused.expect("loaded", timeout=20)["stats"]
    assert stats["fleet_outages"] == 0, stats
    assert stats["fleet_backend_up"] == 1, stats


def test_no_turn_starts_on_a_grant_that_expired_while_its_replica_was_paused(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    ttl = 1.0
    key, other, paused = two_replicas_with_the_room_held(redis_server, replicas, ttl)
    r = redis_server.client()
    paused.send({"cmd": "turns", "n": 8, "hold": 0.3, "tag": "paused"})
    wait_until(lambda: r.zcard(f"{{{key}}}:tickets") == 8, "the paused replica's 8 wait first")
    # Long enough that the room is still taken when the paused replica wakes.
    other.send({"cmd": "turns", "n": 8, "hold": 1.5, "tag": "other"})
    wait_until(lambda: r.zcard(f"{{{key}}}:tickets") == 16, "the other's 8 wait behind")
    paused.signal(signal.SIGSTOP)
    # The room goes to the paused replica's tickets first; none of it can be used.
    other.ask({"cmd": "release"}, "released")
    time.sleep(3 * ttl)
    paused.signal(signal.SIGCONT)
    woke = time.monotonic()
    theirs = other.expect("turns", timeout=20)["turns"]
    mine = paused.expect("turns", timeout=20)["turns"]
    everything = [(t["start"], t["end"]) for t in theirs + mine]
    peak = union_peak(everything)
    assert peak <= 4, f"{peak} turns at once on a cap of 4 after the pause"
    assert all(t["start"] > woke for t in mine), "nothing ran while paused"
    stats = paused.ask({"cmd": "stats"}, "stats")["stats"]
    print(f"peak {peak} on a cap of 4; lost grants counted: {stats['fleet_lease_lost']}")
    assert (stats["fleet_outages"], stats["fleet_replica_held"]) == (0, 0), stats


def test_a_killed_replicas_tickets_stop_receiving_room_within_a_command_timeout(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    key, other, dead = two_replicas_with_the_room_held(redis_server, replicas, ttl=3.0)
    r = redis_server.client()
    dead.send({"cmd": "turns", "n": 8, "hold": 0.3})
    wait_until(lambda: r.zcard(f"{{{key}}}:tickets") == 8, "the doomed replica's 8 wait first")
    other.send({"cmd": "turns", "n": 4, "hold": 0.2})
    wait_until(lambda: r.zcard(f"{{{key}}}:tickets") == 12, "the other's 4 wait behind")
    dead.signal(signal.SIGKILL)
    dead.process.wait(timeout=5)
    released = time.monotonic()
    other.ask({"cmd": "release"}, "released")
    turns = other.expect("turns", timeout=20)["turns"]
    first = min(t["start"] for t in turns) - released
    print(f"the live replica's first waiting turn started {first:.3f} s after the release")
    # Grants to the dead replica go unclaimed for command_timeout (0.2 s); then its tickets get
    # no more room, and the next heartbeat of the waiting replica (every lease_ttl / 3 = 1 s)
    # finds the room. Before: the dead tickets held it for their whole TTL (3 s).
    assert first < 1.8, f"the live replica's first waiting turn started {first:.2f} s later"
    assert union_peak([(t["start"], t["end"]) for t in turns]) == 4


DOCUMENTED = {"ok", "fleet_unavailable", "queue_full", "shed", "timeout"}


def test_a_seeded_load_run_with_a_kill_a_pause_and_a_redis_restart(
    restartable: RedisServer, replicas: list[Replica]
) -> None:
    rng = random.Random(15)
    cap, ttl, clients, duration = 10, 2.0, 20, 10.0
    key = new_key()
    fleet = {
        "url": restartable.url,
        "key": key,
        "max_in_flight": cap,
        "lease_ttl_s": ttl,
        "command_timeout_s": 0.5,
        "connect_timeout_s": 0.5,
    }
    gate = {"max_concurrent_runs": cap, "queue_depth": 2 * clients}
    names = ["a", "b", "c"]
    procs = {name: Replica(fleet, gate=gate) for name in names}
    replicas.extend(procs.values())
    replica_ids = {name: proc.expect("ready")["replica_id"] for name, proc in procs.items()}
    began = time.monotonic()
    for i, (name, proc) in enumerate(procs.items()):
        proc.send({"cmd": "load", "clients": clients, "duration": duration, "tag": name,
                   "hold": [0.02, 0.08], "seed": rng.randrange(1 << 30) + i})  # fmt: skip
    # The fault schedule: seeded jitter around fixed slots; each fault starts a second after
    # the fleet recovered from the one before, so they never overlap.
    kill_at = 1.0 + rng.uniform(0, 0.3)
    redis_at = 2.5 + rng.uniform(0, 0.3)
    pause_jitter = rng.uniform(0, 0.3)
    pause_for = 3.0

    def at(offset: float) -> None:
        time.sleep(max(0.0, began + offset - time.monotonic()))

    events: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    at(kill_at)
    procs["a"].signal(signal.SIGKILL)
    procs["a"].process.wait(timeout=5)
    killed = time.monotonic()
    events["a"] = procs["a"].drain()
    restarted = Replica(fleet, gate=gate)
    replicas.append(restarted)
    restarted.expect("ready")
    events["a2"] = []
    restarted.send({"cmd": "load", "clients": clients, "tag": "a2", "hold": [0.02, 0.08],
                    "duration": duration - (time.monotonic() - began), "seed": 7})  # fmt: skip
    at(redis_at)
    redis_down = time.monotonic()
    restartable.restart()
    # Back once every live replica says so (its probe runs every second while Redis is down).
    for proc in (restarted, procs["b"], procs["c"]):
        wait_until(
            lambda proc=proc: proc.ask({"cmd": "stats"}, "stats")["stats"]["fleet_backend_up"],
            "every replica sees Redis again",
        )
    redis_back = time.monotonic()
    pause_at = max(4.5, redis_back + 1.0 - began) + pause_jitter
    at(pause_at)
    outages_before_pause = procs["b"].ask({"cmd": "stats"}, "stats")["stats"]["fleet_outages"]
    procs["b"].signal(signal.SIGSTOP)
    paused = time.monotonic()
    # The leases the paused replica holds as it stops, read from Redis once the calls it had
    # sent have been answered. Each is a turn that will run when it wakes, whether it started
    # before the stop or its claim was answered just before (then its start is only seen after
    # the pause): these, and only these, may run over the cap once their leases expire.
    time.sleep(0.1)
    held_at_pause = sum(
        1
        for lease in restartable.client().zrange(f"{{{key}}}:holders", 0, -1)
        if lease.startswith(replica_ids["b"] + "#")
    )
    at(pause_at + pause_for)
    procs["b"].signal(signal.SIGCONT)
    woke = time.monotonic()
    live = {"a2": restarted, "b": procs["b"], "c": procs["c"]}
    final: dict[str, dict[str, Any]] = {}
    for name, proc in live.items():
        final[name] = proc.expect("loaded", timeout=30)["stats"]
        events[name] = proc.drain()

    intervals: list[tuple[float, float]] = []
    tagged: list[tuple[str, float, float]] = []  # the same, with the replica that ran each
    paused_running = 0
    stragglers_end = 0.0  # when the last turn running on the paused replica at the pause ended
    answers = 0
    for name, got in events.items():
        starts = {e["i"]: e["t"] for e in got if e["event"] == "s"}
        ends = {e["i"]: (e["t"], e["o"]) for e in got if e["event"] == "e"}
        for turn, (_, outcome) in ends.items():
            assert outcome in DOCUMENTED, (name, turn, outcome)
            answers += 1
        for turn, start in starts.items():
            if name == "a" and turn not in ends:
                end = killed  # running when the process died
            else:
                end = ends[turn][0]  # every started turn of a live replica ended
            intervals.append((start, end))
            tagged.append((name, start, end))
            if name == "b" and start <= paused < end:
                paused_running += 1
                stragglers_end = max(stragglers_end, end)
    assert answers > 500, answers
    # The cap held whenever everything was healthy: before the Redis restart (the kill only
    # leaves the dead replica's leases to expire: fewer turns, never more), and from half a
    # second after every replica saw Redis again until the pause (the turns admitted locally
    # meanwhile have ended: 80 ms at most); then after the pause's stragglers ended.
    after_pause = max(woke + 0.5, stragglers_end)
    healthy = [(began, redis_down), (redis_back + 0.5, paused), (after_pause, began + duration)]
    # Every turn seen running at the stop held one of those leases.
    assert paused_running <= held_at_pause, (paused_running, held_at_pause)
    print(
        f"{answers} answers; {paused_running} turns seen running on the paused replica, "
        f"{held_at_pause} leases held by it"
    )
    for start, end in healthy:
        peak = peak_within(intervals, start, end)
        print(f"healthy {start - began:.1f}-{end - began:.1f} s: peak {peak}")
        assert peak <= cap, (
            f"{peak} turns at once on a cap of {cap} in {start - began:.1f}-{end - began:.1f} s"
        )
    # The Redis restart: each replica admits against its own ceiling while Redis is away.
    peak = peak_within(intervals, redis_down, redis_back + 0.5)
    print(f"Redis restart {redis_down - began:.1f}-{redis_back + 0.5 - began:.1f} s: peak {peak}")
    assert peak <= len(live) * cap, peak
    # The pause: only the turns that held a lease on the paused replica when it stopped run
    # over the cap (their leases expired and the room was taken); no turn starts on a grant
    # that expired meanwhile (a grant published while it slept is claimed after it wakes, and
    # found expired).
    peak = peak_within(intervals, paused, after_pause)
    for name, got in final.items():
        print(name, {k: v for k, v in got.items() if k.startswith("fleet_")})
    # The pause itself is no outage (a call it outlived is waited out, confirmed by PING on a
    # fresh connection): the paused replica's outage count is what it was before the stop. (An
    # outage as it woke would admit locally, over the cap by design; seen once, on a machine
    # too loaded to answer that PING within the timeouts.)
    print(
        "b outages before the pause",
        outages_before_pause,
        "at the end",
        final["b"]["fleet_outages"],
    )
    assert final["b"]["fleet_outages"] == outages_before_pause, (outages_before_pause, final["b"])
    print(f"pause {paused - began:.1f}-{after_pause - began:.1f} s: peak {peak}")
    assert peak <= cap + held_at_pause, (
        peak,
        held_at_pause,
        busiest_moment(tagged, paused, after_pause, began),
        {
            name: {k: v for k, v in got.items() if k.startswith("fleet_")}
            for name, got in final.items()
        },
    )
    # The end state: every replica idle, the fleet figures read zero within a heartbeat
    # (lease_ttl / 3), and nothing of the limit left in Redis but keys about to expire.
    r = restartable.client()
    wait_until(lambda: r.zcard(f"{{{key}}}:holders") == 0, "no lease left", 2 * ttl)
    time.sleep(ttl / 3 + 0.2)
    for name, proc in live.items():
        stats = proc.ask({"cmd": "stats"}, "stats")["stats"]
        assert stats["fleet_in_flight"] == 0, (name, stats)
        assert stats["fleet_waiting"] == 0, (name, stats)
        assert (stats["fleet_replica_held"], stats["fleet_replica_waiting"]) == (0, 0)
        assert stats["fleet_backend_up"] == 1, (name, stats)
    assert final["c"]["fleet_outages"] <= 1, final
    assert r.zcard(f"{{{key}}}:tickets") == 0
    for name in r.scan_iter(match=f"{{{key}}}:*"):
        assert r.pttl(name) > 0, f"{name} never expires"
