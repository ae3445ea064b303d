"""admitgate as PraisonAI BotOS's gate: one call before BotOS is built. Turns go through
praisonai-bot's own session manager with a stand-in agent (no LLM, no network)."""

import asyncio
import threading

import admitgate
import admitgate.praisonai

admitgate.praisonai.install()  # before you build BotOS; nothing else changes

from praisonai_bot.bots._session import BotSessionManager  # noqa: E402
from praisonai_bot.bots.botos import BotOS  # noqa: E402


class StandInAgent:
    """What praisonai-bot needs from an agent: a chat history and chat()."""

    answer_now = threading.Event()  # the example says when the "model" answers

    def __init__(self) -> None:
        self.chat_history: list[dict[str, str]] = []

    def chat(self, prompt: str) -> str:  # praisonai-bot runs it on a worker thread
        self.answer_now.wait(timeout=10)  # stands in for the model's answer
        return f"answer to {prompt}"


async def main() -> None:
    bot = BotOS(
        max_concurrent_runs=4, queue_depth=8, overflow_policy="reject",
        max_concurrent_runs_per_scope=2,
    )  # fmt: skip
    gate = bot._admission_gate
    print("BotOS's gate:", type(gate).__module__, type(gate).__name__)
    # How BotOS runs a turn: its session manager admits it through the gate.
    manager = BotSessionManager(admission_gate=gate, platform="example")
    # One agent per turn: the manager runs one turn at a time per agent object.
    turns = [manager.chat(StandInAgent(), "alice", f"question {i}") for i in range(5)]
    turns.append(manager.chat(StandInAgent(), "bob", "hello"))
    burst = asyncio.gather(*turns)
    while gate.in_flight + gate.queued < 6:  # until the six turns have reached the gate
        await asyncio.sleep(0.01)
    tenants = gate.scope_stats()
    print("alice runs at most 2 at once:", tenants["alice"], "bob:", tenants["bob"])
    StandInAgent.answer_now.set()
    replies = await burst
    print(replies[-1])
    print(bot.admission_stats)  # the reference's keys, plus "cancelled"


if __name__ == "__main__":
    asyncio.run(main())
