"""A simulated LLM provider for the overload-control tests: ``capacity`` concurrent calls
(across every gate that calls it), one more refused at once with :class:`RateLimited`, as a
provider answers 429 beyond its concurrency."""

from __future__ import annotations

import asyncio


class RateLimited(Exception):
    """What an LLM SDK raises for a 429 (openai.RateLimitError in real code)."""


class Provider:
    """A provider of ``capacity`` concurrent calls of ``service_s`` each; one more is refused
    at once."""

    def __init__(self, capacity: int, service_s: float = 0.01) -> None:
        self.capacity = capacity
        self.service_s = service_s
        self.active = 0
        self.calls = 0
        self.refused = 0

    async def call(self) -> None:
        self.calls += 1
        if self.active >= self.capacity:
            self.refused += 1
            raise RateLimited
        self.active += 1
        try:
            await asyncio.sleep(self.service_s)
        finally:
            self.active -= 1
