"""The wait of a turn for its budgets (``rate_limit=``), on the event loop.

``Admission.__aenter__`` decides every local budget at once, in Rust; only a turn that must
wait for its budget (``on_limit="wait"``) or ask Redis (a fleet-wide budget) comes here. The
rules (which budget, what is given back, how long a wait may be) are the Rust side's; this
coroutine only sleeps and awaits, so the event loop is never blocked.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def enter(admission: Any, step: Any) -> Any:
    """Waits for the turn's budgets, then enters the gate; returns the turn.

    ``step`` is what the budgets ask next: seconds to sleep, or an awaitable of the fleet's
    answer. A refusal is raised by ``admission._budget_step``; cancelled or failing here, the
    turn gives back what it reserved.
    """
    try:
        while step is not None:
            if isinstance(step, float):
                await asyncio.sleep(step)
                step = admission._budget_step()
            else:
                step = admission._budget_step(await step)
    except BaseException:
        # ``step`` may hold a fleet answer that landed as the turn was cancelled.
        admission._budget_abandon(None if isinstance(step, float) else step)
        raise
    return await admission._enter_gate()
