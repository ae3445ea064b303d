"""The fleet-wide budget's bars: ``python benchmarks/budget_fleet.py [--quick] [--json]``.

Standalone (not one of ``python -m benchmarks``' workloads): it starts its own redis-server on
a free loopback port (as ``benchmarks/fleet.py`` does) and needs admitgate. Two parts:

* **exactness**: three replica processes (``benchmarks/budget_replica.py``), 50 identities,
  each asking about every 10 ms for 10 s (~100x a limit of 2 per second fleet-wide), through a
  fleet ``RateLimit`` and, beside it, a per-pod one (each replica counting alone). Reports
  the most admissions of one identity in any 1 s window (on Redis's clock: the limit is 2),
  the admissions of both, their ratio, and what share of refusals were answered without a
  round trip (a known retry time).
* **decisions**: one process, ``C`` concurrent tasks each admitting turns of distinct
  identities through a gate with a fleet ``RateLimit`` far above the load (every turn one Lua
  call), for 5 s each: decisions per second and the p50 / p99 of a decision as the caller
  sees it (``async with gate.admit()`` entered and left).

``tests/test_budget_fleet.py`` runs the exactness part for 3 s and checks it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fleet import LocalRedis  # noqa: E402

REPLICA = Path(__file__).resolve().parent / "budget_replica.py"


def most_in_a_window(times: list[float], window: float) -> int:
    """The most admissions of one identity inside any half-open window of ``window`` s."""
    times = sorted(times)
    best = start = 0
    for end, t in enumerate(times):
        while t - times[start] >= window - 1e-6:
            start += 1
        best = max(best, end - start + 1)
    return best


def exactness(url: str, duration: float) -> dict[str, Any]:
    start_at = time.time() + 2.0
    config = {
        "url": url,
        "name": f"bench-{uuid.uuid4().hex[:8]}",
        "limit": [2, 1.0],
        "identities": 50,
        "duration": duration,
        "interval": 0.01,
        "start_at": start_at,
    }
    processes = [
        subprocess.Popen(
            [sys.executable, str(REPLICA), json.dumps({**config, "seed": i})],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    results = [
        json.loads(p.communicate(timeout=duration + 60)[0].splitlines()[-1]) for p in processes
    ]
    merged: dict[str, list[float]] = {}
    for r in results:
        for identity, times in r["fleet"].items():
            merged.setdefault(identity, []).extend(times)
    fleet = sum(len(t) for t in merged.values())
    pod = sum(sum(r["pod"].values()) for r in results)
    attempts = sum(r["attempts"] for r in results)
    limited = sum(r["refusals"].get("rate_limited", 0) for r in results)
    known = sum(r["stats"]["known_refusals"] for r in results)
    return {
        "duration_s": duration,
        "attempts": attempts,
        "offered_x_limit": round(attempts / (50 * 2 * duration), 1),
        "max_per_identity_per_window": max(most_in_a_window(t, 1.0) for t in merged.values()),
        "limit": 2,
        "fleet_admitted": fleet,
        "pod_admitted": pod,
        "pod_over_fleet": round(pod / fleet, 2),
        "refusals_answered_locally": round(known / max(limited, 1), 3),
        "slow_entries": sum(r["slow_calls"] for r in results),
        "entries": sum(r["calls"] for r in results),
    }


async def decisions(url: str, concurrency: int, seconds: float) -> dict[str, Any]:
    import admitgate

    limit = admitgate.RateLimit(
        requests="1000000/s", fleet=url, name=f"cost-{uuid.uuid4().hex[:8]}"
    )
    gate = admitgate.AdmissionGate(rate_limit=limit)
    async with gate.admit(identity="warm-up"):
        pass
    latencies: list[float] = []
    ends = time.monotonic() + seconds

    async def caller(c: int) -> None:
        i = 0
        while time.monotonic() < ends:
            i += 1
            started = time.perf_counter()
            async with gate.admit(identity=f"{c}-{i}"):
                pass
            latencies.append(time.perf_counter() - started)

    began = time.monotonic()
    await asyncio.gather(*(caller(c) for c in range(concurrency)))
    elapsed = time.monotonic() - began
    latencies.sort()
    return {
        "concurrency": concurrency,
        "decisions_per_s": round(len(latencies) / elapsed),
        "p50_us": round(statistics.median(latencies) * 1e6),
        "p99_us": round(latencies[int(len(latencies) * 0.99)] * 1e6),
        "fleet_decisions": limit.stats()["fleet_decisions"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s burst, 1 s per concurrency")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    args = parser.parse_args()
    redis = LocalRedis()
    try:
        load = os.getloadavg()[0]
        burst = exactness(redis.url, 3.0 if args.quick else 10.0)
        costs = [
            asyncio.run(decisions(redis.url, c, 1.0 if args.quick else 5.0)) for c in (1, 8, 32)
        ]
    finally:
        redis.close()
    report = {"load_1min": load, "exactness": burst, "decisions": costs}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"host load (1 min) at start: {load:.1f} on {os.cpu_count()} CPUs")
    print("exactness:", json.dumps(burst))
    for row in costs:
        print("decisions:", json.dumps(row))


if __name__ == "__main__":
    main()
