"""Overload control (docs/overload.md): a gate that learns the provider's real concurrency,
serves a standing queue newest first, and refuses turns whose caller's deadline cannot be met.

The provider here runs 3 calls at once and answers 429 beyond, as an LLM provider out of
concurrency does; in real code `RateLimitError` is your LLM client's (openai.RateLimitError).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

from admitgate import AdaptiveLimit, AdmissionRejected, build_admission_gate


class RateLimitError(Exception):
    """What an LLM client raises when the provider answers 429."""


class Provider:
    """A provider of `capacity` concurrent calls of 20 ms; one more is refused at once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.running = 0
        self.calls = 0
        self.refused = 0

    async def call(self) -> str:
        self.calls += 1
        if self.running >= self.capacity:
            self.refused += 1
            raise RateLimitError("429 Too Many Requests")
        self.running += 1
        try:
            await asyncio.sleep(0.02)
            return "reply"
        finally:
            self.running -= 1


async def main() -> None:
    provider = Provider(capacity=3)
    gate = build_admission_gate(
        max_concurrent_runs=64,  # with adaptive=: the most the gate will ever allow
        queue_depth=128,
        overflow_policy="reject",
        adaptive=AdaptiveLimit(throttle_on=(RateLimitError,)),
        queue_discipline="adaptive",  # "fifo" (default) | "adaptive"
    )
    assert gate is not None

    async def call_llm(remaining: float) -> str:
        try:
            async with gate.admit(session_id="user", deadline_s=remaining) as turn:
                # A throttle_on exception leaving the block is a 429; an app that turns the
                # provider's 429 into its own answer says so: turn.report_throttled(...).
                assert turn is not None
                return await provider.call()
        except AdmissionRejected as refused:
            return refused.reason  # the gate's own refusal: timeout, deadline, queue_full
        except RateLimitError:
            return "429"

    outcomes: Counter[str] = Counter()
    for _ in range(40):
        outcomes.update(await asyncio.gather(*(call_llm(remaining=1.0) for _ in range(8))))
    print(f"learned ceiling: {gate.limit} (the provider runs {provider.capacity})")
    print(f"provider 429s: {provider.refused} of {provider.calls} calls")
    print(f"turns answered: {outcomes['reply']} of {sum(outcomes.values())}")
    # A caller with 5 ms left while a turn takes ~20 ms is refused at once (504), not queued.
    async with contextlib.AsyncExitStack() as running:
        for _ in range(gate.limit):
            await running.enter_async_context(gate.admit())
        print("with every slot taken, 5 ms left:", await call_llm(remaining=0.005))


asyncio.run(main())
