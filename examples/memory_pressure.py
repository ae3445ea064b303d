"""Memory-aware admission with a stand-in RSS reading: below the soft threshold turns run, above
it new turns wait while others run, at the hard threshold they are refused."""

import asyncio

import admitgate


class StandInSampler:
    """Reports whatever RSS the example sets (the built-in sampler reads this process's)."""

    def __init__(self) -> None:
        self.rss_mb = 100.0

    def read(self) -> admitgate.ResourceSample:
        return admitgate.ResourceSample(rss_mb=self.rss_mb)


async def main() -> None:
    memory = StandInSampler()
    # AdmissionGate takes the policy objects directly (build_admission_gate builds them for you).
    gate = admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=8, queue_depth=8),
        # soft threshold 0.9 x 1000 = 900 MiB, hard threshold 1000 MiB
        resource_policy=admitgate.build_memory_pressure_policy(max_rss_mb=1000),
        resource_sampler=memory,  # leave out for the built-in admitgate.RssSampler
    )

    finish = asyncio.Event()

    async def turn(name: str) -> str:
        try:
            async with gate.admit(session_id=name):
                await finish.wait()  # stands in for your agent's run
                return f"{name}: ran"
        except admitgate.AdmissionRejected as busy:
            return f"{name}: refused ({busy.reason}, retry after {busy.retry_after} s)"

    first = asyncio.create_task(turn("a"))
    await asyncio.sleep(0)  # let it start: a free slot is taken at once
    memory.rss_mb = 950  # soft pressure: newcomers wait while something runs
    second = asyncio.create_task(turn("b"))
    await asyncio.sleep(0)
    print("at 950 MiB:", gate.in_flight, "running,", gate.queued, "waiting")
    memory.rss_mb = 1000  # hard pressure: refused
    print(await turn("c"))
    memory.rss_mb = 100  # pressure gone: the waiter takes the slot freed next
    finish.set()
    print(await first, "/", await second)


if __name__ == "__main__":
    asyncio.run(main())
