"""``admitgate.praisonai.install(priorities=..., priority_of=...)`` in a real PraisonAI BotOS
(praisonai-bot 0.1.16): the gate BotOS builds has the classes, and each turn's class comes
from its BotOS session (its user's storage key),
through the real ``BotSessionManager.chat``. No network, no LLM: stand-in agents.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import admitgate
import pytest
from admitgate._priority_door import defaulted
from conftest import run
from praisonai_bot.bots._session import BotSessionManager
from praisonai_bot.bots.botos import BotOS

pytestmark = pytest.mark.timeout(10)

BUSY = "Busy right now — please resend in a moment."
CLASSES = [admitgate.PriorityClass("ops", min_share=0.5), admitgate.PriorityClass("community")]


@pytest.fixture(autouse=True)
def _uninstall() -> Any:
    yield
    import admitgate.praisonai

    admitgate.praisonai.uninstall()


class Board:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.running = 0
        self.peak = 0
        self.go = threading.Event()


class StandIn:
    """What ``BotSessionManager.chat`` needs of an agent (one per turn)."""

    def __init__(self, board: Board) -> None:
        self.chat_history: list[Any] = []
        self.board = board

    def chat(self, prompt: str) -> str:
        with self.board.lock:
            self.board.started.append(prompt)
            self.board.running += 1
            self.board.peak = max(self.board.peak, self.board.running)
        try:
            self.board.go.wait(3)
            return f"answer to {prompt}"
        finally:
            with self.board.lock:
                self.board.running -= 1


def channel_class(session_id: str) -> str | None:
    """The on-call team's users (``oncall-*``) are ``ops``; every other session names none.
    ``BotSessionManager.chat`` admits a turn under its user's storage key (the user id here:
    no identity resolver, no route profile), whatever chat it came from."""
    return "ops" if session_id.startswith("oncall-") else None


async def until(predicate: Any, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def test_a_sessions_turns_run_first_and_a_refusal_names_its_class() -> None:
    import admitgate.praisonai

    admitgate.praisonai.install(priorities=CLASSES, priority_of=channel_class)
    gate = BotOS(max_concurrent_runs=2, queue_depth=2, overflow_policy="reject")._admission_gate
    assert isinstance(gate, admitgate.AdmissionGate)
    assert set(gate.stats()["classes"]) == {"ops", "community"}
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()

    async def scenario() -> list[str]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=16))

        def turn(user: str, prompt: str, chat: str) -> Any:
            return asyncio.create_task(manager.chat(StandIn(board), user, prompt, chat_id=chat))

        turns = [turn(f"u{i}", f"c{i}", f"lounge{i}") for i in range(4)]
        await until(lambda: gate.stats()["queued"] == 2)
        ops = turn("oncall-alice", "ops1", "ops")
        try:
            # The queue is full of community turns: the ops turn sheds the oldest of them.
            await until(lambda: gate.stats()["shed"] == 1)
            refused = turn("u9", "c9", "lounge9")
            assert await refused == BUSY
        finally:
            board.go.set()
        return await asyncio.gather(*turns, ops)

    results = run(scenario(), timeout=None)
    assert results.count(BUSY) == 1 and "answer to ops1" in results
    # The ops turn started before the community turn still waiting when it came.
    assert board.started.index("ops1") < board.started.index("c3")
    assert board.peak <= 2
    classes = gate.stats()["classes"]
    assert classes["ops"]["admitted"] == 1
    assert classes["community"]["shed"] == 1 and classes["community"]["rejected"] == 1
    assert defaulted(gate)["missing"] == 5


def test_install_checks_its_priority_arguments() -> None:
    import admitgate.praisonai

    with pytest.raises(ValueError, match="priority_of needs priorities"):
        admitgate.praisonai.install(priority_of=channel_class)
    with pytest.raises(TypeError, match="priority_of must be None or a callable"):
        admitgate.praisonai.install(priorities=CLASSES, priority_of="ops")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="default_priority 'x' is not a priority class"):
        admitgate.praisonai.install(priorities=CLASSES, default_priority="x")
    assert not admitgate.praisonai.is_installed()
    # Without classes, install() builds plain gates as before.
    admitgate.praisonai.install()
    assert "classes" not in BotOS(max_concurrent_runs=2)._admission_gate.stats()
