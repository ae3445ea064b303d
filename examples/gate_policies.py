"""The production-shaped gate: a ceiling, a queue, an overflow policy, per-tenant limits and
memory-aware admission. One noisy tenant bursts 40 turns while three quiet ones send one each."""

import asyncio

import admitgate


async def agent(message: str) -> str:  # stands in for your agent's run
    await asyncio.sleep(0.05)
    return f"echo: {message}"


async def main() -> None:
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=32,  # ceiling on concurrent runs (0: no gate)
        queue_depth=128,  # turns that may wait for a slot
        overflow_policy="reject",  # reject | queue | shed_oldest
        max_concurrent_runs_per_scope=4,  # per-tenant ceiling within the global one (0: off)
        resource_policy=admitgate.build_memory_pressure_policy(max_rss_mb=1024),  # optional
    )
    # build_admission_gate returns None when nothing is configured: every turn runs at once.
    assert gate is not None

    async def handle(user_id: str, message: str) -> str:
        try:
            async with gate.admit(session_id=user_id):
                return await agent(message)
        except admitgate.AdmissionRejected as busy:
            return busy.message  # "Busy right now — please resend in a moment."

    noisy = [handle("noisy", f"burst {i}") for i in range(40)]
    quiet = [handle(f"quiet-{i}", "hello") for i in range(3)]
    burst = asyncio.gather(*noisy, *quiet)
    await asyncio.sleep(0)  # every turn reaches the gate: admitted at once, or queued
    # The noisy tenant runs 4 turns and waits in its own lane; the quiet ones ran at once.
    print("while the burst runs:", gate.scope_stats()["noisy"], "peak", gate.peak_in_flight)
    await burst

    stats = gate.stats()
    print("stats:", stats)
    # Once nothing waits, the counters add up to the turns that reached the gate.
    assert stats["admitted"] + stats["rejected"] + stats["shed"] + stats["cancelled"] == 43
    print("queue waits:", gate.queue_wait_stats()["count"], "turns waited")
    print("per transport:", gate.transport_stats()["direct"]["admitted"], "direct turns admitted")


if __name__ == "__main__":
    asyncio.run(main())
