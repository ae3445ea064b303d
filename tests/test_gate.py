"""admitgate's own additions to the reference API: what a turn learns about its admission."""

from __future__ import annotations

import asyncio

import admitgate
import pytest
from conftest import run


def test_waited_tells_a_queued_turn_from_an_immediate_one():
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=4)

    async def main():
        first = gate.admit(session_id="a")
        second = gate.admit(session_id="b")
        release = asyncio.Event()
        seen = {}

        async def hold():
            async with first:
                seen["first active"] = first.active
                await release.wait()

        async def wait_turn():
            async with second:
                seen["second active"] = second.active

        holder = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(wait_turn())
        await asyncio.sleep(0)
        assert gate.queued == 1 and not second.active
        release.set()
        await asyncio.gather(holder, waiter)
        return seen, first, second

    seen, first, second = run(main())
    assert seen == {"first active": True, "second active": True}
    assert first.waited is False
    assert second.waited is True
    assert not first.active and not second.active


def test_an_admission_is_entered_once():
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)

    async def main():
        admission = gate.admit()
        async with admission:
            pass
        with pytest.raises(RuntimeError, match="already entered"):
            async with admission:
                pass

    run(main())
    assert gate.stats()["admitted"] == 1 and gate.in_flight == 0


@pytest.mark.parametrize(
    ("overflow", "expected"), [("reject", "queue_full"), ("shed_oldest", "shed")]
)
def test_rejections_say_why(overflow, expected):
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1, queue_depth=1, overflow_policy=overflow
    )

    async def main():
        release = asyncio.Event()
        reasons = []

        async def turn():
            try:
                async with gate.admit():
                    await release.wait()
            except admitgate.AdmissionRejected as rejected:
                reasons.append(rejected.reason)

        tasks = [asyncio.create_task(turn()) for _ in range(3)]
        for _ in range(5):
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*tasks)
        return reasons

    assert run(main()) == [expected]


def test_memory_pressure_rejection_says_why():
    class Sampler:
        def read(self):
            return admitgate.ResourceSample(rss_mb=2048.0)

    gate = admitgate.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=4),
        resource_policy=admitgate.build_memory_pressure_policy(1024),
        resource_sampler=Sampler(),
    )

    async def main():
        with pytest.raises(admitgate.AdmissionRejected) as info:
            async with gate.admit():
                pass
        return info.value

    rejected = run(main())
    assert rejected.reason == "memory_pressure"
    assert rejected.message == "Busy right now \u2014 please resend in a moment."


def test_from_max_rss_mb_is_the_single_knob():
    ladder = admitgate.MemoryPressurePolicy.from_max_rss_mb(1000, 0.8)
    assert (ladder.soft_rss_mb, ladder.hard_rss_mb) == (800.0, 1000.0)
    assert admitgate.MemoryPressurePolicy.from_max_rss_mb(0, 0.9) is None
    assert admitgate.MemoryPressurePolicy.from_max_rss_mb(None, 0.9) is None
    with pytest.raises(ValueError, match="soft_ratio"):
        admitgate.MemoryPressurePolicy.from_max_rss_mb(1000, float("nan"))


def test_built_in_sampler_reads_this_process():
    sampler = admitgate.RssSampler()
    sample = sampler.read()
    assert isinstance(sample, admitgate.ResourceSample)
    assert sampler.source == "live"
    assert 1.0 < sample.rss_mb < 1_000_000.0
    assert sampler.interval_seconds == pytest.approx(0.005)
