"""``python -m admitgate demo``: a simulated multi-tenant burst through a production-shaped gate.

One noisy tenant bursts far more turns than its share while a dozen quiet tenants chat
normally. The gate is configured like PraisonAI's "multi-tenant fair-share" example
(ceiling 32, queue depth 128, overflow ``reject``, 4 runs per tenant). Agent turns are
simulated with sleeps, so the demo needs no network and no model.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

from . import AdmissionRejected, build_admission_gate
from ._cli import OneLineParser, integer


@dataclass
class TenantLog:
    turns: int = 0
    admitted: int = 0
    waited: int = 0
    rejected: int = 0
    running: int = 0
    peak_running: int = 0
    waits_ms: list[float] = field(default_factory=list)


async def _run(seed: int, noisy_burst: int, quiet_tenants: int, quiet_turns: int, out) -> dict:
    rng = random.Random(seed)
    gate = build_admission_gate(
        max_concurrent_runs=32,
        queue_depth=128,
        overflow_policy="reject",
        max_concurrent_runs_per_scope=4,
    )
    assert gate is not None
    logs: dict[str, TenantLog] = defaultdict(TenantLog)

    async def turn(tenant: str) -> None:
        log = logs[tenant]
        log.turns += 1
        arrived = time.perf_counter()
        admission = gate.admit(session_id=tenant)
        try:
            async with admission:
                log.admitted += 1
                log.waits_ms.append((time.perf_counter() - arrived) * 1000)
                log.waited += admission.waited
                log.running += 1
                log.peak_running = max(log.peak_running, log.running)
                try:
                    await asyncio.sleep(rng.uniform(0.02, 0.12))  # the simulated agent run
                finally:
                    log.running -= 1
        except AdmissionRejected:
            log.rejected += 1

    async def quiet(tenant: str) -> None:
        for _ in range(quiet_turns):
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            await turn(tenant)

    async def live_view(stop: asyncio.Event) -> None:
        started = time.perf_counter()
        print(
            f"{'t(s)':>5} {'in_flight':>9} {'queued':>6} {'admitted':>8} {'rejected':>8}  noisy running",
            file=out,
        )
        while not stop.is_set():
            s = gate.stats()
            print(
                f"{time.perf_counter() - started:5.2f} {s['in_flight']:9d} {s['queued']:6d} "
                f"{s['admitted']:8d} {s['rejected']:8d}  {logs['noisy'].running}",
                file=out,
            )
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass

    stop = asyncio.Event()
    viewer = asyncio.create_task(live_view(stop))
    tasks = [asyncio.create_task(quiet(f"quiet-{i:02d}")) for i in range(quiet_tenants)]
    await asyncio.sleep(0.1)
    tasks += [asyncio.create_task(turn("noisy")) for _ in range(noisy_burst)]
    await asyncio.gather(*tasks)
    stop.set()
    await viewer

    print(file=out)
    print(
        f"{'tenant':<10} {'turns':>5} {'admitted':>8} {'queued':>6} {'rejected':>8} {'peak':>4} {'p50 wait ms':>11}",
        file=out,
    )
    for tenant in sorted(logs, key=lambda t: (t != "noisy", t)):
        log = logs[tenant]
        p50 = statistics.median(log.waits_ms) if log.waits_ms else 0.0
        print(
            f"{tenant:<10} {log.turns:5d} {log.admitted:8d} {log.waited:6d} {log.rejected:8d} "
            f"{log.peak_running:4d} {p50:11.1f}",
            file=out,
        )
    stats = gate.stats()
    print(file=out)
    print("gate.stats():", stats, file=out)
    print(file=out)
    for line in reading(logs):
        print(line, file=out)
    return {"stats": stats, "tenants": {k: vars(v) for k, v in logs.items()}}


def reading(logs: dict[str, TenantLog]) -> list[str]:
    """Two lines that say what the run showed, from its own figures."""
    noisy = logs["noisy"]
    quiet = [log for tenant, log in logs.items() if tenant != "noisy"]
    quiet_turns = sum(log.turns for log in quiet)
    quiet_refused = sum(log.rejected for log in quiet)
    quiet_waits = [ms for log in quiet for ms in log.waits_ms]
    quiet_p50 = statistics.median(quiet_waits) if quiet_waits else 0.0
    first = (
        f"Reading: the noisy tenant sent {noisy.turns} turns at once but never ran more than "
        f"{noisy.peak_running} at a time; {noisy.waited} waited in its own lane and "
        f"{noisy.rejected} were refused with a busy reply."
    )
    if quiet_refused:
        second = (
            f"The {len(quiet)} quiet tenants lost {quiet_refused} of {quiet_turns} turns: the "
            "burst was large enough to fill the shared queue too."
        )
    else:
        second = (
            f"Meanwhile all {quiet_turns} turns of the {len(quiet)} quiet tenants were admitted "
            f"(median wait {quiet_p50:.1f} ms): one tenant's burst did not starve the others."
        )
    return [first, second]


def main(argv: list[str] | None = None, out=None) -> dict:
    """Run the demo; returns the final stats and per-tenant figures."""
    import sys

    parser = OneLineParser(
        prog="python -m admitgate demo",
        description="A simulated multi-tenant burst through a production-shaped gate: one noisy "
        "tenant bursts far more turns than its share while quiet tenants chat normally. The gate "
        "is configured like PraisonAI's multi-tenant fair-share example (ceiling 32, queue depth "
        "128, overflow reject, 4 runs per tenant). Agent turns are simulated with sleeps: no "
        "network, no model. Takes a few seconds.",
    )
    parser.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    parser.add_argument(
        "--noisy-burst",
        type=integer(1, 10_000),
        default=150,
        metavar="N",
        help="turns the noisy tenant sends at once, 1 to 10000 (default 150)",
    )
    parser.add_argument(
        "--quiet-tenants",
        type=integer(1, 1_000),
        default=12,
        metavar="N",
        help="how many quiet tenants, 1 to 1000 (default 12)",
    )
    parser.add_argument(
        "--quiet-turns",
        type=integer(1, 100),
        default=5,
        metavar="N",
        help="turns each quiet tenant sends, 1 to 100 (default 5)",
    )
    args = parser.parse_args(argv)
    print(
        "admitgate demo: ceiling 32, queue depth 128, overflow reject, 4 runs per tenant;\n"
        f"one noisy tenant bursts {args.noisy_burst} turns while {args.quiet_tenants} quiet tenants "
        f"send {args.quiet_turns} each.\n",
        file=out or sys.stdout,
    )
    return asyncio.run(
        _run(args.seed, args.noisy_burst, args.quiet_tenants, args.quiet_turns, out or sys.stdout)
    )
