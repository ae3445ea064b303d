"""Instructions per turn, for callgrind (issue 26): ``python benchmarks/turn_instructions.py
VARIANT N`` runs N turns of one variant after one warm-up turn of each.

* ``gate``: ``async with gate.admit(session_id="user-1")``, ceiling 32, empty body; with
  praisonaiagents importable the ``HUMAN_WAIT_SCOPE`` binding is active, as inside BotOS
  (``NOBINDING=1`` refuses the import first);
* ``sem``: ``async with asyncio.Semaphore(32)``, empty body;
* ``cgate`` / ``csem``: contended, 200 tasks sharing a ceiling of 32 (``overflow_policy="queue"``),
  body ``await asyncio.sleep(0)``;
* ``loop``: the loop alone.

A turn costs (instructions at N - instructions at 0) / N::

    valgrind --tool=callgrind --callgrind-out-file=cg.gate.N python benchmarks/turn_instructions.py gate 20000
    valgrind --tool=callgrind --callgrind-out-file=cg.gate.0 python benchmarks/turn_instructions.py gate 0

Instruction counts do not depend on the host's load (BENCHMARKS.md, "Where a turn's
instructions go").
"""

from __future__ import annotations

import asyncio
import os
import sys

if os.environ.get("NOBINDING"):
    sys.modules["praisonaiagents"] = None  # type: ignore[assignment]  # the import is refused

import admitgate
from admitgate._cli import OneLineParser, integer

if not os.environ.get("NOBINDING"):
    import praisonaiagents.approval.registry  # type: ignore[import-untyped]  # noqa: F401


async def run(variant: str, n: int) -> None:
    gate = admitgate.build_admission_gate(max_concurrent_runs=32, queue_depth=128)
    assert gate is not None
    sem = asyncio.Semaphore(32)
    admit = gate.admit
    # One turn of each first, so one-off costs are in the N = 0 run too.
    async with admit(session_id="user-1"):
        pass
    async with sem:
        pass
    if variant == "gate":
        for _ in range(n):
            async with admit(session_id="user-1"):
                pass
    elif variant == "sem":
        for _ in range(n):
            async with sem:
                pass
    elif variant in ("cgate", "csem"):
        contended = admitgate.build_admission_gate(
            max_concurrent_runs=32, queue_depth=100_000, overflow_policy="queue"
        )
        assert contended is not None
        shared = asyncio.Semaphore(32)

        async def worker(turns: int) -> None:
            for _ in range(turns):
                if variant == "cgate":
                    async with contended.admit(session_id="user-1"):
                        await asyncio.sleep(0)
                else:
                    async with shared:
                        await asyncio.sleep(0)

        await asyncio.gather(*(worker(n // 200) for _ in range(200)))
    else:
        for _ in range(n):
            pass


if __name__ == "__main__":
    parser = OneLineParser(description="Runs N turns of one variant, for callgrind.")
    parser.add_argument("variant", choices=["gate", "sem", "cgate", "csem", "loop"])
    parser.add_argument("n", metavar="N", type=integer(0, 100_000_000), help="turns to run")
    args = parser.parse_args()
    asyncio.run(run(args.variant, args.n))
