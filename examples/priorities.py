"""Priority classes: people in a chat run before a nightly batch, which keeps its share."""

import asyncio

import admitgate
from admitgate import PriorityClass


async def agent(message: str) -> str:  # stands in for your agent's run (an LLM call)
    await asyncio.sleep(0.5)
    return f"echo: {message}"


async def main() -> None:
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=4,
        queue_depth=8,
        priorities=[
            PriorityClass("interactive", min_share=0.5),  # 2 of the 4 slots guaranteed
            PriorityClass("batch", min_share=0.25),  # 1 slot guaranteed, borrows the rest
        ],
        default_priority="batch",  # a turn that names no class
    )
    started: list[str] = []

    async def handle(name: str, priority: str | None = None) -> None:
        try:
            async with gate.admit(session_id=name, priority=priority):
                started.append(name)
                await agent(name)
        except admitgate.AdmissionRejected as busy:
            print(f"{name}: refused ({busy.reason}, class {busy.priority})")

    async def until(in_flight: int, queued: int, cls: str) -> None:  # the gate shows this
        while True:
            c = gate.stats()["classes"][cls]
            if (c["in_flight"], c["queued"]) == (in_flight, queued):
                return
            await asyncio.sleep(0.005)

    # The nightly batch fills the gate and its queue ...
    batch = [asyncio.create_task(handle(f"batch-{i}")) for i in range(12)]
    await until(4, 8, "batch")
    # ... then three people write in: the full queue sheds batch waiters to make room.
    chat = [asyncio.create_task(handle(f"chat-{i}", "interactive")) for i in range(3)]
    await until(0, 3, "interactive")
    await asyncio.sleep(0)  # the shed turns print their refusal
    classes = gate.stats()["classes"]
    print(
        "in flight / queued:", {name: (c["in_flight"], c["queued"]) for name, c in classes.items()}
    )
    await asyncio.gather(*batch, *chat)
    print("the chat turns started", [started.index(f"chat-{i}") + 1 for i in range(3)], "of 12")
    print(gate.stats()["classes"])


if __name__ == "__main__":
    asyncio.run(main())
