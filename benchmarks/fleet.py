"""The fleet-wide limit's cost: ``python benchmarks/fleet.py [--quick] [--json]``.

Standalone (it is not one of ``python -m benchmarks``' workloads): it starts its own
``redis-server`` (Debian's, found or installed by ``scripts/redis-server``) on a free loopback
port without persistence, and needs admitgate and redis-py. Rows:

* **admissions/s of one process** against that local Redis, turns with an empty body, one at
  a time (latency-bound) and from 32 concurrent tasks (throughput), interleaved repetitions:

  - ``gate+fleet``: ``async with gate.admit()`` of a gate built with ``fleet=FleetLimit(...)``
    (cap far above the load: every turn takes and gives back a lease);
  - ``FleetLimit``: ``await limit.acquire()`` then ``await lease.release()``, no gate;
  - ``redis-py 1 Lua``: the floor the issue sets, one Lua call per turn from redis-py's
    asyncio client equivalent to the uncontended take (server ``TIME``, prune expired
    holders, check the cap, add the lease, keep the key's expiry);
  - ``redis-py 2 Lua``: that take plus the matching release (``ZREM``), as a turn needs.

* **round trips per turn**: ``EVALSHA`` / ``EVAL`` calls the server counted
  (``INFO commandstats``) over the ``gate+fleet`` turns of one run, heartbeats included.

* **hand-off latency**: two replicas (this process and a child process), a cap of 1, each
  running turns back to back through its own gate; from the moment a turn on one replica
  leaves the gate (its lease is released) to the start of the turn waiting on the other
  (p50, p99; ``time.monotonic`` is one clock for both processes on a host).

Absolute numbers depend on the machine; the ratios of one run are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The floor's take: what the fleet's take script does for an uncontended turn (no waiting
#: tickets), written again for redis-py.
TAKE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
local ttl = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
if redis.call('PTTL', KEYS[1]) < ttl + 1000 then redis.call('PEXPIRE', KEYS[1], ttl + 1000) end
return 1
"""

#: The floor's release.
RELEASE_LUA = """
return redis.call('ZREM', KEYS[1], ARGV[1])
"""


# -- a local redis-server ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A redis-server on a free loopback port, without persistence, for this run."""

    def __init__(self) -> None:
        found = subprocess.run(
            [str(ROOT / "scripts" / "redis-server")],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        binary = found.stdout.strip().splitlines()[-1]
        self.dir = tempfile.TemporaryDirectory(prefix="admitgate-bench-redis-")
        self.port = _free_port()
        log = Path(self.dir.name) / "redis.log"
        self.process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", self.dir.name, "--logfile", str(log)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while "Ready to accept connections" not in (log.read_text() if log.exists() else ""):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        """Stops the server and removes its directory."""
        self.process.kill()
        self.process.wait(timeout=10)
        self.dir.cleanup()


# -- admissions per second -----------------------------------------------------------------


Turns = Callable[[int], Awaitable[None]]


def _variants(url: str) -> tuple[dict[str, Turns], Any, Any, str]:
    """The variants (each runs ``n`` turns one at a time), the gate and redis-py client they
    use, and the floor's key."""
    import admitgate
    import redis.asyncio as aioredis

    key = f"bench:{uuid.uuid4().hex[:8]}"
    limit = admitgate.FleetLimit(url, key, 1_000_000)
    gate = admitgate.build_admission_gate(max_concurrent_runs=1024, fleet=limit)
    assert gate is not None
    direct = admitgate.FleetLimit(url, key + ":direct", 1_000_000)
    client = aioredis.Redis.from_url(url)
    take = client.register_script(TAKE_LUA)
    release = client.register_script(RELEASE_LUA)
    floor_key = f"{{{key}:floor}}:holders"

    async def through_gate(n: int) -> None:
        admit = gate.admit
        for _ in range(n):
            async with admit():
                pass

    async def through_limit(n: int) -> None:
        for _ in range(n):
            lease = await direct.acquire()
            await lease.release()

    async def one_lua(n: int) -> None:
        for _ in range(n):
            await take(keys=[floor_key], args=[uuid.uuid4().hex, 1_000_000, 10_000])

    async def two_lua(n: int) -> None:
        for _ in range(n):
            lease = uuid.uuid4().hex
            await take(keys=[floor_key], args=[lease, 1_000_000, 10_000])
            await release(keys=[floor_key], args=[lease])

    variants: dict[str, Turns] = {
        "gate+fleet": through_gate,
        "FleetLimit": through_limit,
        "redis-py 1 Lua": one_lua,
        "redis-py 2 Lua": two_lua,
    }
    return variants, gate, client, floor_key


async def _rate(turns: Turns, n: int, tasks: int) -> float:
    """Admissions per second of ``tasks`` concurrent loops of ``n // tasks`` turns."""
    per_task = max(1, n // tasks)
    t0 = time.perf_counter()
    await asyncio.gather(*(turns(per_task) for _ in range(tasks)))
    return per_task * tasks / (time.perf_counter() - t0)


async def admissions(url: str, n: int, reps: int) -> dict[str, Any]:
    """Interleaved medians of admissions/s, one at a time and from 32 tasks."""
    variants, gate, client, floor_key = _variants(url)
    names = list(variants)
    for turns in variants.values():  # warm up: connections, scripts loaded
        await turns(50)
    out: dict[str, Any] = {}
    for label, tasks in (("sequential", 1), ("32 tasks", 32)):
        samples: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                samples[name].append(await _rate(variants[name], n, tasks))
                await client.delete(floor_key)
        out[label] = {name: statistics.median(v) for name, v in samples.items()}
    # Round trips: scripts the server ran for n gate turns, heartbeats included.
    before = await client.info("commandstats")
    t0 = time.perf_counter()
    await variants["gate+fleet"](n)
    elapsed = time.perf_counter() - t0
    after = await client.info("commandstats")

    def calls(stats: dict[str, Any], name: str) -> int:
        return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))

    scripts = sum(calls(after, c) - calls(before, c) for c in ("evalsha", "eval"))
    out["round trips per turn"] = scripts / n
    out["gate+fleet seconds per turn"] = elapsed / n
    s = gate.stats()
    out["gate counters"] = {k: s[k] for k in ("admitted", "rejected", "cancelled", "in_flight")}
    await client.aclose()
    return out


