"""A gate of 4 slots and a queue of 4 in front of a stand-in agent: a burst of 12 turns."""

import asyncio

import admitgate


async def agent(message: str) -> str:  # stands in for your agent's run (an LLM call)
    await asyncio.sleep(0.1)
    return f"echo: {message}"


async def main() -> None:
    gate = admitgate.build_admission_gate(max_concurrent_runs=4, queue_depth=4)

    async def handle(user_id: str, message: str) -> str:
        try:
            async with gate.admit(session_id=user_id):
                return await agent(message)
        except admitgate.AdmissionRejected as busy:
            return f"{busy.message} (reason={busy.reason})"

    replies = await asyncio.gather(*(handle(f"user-{i}", f"hi {i}") for i in range(12)))
    print("\n".join(replies))
    print(gate.stats())  # 8 admitted (4 at once, 4 after waiting), 4 rejected: queue_full


if __name__ == "__main__":
    asyncio.run(main())
