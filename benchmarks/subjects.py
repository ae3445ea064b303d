"""What the workloads measure: admitgate's gate, the reference gate, the floor, turn shapes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import admitgate


def build(**config: Any) -> admitgate.AdmissionGate:
    """``admitgate.build_admission_gate`` for a configuration that always builds a gate."""
    gate = admitgate.build_admission_gate(**config)
    if gate is None:
        raise ValueError(f"no gate for {config!r}: the workload needs a ceiling")
    return gate


def reference() -> Any | None:
    """PraisonAI BotOS's gate module (``praisonai_bot.bots._admission``), or None."""
    try:
        from praisonai_bot.bots import _admission  # type: ignore[import-untyped]
    except ImportError:
        return None
    return _admission


def binding_active() -> bool:
    """Whether admitgate binds praisonaiagents' ``HUMAN_WAIT_SCOPE`` (it is importable)."""
    try:
        import praisonaiagents.approval.registry  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return True


class EmptyCM:
    """The floor: an async context manager that does nothing."""

    __slots__ = ()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


async def park(enter: Callable[[], Any], release: asyncio.Future[None]) -> None:
    """A turn that holds its slot until ``release`` resolves."""
    async with enter():
        await release


async def arrival(enter: Callable[[], Any], rejected: tuple[type[BaseException], ...]) -> None:
    """A turn with an empty body; being turned away (``rejected``) is a normal outcome."""
    try:
        async with enter():
            pass
    except rejected:
        pass
