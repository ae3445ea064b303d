"""A fleet-wide limit on Redis: two gates (two replicas of one agent, here in one process for
the demonstration) share one in-flight cap of 3, though each has a local ceiling of 8.
Needs a redis-server: $ADMITGATE_REDIS_URL, default redis://127.0.0.1:6379/0."""

import asyncio
import os

from admitgate import AdmissionGate, FleetLimit, build_admission_gate

REDIS_URL = os.environ.get("ADMITGATE_REDIS_URL", "redis://127.0.0.1:6379/0")


def replica(name: str) -> AdmissionGate:
    gate = build_admission_gate(
        max_concurrent_runs=8,  # this replica's own ceiling (CPU, memory), as before
        queue_depth=64,
        overflow_policy="reject",
        max_concurrent_runs_per_scope=4,  # a tenant's slice on this replica
        queue_timeout_s=30,  # bounds the whole wait: local queue and lease
        fleet=FleetLimit(
            REDIS_URL,  # rediss://:password@host:6380/0 for TLS; the password is never shown
            "example:coordinator",  # every replica with this key on this Redis shares the cap
            max_in_flight=3,  # the cap for the whole fleet
            lease_ttl_s=10.0,
            on_backend_error="local",  # while Redis is down: each replica's local ceiling
            replica_id=name,
        ),
    )
    assert gate is not None
    return gate


async def main() -> None:
    replicas = [replica("replica-a"), replica("replica-b")]
    await replicas[0].fleet.connect()  # raises ConnectionError (without the password) if down
    running = peak = 0

    async def turn(gate: AdmissionGate, user_id: str) -> None:
        nonlocal running, peak
        async with gate.admit(session_id=user_id):  # unchanged
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.05)  # stands in for your agent's run
            running -= 1

    await asyncio.gather(*(turn(g, f"user-{i}") for g in replicas for i in range(10)))
    print(f"20 turns on two replicas, at most {peak} at once (fleet cap 3)")
    stats = replicas[0].stats()
    print({k: stats[k] for k in ("fleet_max_in_flight", "fleet_backend_up", "fleet_lease_lost")})
    for gate in replicas:
        await gate.close()
        await gate.fleet.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
