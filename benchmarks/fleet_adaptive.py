"""The fleet's learned limit: ``python benchmarks/fleet_adaptive.py [--quick] [--json]``.

Standalone, like ``benchmarks/fleet.py`` (whose local redis-server it uses). Two parts:

* **Three replicas in front of one provider** of capacity C = 12 concurrent calls of 20 ms
  (one more is refused at once with the throttle exception), each replica offering 16 turns
  at a time, retried 5 ms after a refusal, for ``--seconds``:

  - ``fleet-wide``: ``build_admission_gate(fleet=..., adaptive=...)``: one learned limit;
  - ``per replica``: what the same three replicas did before (each gate learns its own
    ceiling, the fleet lease only caps the sum), emulated with a gate built with
    ``adaptive=`` alone whose turns take a lease of the same fleet inside their block.

  Rows: successful calls per second (the physical limit is C / 20 ms = 600/s), provider 429s as
  a share of calls over the whole run and over its second half, and the limits learned at the
  end (the fleet's, or each replica's).

* **Per-turn cost with nothing to learn** (a cap and a provider far above the load, empty
  turns), interleaved repetitions: admissions/s one at a time and from 32 tasks of a gate with
  ``fleet=`` and of one with ``fleet=`` and ``adaptive=``, and the script calls the server ran
  per turn (``INFO commandstats``, heartbeats and learned-limit changes included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fleet import LocalRedis  # noqa: E402

CAPACITY = 12
SERVICE_S = 0.02


class RateLimited(Exception):
    """The provider's 429."""


class Provider:
    """``capacity`` concurrent calls across every replica; one more is refused at once."""

    def __init__(self) -> None:
        self.active = 0
        self.calls = 0
        self.refused = 0
        self.served = 0

    async def call(self) -> None:
        self.calls += 1
        if self.active >= CAPACITY:
            self.refused += 1
            raise RateLimited
        self.active += 1
        try:
            await asyncio.sleep(SERVICE_S)
            self.served += 1
        finally:
            self.active -= 1


async def _replicas_run(url: str, fleet_wide: bool, seconds: float) -> dict[str, Any]:
    import admitgate

    key = f"bench-learn:{uuid.uuid4().hex[:8]}"
    provider = Provider()
    limits = [admitgate.FleetLimit(url, key, 64, replica_id=f"r{i}") for i in range(3)]
    adaptive = admitgate.AdaptiveLimit(throttle_on=(RateLimited,))
    gates = [
        admitgate.AdmissionGate(
            admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=64, queue_depth=256),
            adaptive=adaptive,
            fleet=limit if fleet_wide else None,
        )
        for limit in limits
    ]
    stopped = False

    async def turn(gate: Any, limit: Any) -> None:
        while not stopped:
            try:
                async with gate.admit():
                    if fleet_wide:
                        await provider.call()
                    else:
                        lease = await limit.acquire()
                        try:
                            await provider.call()
                        finally:
                            await lease.release()
            except (RateLimited, admitgate.AdmissionRejected):
                await asyncio.sleep(0.005)

    tasks = [
        asyncio.ensure_future(turn(gate, limit))
        for gate, limit in zip(gates, limits, strict=True)
        for _ in range(16)
    ]
    await asyncio.sleep(seconds / 2)
    half = (provider.calls, provider.refused, provider.served)
    await asyncio.sleep(seconds / 2)
    calls, refused, served = provider.calls, provider.refused, provider.served
    learned = sorted(gate.limit for gate in gates)
    stopped = True
    await asyncio.gather(*tasks)
    for limit in limits:
        await limit.shutdown()
    return {
        "served/s": served / seconds,
        "429 share": refused / max(calls, 1),
        "429 share, 2nd half": (refused - half[1]) / max(calls - half[0], 1),
        "served/s, 2nd half": (served - half[2]) / (seconds / 2),
        "limits at the end": learned,
    }


async def _rate(gate: Any, n: int, tasks: int) -> float:
    async def one(k: int) -> None:
        for _ in range(k):
            async with gate.admit():
                pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one(n // tasks) for _ in range(tasks)))
    return (n // tasks) * tasks / (time.perf_counter() - t0)


async def _cost(url: str, n: int, reps: int) -> dict[str, Any]:
    import admitgate
    import redis.asyncio as aioredis

    policy = admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=1024, queue_depth=1024)
    limits = {
        name: admitgate.FleetLimit(url, f"bench-{name}:{uuid.uuid4().hex[:8]}", 100_000)
        for name in ("fleet", "fleet+adaptive")
    }
    gates = {
        "fleet": admitgate.AdmissionGate(policy, fleet=limits["fleet"]),
        "fleet+adaptive": admitgate.AdmissionGate(
            policy,
            fleet=limits["fleet+adaptive"],
            adaptive=admitgate.AdaptiveLimit(throttle_on=(RateLimited,)),
        ),
    }
    names = list(gates)
    for gate in gates.values():
        await _rate(gate, 200, 32)  # warm up (and let the adaptive one grow to its ceiling)
    out: dict[str, Any] = {}
    for label, tasks in (("sequential", 1), ("32 tasks", 32)):
        samples: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps):
            for name in names[rep % 2 :] + names[: rep % 2]:
                samples[name].append(await _rate(gates[name], n, tasks))
        out[label] = {name: statistics.median(v) for name, v in samples.items()}
    client = aioredis.Redis.from_url(url)

    def calls(stats: dict[str, Any]) -> int:
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))

    for name, gate in gates.items():
        for tasks in (1, 32):
            before = calls(await client.info("commandstats"))
            await _rate(gate, n, tasks)
            after = calls(await client.info("commandstats"))
            out[f"scripts per turn, {name}, {tasks} task(s)"] = (after - before) / n
        out[f"limit, {name}"] = gate.limit
    await client.aclose()
    for limit in limits.values():
        await limit.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/fleet_adaptive.py", description=__doc__
    )
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--seconds", type=float, default=None, help="each replica run's length")
    args = parser.parse_args(argv)
    seconds = args.seconds or (3.0 if args.quick else 8.0)
    n, reps = (500, 3) if args.quick else (2000, 5)
    redis = LocalRedis()
    try:
        results: dict[str, Any] = {}
        for name, fleet_wide in (("fleet-wide", True), ("per replica", False)):
            results[name] = asyncio.run(_replicas_run(redis.url, fleet_wide, seconds))
        results["cost"] = asyncio.run(_cost(redis.url, n, reps))
    finally:
        redis.close()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"three replicas, provider of {CAPACITY} x {SERVICE_S * 1000:.0f} ms, {seconds:.0f} s:")
    for name in ("fleet-wide", "per replica"):
        r = results[name]
        print(
            f"  {name:12} {r['served/s']:6.0f}/s served ({r['served/s, 2nd half']:4.0f}/s 2nd half)"
            f"  429s {r['429 share']:6.1%} ({r['429 share, 2nd half']:5.1%} 2nd half)"
            f"  limits {r['limits at the end']}"
        )
    cost = results["cost"]
    for label in ("sequential", "32 tasks"):
        row = cost[label]
        print(
            f"  {label}: fleet {row['fleet']:,.0f}/s, fleet+adaptive {row['fleet+adaptive']:,.0f}/s"
            f" ({row['fleet+adaptive'] / row['fleet']:.2f}x)"
        )
    for key, value in cost.items():
        if key.startswith(("scripts", "limit")):
            print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
