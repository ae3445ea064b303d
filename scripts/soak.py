#!/usr/bin/env python3
"""Soak test: many turns, several threads each with its own event loop, shared gates.

Every thread runs an asyncio event loop with a pool of workers; each worker sends turns
through gates shared by all threads: one gate per overflow policy (``reject``, ``queue``,
``shed_oldest``), each with the per-scope limit off and on. Turns mostly do
``await asyncio.sleep(0)``; some sleep a little longer (so queues form), some raise inside
the body, some are cancelled (``task.cancel()``) and some run under ``asyncio.wait_for`` with
a timeout short enough to fire while they wait or run.

At the end, for every gate:

* ``in_flight == queued == awaiting_human == 0`` and nobody waits (``oldest_wait_seconds``);
* ``admitted + rejected + shed + cancelled`` equals the turns that reached the gate (counted
  here, just before ``async with gate.admit(...)``);
* ``admitted`` equals the bodies that started, ``rejected`` the rejections callers saw, and
  callers saw at most ``shed`` evictions (one evicted while being cancelled sees the cancel);
* ``peak_in_flight`` and the concurrency measured inside the bodies never passed the ceiling,
  nor a tenant's measured concurrency its sub-limit;
* the process's RSS, sampled every 0.25 s from ``/proc/self/statm`` (``ru_maxrss`` elsewhere),
  stayed under ``--rss-bound-mb`` and grew by less than ``--rss-growth-mb`` after warm-up
  (the first 10% of turns).

Prints a summary (``--json`` for one JSON object) and exits 1 on any violation, 2 if the
gates wedge (no turn completes for ``--stall-seconds``).

    python scripts/soak.py                    # 1,000,000 turns, 4 threads
    python scripts/soak.py --turns 20000 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import admitgate

OVERFLOW_POLICIES = ("reject", "queue", "shed_oldest")
TENANTS = ("", "noisy", "noisy", "noisy", "t1", "t2", "t3", "t4", "t5")
WORKERS_PER_THREAD = 48
CEILING = 4
DEPTH = 3
PER_SCOPE = 2


class Boom(Exception):
    """Raised inside a body on purpose."""


@dataclass
class GateUnderTest:
    name: str
    gate: Any
    ceiling: int
    per_scope: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: int = 0
    peak_running: int = 0
    scope_running: Counter = field(default_factory=Counter)
    peak_scope_running: int = 0


def build_gates() -> list[GateUnderTest]:
    gates = []
    for overflow in OVERFLOW_POLICIES:
        for per_scope in (0, PER_SCOPE):
            gate = admitgate.build_admission_gate(
                max_concurrent_runs=CEILING,
                queue_depth=DEPTH,
                overflow_policy=overflow,
                max_concurrent_runs_per_scope=per_scope,
            )
            name = f"{overflow}/per_scope={per_scope}"
            gates.append(GateUnderTest(name, gate, CEILING, per_scope))
    return gates


@dataclass
class Tally:
    """What one thread saw, per gate index."""

    reached: Counter = field(default_factory=Counter)
    entered: Counter = field(default_factory=Counter)
    rejected_seen: Counter = field(default_factory=Counter)
    shed_seen: Counter = field(default_factory=Counter)
    raised: int = 0
    cancels: int = 0
    timeouts: int = 0
    done: int = 0


def rss_mb() -> float:
    """Current resident set size in MiB (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


async def one_turn(g: GateUnderTest, gi: int, session: str, tally: Tally, body: str, sleeps: int):
    tally.reached[gi] += 1  # nothing can interrupt between this and __aenter__
    try:
        async with g.gate.admit(session_id=session):
            tally.entered[gi] += 1
            scoped = g.per_scope > 0 and session != ""
            with g.lock:
                g.running += 1
                g.peak_running = max(g.peak_running, g.running)
                if scoped:
                    g.scope_running[session] += 1
                    g.peak_scope_running = max(g.peak_scope_running, g.scope_running[session])
            try:
                for _ in range(sleeps):
                    await asyncio.sleep(0)
                if body == "raise":
                    raise Boom()
            finally:
                with g.lock:
                    g.running -= 1
                    if scoped:
                        g.scope_running[session] -= 1
                        if not g.scope_running[session]:
                            del g.scope_running[session]
    except admitgate.AdmissionRejected as exc:
        if exc.reason == "shed":
            tally.shed_seen[gi] += 1
        else:
            tally.rejected_seen[gi] += 1
    except Boom:
        tally.raised += 1


async def worker(gates, rng: random.Random, n: int, tally: Tally) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(n):
        gi = rng.randrange(len(gates))
        g = gates[gi]
        session = rng.choice(TENANTS)
        r = rng.random()
        sleeps = 1 if r < 0.7 else rng.randrange(0, 6)
        body = "raise" if rng.random() < 0.05 else "ok"
        kind = rng.random()
        try:
            if kind < 0.90:
                await one_turn(g, gi, session, tally, body, sleeps)
            elif kind < 0.95:
                task = loop.create_task(one_turn(g, gi, session, tally, body, sleeps + 2))
                for _ in range(rng.randrange(0, 4)):
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    tally.cancels += 1
            else:
                try:
                    await asyncio.wait_for(
                        one_turn(g, gi, session, tally, body, sleeps + 2),
                        timeout=rng.choice((1e-5, 1e-4, 1e-3)),
                    )
                except asyncio.TimeoutError:
                    tally.timeouts += 1
        finally:
            tally.done += 1


def thread_main(gates, seed: int, n: int, tally: Tally, errors: list) -> None:
    rng = random.Random(seed)
    per_worker = [n // WORKERS_PER_THREAD] * WORKERS_PER_THREAD
    for i in range(n % WORKERS_PER_THREAD):
        per_worker[i] += 1

    async def run() -> None:
        await asyncio.gather(
            *(worker(gates, random.Random(rng.random()), k, tally) for k in per_worker)
        )

    try:
        asyncio.run(run())
    except BaseException as exc:  # reported as a violation, never swallowed
        errors.append(f"thread {seed}: {exc!r}")


def run_soak(
    turns: int = 1_000_000,
    threads: int = 4,
    seed: int | None = None,
    rss_bound_mb: float = 256.0,
    rss_growth_mb: float = 32.0,
    stall_seconds: float = 30.0,
    progress: bool = False,
) -> dict:
    """Runs the soak and returns a summary; ``summary["violations"]`` lists what failed."""
    if seed is None:
        seed = random.randrange(2**32)
    gates = build_gates()
    tallies = [Tally() for _ in range(threads)]
    errors: list[str] = []
    shares = [turns // threads + (1 if i < turns % threads else 0) for i in range(threads)]
    rss_start = rss_mb()
    rss_peak = rss_start
    rss_after_warmup = None
    started = time.monotonic()
    workers = [
        threading.Thread(
            target=thread_main,
            args=(gates, seed * 1000 + i, shares[i], tallies[i], errors),
            name=f"soak-{i}",
            daemon=True,
        )
        for i in range(threads)
    ]
    for t in workers:
        t.start()
    wedged = False
    last_done, last_progress, last_print = -1, time.monotonic(), time.monotonic()
    while any(t.is_alive() for t in workers):
        for t in workers:
            t.join(0.25)
        rss_now = rss_mb()
        rss_peak = max(rss_peak, rss_now)
        done = sum(t.done for t in tallies)
        if rss_after_warmup is None and done >= turns // 10:
            rss_after_warmup = rss_now
        now = time.monotonic()
        if done != last_done:
            last_done, last_progress = done, now
        elif now - last_progress > stall_seconds:
            wedged = True
            break
        if progress and now - last_print >= 5:
            last_print = now
            print(
                f"  {done:>9,} turns  {done / (now - started):>8,.0f}/s  rss {rss_now:.0f} MiB",
                file=sys.stderr,
                flush=True,
            )
    elapsed = time.monotonic() - started
    rss_end = rss_mb()
    rss_peak = max(rss_peak, rss_end)
    if rss_after_warmup is None:
        rss_after_warmup = rss_start

    violations: list[str] = list(errors)
    if wedged:
        violations.append(f"wedged: no turn completed for {stall_seconds}s")
    per_gate = []
    totals = Counter()
    for gi, g in enumerate(gates):
        s = g.gate.stats()
        reached = sum(t.reached[gi] for t in tallies)
        entered = sum(t.entered[gi] for t in tallies)
        rejected_seen = sum(t.rejected_seen[gi] for t in tallies)
        shed_seen = sum(t.shed_seen[gi] for t in tallies)
        row = {
            "gate": g.name,
            "reached": reached,
            "admitted": s["admitted"],
            "rejected": s["rejected"],
            "shed": s["shed"],
            "cancelled": s["cancelled"],
            "peak_in_flight": g.gate.peak_in_flight,
            "peak_in_body": g.peak_running,
            "peak_tenant_in_body": g.peak_scope_running,
        }
        per_gate.append(row)
        for key in ("reached", "admitted", "rejected", "shed", "cancelled"):
            totals[key] += row[key]

        def check(ok: bool, what: str, g=g) -> None:
            if not ok:
                violations.append(f"{g.name}: {what}")

        if not wedged:
            check(
                (s["in_flight"], s["queued"], s["awaiting_human"]) == (0, 0, 0),
                f"not drained: in_flight={s['in_flight']} queued={s['queued']} "
                f"awaiting_human={s['awaiting_human']}",
            )
            check(g.gate.oldest_wait_seconds is None, "a waiter is still recorded")
            total = s["admitted"] + s["rejected"] + s["shed"] + s["cancelled"]
            check(
                total == reached, f"admitted+rejected+shed+cancelled={total} != reached={reached}"
            )
            check(s["admitted"] == entered, f"admitted={s['admitted']} != bodies entered={entered}")
            check(
                s["rejected"] == rejected_seen,
                f"rejected={s['rejected']} != rejections seen={rejected_seen}",
            )
            check(shed_seen <= s["shed"], f"callers saw {shed_seen} evictions > shed={s['shed']}")
        check(
            g.gate.peak_in_flight <= g.ceiling,
            f"peak_in_flight={g.gate.peak_in_flight} > ceiling={g.ceiling}",
        )
        check(g.peak_running <= g.ceiling, f"{g.peak_running} bodies ran at once > {g.ceiling}")
        if g.per_scope:
            check(
                g.peak_scope_running <= g.per_scope,
                f"a tenant ran {g.peak_scope_running} at once > {g.per_scope}",
            )
    turns_done = sum(t.done for t in tallies)
    if not wedged and turns_done != turns:
        violations.append(f"{turns_done} turns finished, expected {turns}")
    if rss_peak > rss_bound_mb:
        violations.append(f"RSS peaked at {rss_peak:.1f} MiB > bound {rss_bound_mb} MiB")
    growth = rss_end - rss_after_warmup
    if growth > rss_growth_mb:
        violations.append(f"RSS grew {growth:.1f} MiB after warm-up > {rss_growth_mb} MiB")
    return {
        "turns": turns,
        "threads": threads,
        "seed": seed,
        "seconds": round(elapsed, 2),
        "turns_per_second": round(turns_done / elapsed) if elapsed else None,
        "totals": dict(totals),
        "raised": sum(t.raised for t in tallies),
        "task_cancels": sum(t.cancels for t in tallies),
        "timeouts": sum(t.timeouts for t in tallies),
        "gates": per_gate,
        "rss_mb": {
            "start": round(rss_start, 1),
            "after_warmup": round(rss_after_warmup, 1),
            "end": round(rss_end, 1),
            "peak": round(rss_peak, 1),
            "bound": rss_bound_mb,
            "growth_bound": rss_growth_mb,
        },
        "violations": violations,
        "wedged": wedged,
    }


def print_summary(summary: dict) -> None:
    print(
        f"soak: {summary['turns']:,} turns, {summary['threads']} threads, seed {summary['seed']}, "
        f"{summary['seconds']} s ({summary['turns_per_second']:,}/s)"
    )
    t = summary["totals"]
    print(
        f"  reached {t['reached']:,}  admitted {t['admitted']:,}  rejected {t['rejected']:,}  "
        f"shed {t['shed']:,}  cancelled {t['cancelled']:,}  | body raised {summary['raised']:,}  "
        f"task.cancel {summary['task_cancels']:,}  wait_for timeouts {summary['timeouts']:,}"
    )
    print(
        f"  {'gate':<26}{'reached':>9}{'admitted':>10}{'rejected':>10}{'shed':>8}"
        f"{'cancelled':>10}{'peak':>6}{'body':>6}{'tenant':>7}"
    )
    for row in summary["gates"]:
        print(
            f"  {row['gate']:<26}{row['reached']:>9,}{row['admitted']:>10,}{row['rejected']:>10,}"
            f"{row['shed']:>8,}{row['cancelled']:>10,}{row['peak_in_flight']:>6}"
            f"{row['peak_in_body']:>6}{row['peak_tenant_in_body']:>7}"
        )
    r = summary["rss_mb"]
    print(
        f"  RSS MiB: start {r['start']}, after warm-up {r['after_warmup']}, end {r['end']}, "
        f"peak {r['peak']} (bound {r['bound']}, growth bound {r['growth_bound']})"
    )
    if summary["violations"]:
        print("VIOLATIONS:")
        for v in summary["violations"]:
            print(f"  - {v}")
    else:
        print("OK: every invariant held")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=1_000_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--rss-bound-mb",
        type=float,
        default=256.0,
        help="the process's RSS must stay below this (MiB)",
    )
    parser.add_argument(
        "--rss-growth-mb",
        type=float,
        default=32.0,
        help="RSS may grow at most this much after warm-up (MiB)",
    )
    parser.add_argument("--stall-seconds", type=float, default=30.0)
    parser.add_argument("--progress", action="store_true", help="report progress on stderr")
    args = parser.parse_args(argv)
    if args.turns < 0 or args.threads < 1:
        parser.error("--turns must be >= 0 and --threads >= 1")
    summary = run_soak(
        turns=args.turns,
        threads=args.threads,
        seed=args.seed,
        rss_bound_mb=args.rss_bound_mb,
        rss_growth_mb=args.rss_growth_mb,
        stall_seconds=args.stall_seconds,
        progress=args.progress,
    )
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    if summary["wedged"]:
        sys.stdout.flush()
        os._exit(2)  # the worker threads are stuck; do not wait for them
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
