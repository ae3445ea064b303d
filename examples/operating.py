"""Operating a gate: queue wait timeouts, place in line, the sync API from a worker thread,
live reconfiguration, the per-tenant view and a drain on shutdown."""

import asyncio
import time

import admitgate


async def agent(message: str) -> str:  # stands in for your agent's run
    await asyncio.sleep(0.2)
    return f"echo: {message}"


def agent_sync(message: str) -> str:  # the same, for code that runs on a worker thread
    time.sleep(0.05)
    return f"echo: {message}"


async def main() -> None:
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=2,
        queue_depth=8,
        max_concurrent_runs_per_scope=2,
        queue_timeout_s=5,  # refuse a turn after 5 s of waiting (reason "timeout")
    )
    assert gate is not None

    async def handle(user_id: str, message: str) -> str:
        def tell(position: int, estimated_wait_s: float | None) -> None:  # once, if it waits
            # None before the gate has any history; tiny while it has only just filled up.
            eta = f", about {estimated_wait_s:.0f} s" if (estimated_wait_s or 0) >= 1 else ""
            print(f"  {user_id}: you are #{position + 1} in line{eta}")

        try:
            async with gate.admit(session_id=user_id, on_queued=tell):
                return await agent(message)
        except admitgate.AdmissionRejected as busy:
            return f"refused: {busy.reason}"

    turns = [asyncio.create_task(handle(f"tenant-{i % 2}", f"turn {i}")) for i in range(6)]
    await asyncio.sleep(0)  # every turn reaches the gate
    print("tenant-0:", gate.scope_stats()["tenant-0"])  # one per-tenant entry of every tenant

    # Live: raising the ceiling starts waiting turns at once; returns the waiters it refused.
    gate.reconfigure(max_concurrent_runs=4, max_concurrent_runs_per_scope=2)
    print("after reconfigure:", gate.in_flight, "in flight,", gate.queued, "queued")

    # The sync API shares slots and FIFO order with async turns; use it from worker threads.
    def worker() -> str:
        with gate.admit_sync(session_id="batch-job", timeout=5):
            return agent_sync("from a thread")

    print("sync turn:", await asyncio.to_thread(worker))
    print("replies:", await asyncio.gather(*turns))

    # Shutdown: stop admitting, refuse queued turns, wait for running ones (never cancelled).
    running = asyncio.create_task(handle("tenant-0", "last"))
    await asyncio.sleep(0)  # it starts
    report = await gate.close(drain_timeout=15)
    print("drain:", report)
    print("after close:", await running, "/", await handle("tenant-1", "too late"))


if __name__ == "__main__":
    asyncio.run(main())
