"""One replica of an agent for the fleet budget tests and benchmark: a process whose gate has a
fleet-wide ``RateLimit`` on a shared redis-server and, beside it, a per-pod one (the LiteLLM
pattern: each pod counts alone).

Run as ``python budget_replica.py '<json config>'`` with ``{"url", "name", "limit": [N, T],
"identities": 50, "duration": 3.0, "interval": 0.015, "start_at": <time.time()>,
"on_backend_error": "local", "seed": 1, "fleet_limit": {FleetLimit keyword arguments}}``
(with ``fleet_limit`` the budget shares a ``FleetLimit``'s connection and its timeouts). From ``start_at`` on, each identity asks for a turn
every ``interval`` seconds (jittered) for ``duration`` seconds, through both gates. It then
writes one JSON line on stdout:

``{"fleet": {identity: [Redis decision times, s]}, "fleet_local": {identity: [[before, after],
...]}, "pod": {identity: admitted}, "refusals": {reason: n}, "attempts": n, "max_lag": s,
"stats": {...}}``: ``fleet`` has the admissions Redis decided (its clock), ``fleet_local`` the
ones decided without it (Redis down, ``on_backend_error="local"``/``"allow"``) as
``time.time()`` spans; ``max_lag`` is the longest the event loop was late for a 1 ms tick
(the host's scheduling included); ``calls``, ``slow_calls`` (over 5 ms) and ``max_call`` time
the synchronous part of entering a turn, what admitgate itself holds the loop for.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any

import admitgate


async def main(config: dict[str, Any]) -> None:
    n, window = config["limit"]
    # A FleetLimit's connection, with its timeouts, when given; else the budget's own URL.
    fleet: Any = config["url"]
    if config.get("fleet_limit"):
        fleet = admitgate.FleetLimit(config["url"], **config["fleet_limit"])
    fleet_limit = admitgate.RateLimit(
        requests=(n, window),
        fleet=fleet,
        name=config["name"],
        on_backend_error=config.get("on_backend_error", "local"),
    )
    fleet_gate = admitgate.AdmissionGate(rate_limit=fleet_limit)
    pod_gate = admitgate.AdmissionGate(rate_limit=admitgate.RateLimit(requests=(n, window)))
    identities = [f"user-{i}" for i in range(config["identities"])]
    admitted: dict[str, list[float]] = {i: [] for i in identities}
    fleet_local: dict[str, list[list[float]]] = {i: [] for i in identities}
    pod: dict[str, int] = dict.fromkeys(identities, 0)
    refusals: dict[str, int] = {}
    attempts = 0
    calls: list[float] = []
    rng = random.Random(config.get("seed", 0))
    interval = config["interval"]
    duration = config["duration"]
    await asyncio.sleep(max(0.0, config["start_at"] - time.time()))
    ends = time.monotonic() + duration
    max_lag = 0.0
    running = True

    async def ticker() -> None:
        nonlocal max_lag
        while running:
            before = time.monotonic()
            await asyncio.sleep(0.001)
            max_lag = max(max_lag, time.monotonic() - before - 0.001)

    async def client(identity: str) -> None:
        nonlocal attempts
        await asyncio.sleep(rng.uniform(0, interval))
        while time.monotonic() < ends:
            attempts += 1
            before = time.time()
            admission = fleet_gate.admit(identity=identity)
            try:
                # The synchronous part of entering, timed: what the event loop spends in it.
                called = time.perf_counter()
                try:
                    entering = admission.__aenter__()
                finally:
                    calls.append(time.perf_counter() - called)
                turn = await entering
                assert turn is not None  # the turn is yielded on every gate
                server = turn._budget_server_time
                if server is None:
                    fleet_local[identity].append([before, time.time()])
                else:
                    admitted[identity].append(server)
                await admission.__aexit__(None, None, None)
            except admitgate.AdmissionRejected as refusal:
                reason = refusal.reason or "?"
                refusals[reason] = refusals.get(reason, 0) + 1
            try:
                async with pod_gate.admit(identity=identity):
                    pod[identity] += 1
            except admitgate.AdmissionRejected:
                pass
            await asyncio.sleep(interval * rng.uniform(0.5, 1.5))

    tick = asyncio.ensure_future(ticker())
    await asyncio.gather(*(client(i) for i in identities))
    running = False
    await tick
    print(
        json.dumps(
            {
                "fleet": admitted,
                "fleet_local": fleet_local,
                "pod": pod,
                "refusals": refusals,
                "attempts": attempts,
                "max_lag": max_lag,
                "calls": len(calls),
                "slow_calls": sum(1 for c in calls if c > 0.005),
                "max_call": max(calls, default=0.0),
                "stats": fleet_limit.stats(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
