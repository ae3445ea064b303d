"""A budget exact across the fleet: two replicas of one agent (two gates, here in one process
for the demonstration) share "5 turns per API key in any 10 seconds" on Redis, decided in one
Lua call per turn by Redis's clock. Needs a redis-server: $ADMITGATE_REDIS_URL, default
redis://127.0.0.1:6379/0."""

import asyncio
import math
import os
import uuid

from admitgate import AdmissionGate, AdmissionRejected, RateLimit

REDIS_URL = os.environ.get("ADMITGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
NAME = f"example-{uuid.uuid4().hex[:8]}"  # a fresh namespace, so reruns start empty


def replica() -> AdmissionGate:
    return AdmissionGate(
        rate_limit=RateLimit(
            requests=(5, 10.0),
            fleet=REDIS_URL,  # or a FleetLimit, whose connection it then shares
            name=NAME,  # every replica with this name on this Redis shares the budget
            on_backend_error="reject",  # while Redis is down: refuse (fleet_unavailable)
        )
    )


async def main() -> None:
    replicas = [replica(), replica()]
    admitted = 0
    refusals: list[AdmissionRejected] = []
    for i in range(12):  # 12 turns of one API key, alternating replicas
        gate = replicas[i % 2]
        try:
            async with gate.admit(identity="sk-live-1234"):  # e.g. the request's API key
                admitted += 1
        except AdmissionRejected as refusal:
            refusals.append(refusal)
    reasons = {r.reason for r in refusals}
    print(f"12 turns on two replicas: {admitted} admitted, {len(refusals)} refused {reasons}")
    print(f"the next one fits in {math.ceil(refusals[-1].retry_after)} s")  # exact, by Redis
    per_replica = [gate.stats()["rate_limits"][NAME]["allowed"] for gate in replicas]
    print(f"allowed per replica: {per_replica}")


asyncio.run(main())
