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

``--rounds N`` repeats the decisions; ``--baseline-python PY`` measures them also with another
interpreter's admitgate (another build, in a venv of its own), alternating round by round on
the same redis-server, and prints the medians of both.

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
    fleet_decisions = limit.stats()["fleet_decisions"]
    if fleet_decisions < len(latencies):
        # Redis did not decide them all (unreachable, or answering late): what was timed is
        # the fallback's decisions, not the fleet's.
        raise SystemExit(
            f"budget_fleet.py: only {fleet_decisions} of {len(latencies)} decisions at "
            f"{concurrency} callers reached Redis; is it reachable and idle?"
        )
    return {
        "concurrency": concurrency,
        "decisions_per_s": round(len(latencies) / elapsed),
        "p50_us": round(statistics.median(latencies) * 1e6),
        "p99_us": round(latencies[int(len(latencies) * 0.99)] * 1e6),
        "fleet_decisions": fleet_decisions,
    }


def decisions_elsewhere(python: str, url: str, seconds: float) -> list[dict[str, Any]]:
    """The decisions part run by another interpreter (another build of admitgate) on ``url``."""
    command = [python, str(Path(__file__).resolve()), "--decisions-only", "--json"]
    command += ["--redis-url", url, "--decision-ms", str(round(seconds * 1000))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{python}: the baseline run failed: {done.stderr.strip()[-400:]}")
    return list(json.loads(done.stdout)["decisions"][0]["rows"])


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        key: statistics.median(r[key] for r in rows)
        for key in ("decisions_per_s", "p50_us", "p99_us")
    }


def main() -> None:
    from admitgate._cli import OneLineParser, integer

    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s burst, 1 s per concurrency")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    parser.add_argument(
        "--rounds", type=integer(1, 20), default=1, help="decision rounds (default 1)"
    )
    parser.add_argument(
        "--baseline-python",
        metavar="PYTHON",
        help="also measure decisions with this interpreter's admitgate (another build), "
        "alternating with this one round by round",
    )
    parser.add_argument("--decisions-only", action="store_true", help="skip the exactness burst")
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    # For --baseline-python's child run: how long each concurrency is measured.
    parser.add_argument("--decision-ms", type=integer(100, 600_000), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_python is not None and not os.access(args.baseline_python, os.X_OK):
        parser.error(f"argument --baseline-python: not an executable: {args.baseline_python!r}")
    if args.redis_url is not None:
        import admitgate

        try:  # admitgate's own check of the URL (a password in it never shown)
            admitgate.RateLimit(requests="1/s", fleet=args.redis_url)
        except (TypeError, ValueError) as error:
            parser.error(f"argument --redis-url: {error}")
    seconds = args.decision_ms / 1000 if args.decision_ms else (1.0 if args.quick else 5.0)
    redis = None if args.redis_url else LocalRedis()
    url = args.redis_url or redis.url  # type: ignore[union-attr]
    load = os.getloadavg()[0]
    burst = None
    rounds: list[dict[str, Any]] = []
    try:
        if not args.decisions_only:
            burst = exactness(url, 3.0 if args.quick else 10.0)
        for number in range(args.rounds):
            builds = [("this", None)]
            if args.baseline_python:
                # Alternate which build goes first, so neither always runs on a warmer host.
                builds.insert(number % 2, ("baseline", args.baseline_python))
            for build, python in builds:
                rows = (
                    [asyncio.run(decisions(url, c, seconds)) for c in (1, 8, 32)]
                    if python is None
                    else decisions_elsewhere(python, url, seconds)
                )
                rounds.append({"round": number + 1, "build": build, "rows": rows})
    finally:
        if redis is not None:
            redis.close()
    report: dict[str, Any] = {"load_1min": load, "exactness": burst, "decisions": rounds}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"host load (1 min) at start: {load:.1f} on {os.cpu_count()} CPUs")
    if burst is not None:
        print("exactness:", json.dumps(burst))
    for entry in rounds:
        for row in entry["rows"]:
            print(f"decisions, round {entry['round']}, {entry['build']}:", json.dumps(row))
    if args.rounds > 1 or args.baseline_python:
        for build in sorted({e["build"] for e in rounds}):
            for i, concurrency in enumerate((1, 8, 32)):
                rows = [e["rows"][i] for e in rounds if e["build"] == build]
                print(f"median of {len(rows)}, {build}, {concurrency} callers:", median_row(rows))
    print(f"host load (1 min) at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