# -- hand-off latency ----------------------------------------------------------------------


async def _pingpong(url: str, key: str, n: int, go: asyncio.Event | None) -> list[list[float]]:
    """``n`` turns back to back through a gate on a fleet cap of 1: ``[start, end]`` each."""
    import admitgate

    limit = admitgate.FleetLimit(url, key, 1)
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, fleet=limit)
    assert gate is not None
    await limit.connect()
    if go is None:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    else:
        await go.wait()
    times: list[list[float]] = []
    for _ in range(n):
        async with gate.admit():
            start = time.monotonic()
            await asyncio.sleep(0.002)
            times.append([start, time.monotonic()])
    return times


def handoff(url: str, n: int) -> dict[str, float]:
    """p50 / p99 of release-to-start across two replicas (this process and a child)."""
    key = f"bench:pingpong:{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen(
        [sys.executable, __file__, "--pingpong-child", url, key, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        raise RuntimeError("the ping-pong child did not start")

    async def here() -> list[list[float]]:
        go = asyncio.Event()
        task = asyncio.ensure_future(_pingpong(url, key, n, go))
        await asyncio.sleep(0.2)  # connected and subscribed
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        go.set()
        return await task

    mine = asyncio.run(here())
    theirs = json.loads(child.stdout.read())
    child.wait(timeout=60)
    turns = sorted([(s, e, "here") for s, e in mine] + [(s, e, "child") for s, e in theirs])
    lags = [
        b[0] - a[1]
        for a, b in zip(turns, turns[1:], strict=False)
        if a[2] != b[2] and b[0] >= a[1]  # a hand-off between replicas
    ]
    lags.sort()
    return {
        "hand-offs": len(lags),
        "p50 ms": 1000 * lags[len(lags) // 2],
        "p99 ms": 1000 * lags[min(len(lags) - 1, int(len(lags) * 0.99))],
    }


# -- the command ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Runs the rows and prints them (``--json``: as JSON)."""
    parser = argparse.ArgumentParser(prog="python benchmarks/fleet.py", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer turns and repetitions")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--pingpong-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pingpong_child:
        url, key, n = args.pingpong_child
        print(json.dumps(asyncio.run(_pingpong(url, key, int(n), None))), flush=True)
        return 0
    n, reps, handoffs = (400, 3, 200) if args.quick else (2000, 5, 1000)
    server = LocalRedis()
    try:
        results: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}}
        results["admissions/s"] = asyncio.run(admissions(server.url, n, reps))
        results["hand-off"] = handoff(server.url, handoffs)
    finally:
        server.close()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    rates = results["admissions/s"]
    print(f"admissions/s, one process, local redis-server ({n} turns x {reps} reps, medians)")
    for label in ("sequential", "32 tasks"):
        row = rates[label]
        floor = row["redis-py 1 Lua"]
        print(f"  {label}:")
        for name, value in row.items():
            print(f"    {name:16} {value:10,.0f}/s  {value / floor:5.2f}x the 1-Lua floor")
    print(f"round trips per gate+fleet turn: {rates['round trips per turn']:.3f}")
    print(f"gate counters after the run: {rates['gate counters']}")
    h = results["hand-off"]
    print(
        f"hand-off between two replicas: p50 {h['p50 ms']:.2f} ms, p99 {h['p99 ms']:.2f} ms "
        f"({h['hand-offs']} hand-offs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
