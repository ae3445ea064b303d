"""The command: sizes, the workload registry, running, reporting and the exit code.

Exit code 0 when every workload ran and every check passed, 1 when a workload raised or a
check failed (missing a performance target is reported, never an error), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

from .adaptive import bench_adaptive, bench_adaptive_cost
from .asgi_jsonrpc import bench_asgi_jsonrpc
from .asgi_parsers import bench_asgi_parsers
from .contended import bench_contended
from .harness import CheckFailed, Result, perf, print_result
from .machine import machine
from .memory import bench_memory
from .memory_aware import bench_memory_aware
from .overload import bench_overload
from .priorities import bench_priorities
from .priorities_cost import bench_priorities_cost
from .subjects import reference
from .threads import bench_threads
from .uncontended import bench_uncontended, bench_uncontended_nobinding

Workload = Callable[[dict[str, Any]], Result]

#: Every workload, in the order a full run goes through them (``--only`` takes these names).
WORKLOADS: dict[str, Workload] = {
    "uncontended": bench_uncontended,
    "uncontended-nobinding": bench_uncontended_nobinding,
    "contended": bench_contended,
    "overload": bench_overload,
    "memory": bench_memory,
    "memory-aware": bench_memory_aware,
    "threads": bench_threads,
    "adaptive": bench_adaptive,
    "adaptive-cost": bench_adaptive_cost,
    "priorities": bench_priorities,
    "priorities-cost": bench_priorities_cost,
    "asgi-parsers": bench_asgi_parsers,
    "asgi-jsonrpc": bench_asgi_jsonrpc,
}

#: Sizes of a full run and of ``--quick`` (tiny sizes, one repetition: the CI smoke test).
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "reps": 9,
        "uncontended_n": 40_000,
        "contended": (2_000, 20, 32),
        "contended_reps": 5,
        "overload_depths": (1_000, 10_000, 100_000),
        "overload_m": 20_000,
        # The reference scans its waiters on every eviction: fewer arrivals keep it short.
        "overload_m_ref": {1_000: 4_000, 10_000: 1_500, 100_000: 300},
        "overload_reps": 5,
        "memory_n": 50_000,
        "memory_reps": 3,
        "memory_modes": ("rss", "tracemalloc"),
        "threads": (4, 50, 400),
        "threads_reps": 5,
        "adaptive_phase_s": 20.0,
        "scan_bytes": 65536,
        "scan_before_reps": 3,
        "classify_calls": 20_000,
        "jsonrpc_calls": 20_000,
        "priorities_duration": 60.0,
    },
    "quick": {
        "reps": 1,
        "uncontended_n": 500,
        "contended": (100, 5, 8),
        "contended_reps": 1,
        "overload_depths": (100, 1_000),
        "overload_m": 300,
        "overload_m_ref": {100: 200, 1_000: 200},
        "overload_reps": 1,
        "memory_n": 1_000,
        "memory_reps": 1,
        "memory_modes": ("rss",),
        "threads": (4, 10, 10),
        "threads_reps": 1,
        "adaptive_phase_s": 2.0,
        "scan_bytes": 4096,
        "scan_before_reps": 1,
        "classify_calls": 200,
        "jsonrpc_calls": 200,
        "priorities_duration": 12.0,
    },
}

_REP_KEYS = ("reps", "contended_reps", "overload_reps", "memory_reps", "threads_reps")


def run_workload(name: str, workload: Workload, size: dict[str, Any]) -> Result:
    """Runs one workload; an exception becomes the result's error (its traceback on stderr).

    :class:`~benchmarks.harness.CheckFailed` becomes a failed check instead.
    """
    started = perf()
    try:
        result = workload(size)
    except CheckFailed as exc:
        result = Result(name, "stopped by a failed check", "")
        result.check("workload bookkeeping", False, str(exc))
    except Exception as exc:
        print(f"benchmark workload {name!r} raised:", file=sys.stderr)
        traceback.print_exc()
        result = Result(name, "raised an error", "")
        result.error = f"{type(exc).__name__}: {exc}"
    result.extra["seconds"] = perf() - started
    return result


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark admitgate against PraisonAI's gate, asyncio.Semaphore and the floor.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repetition")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--only", metavar="NAME", help=f"comma-separated workloads: {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--reps", type=int, help="override the repetition count")
    return parser


def main(argv: list[str] | None = None, *, prog: str = "python -m benchmarks") -> int:
    """Runs the benchmark; returns the exit code (see the module docstring)."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    names = list(WORKLOADS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in WORKLOADS]
        if unknown:
            parser.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    mode = "quick" if args.quick else "full"
    size = dict(SIZES[mode])
    if args.reps:
        for key in _REP_KEYS:
            size[key] = args.reps
    info = machine()
    if not args.json:
        print(
            f"admitgate {info['admitgate']} bench ({mode}) on "
            f"{info['cpus']} x {info['cpu']}, Python {info['python']}"
        )
        if reference() is None:
            print("note: praisonai-bot is not installed; the reference gate is skipped")
    results = []
    started = perf()
    for name in names:
        result = run_workload(name, WORKLOADS[name], size)
        results.append(result)
        if not args.json:
            print_result(result)
            sys.stdout.flush()
    errors = {r.name: r.error for r in results if r.error is not None}
    checks = [c for r in results for c in r.checks]
    failed = [f"{r.name}: {c['check']}" for r in results for c in r.failed_checks]
    ok = not errors and not failed
    if args.json:
        print(
            json.dumps(
                {
                    "machine": info,
                    "mode": mode,
                    "seconds": perf() - started,
                    "ok": ok,
                    "errors": errors,
                    "failed_checks": failed,
                    "results": [r.as_dict() for r in results],
                },
                indent=2,
            )
        )
    else:
        met = sum(t["met"] for r in results for t in r.targets)
        total = sum(len(r.targets) for r in results)
        print(f"\n{met}/{total} targets met in {perf() - started:.1f} s")
        print(f"{len(checks) - len(failed)}/{len(checks)} checks passed, {len(errors)} errors")
        for what in failed:
            print(f"FAILED check: {what}")
        for name, error in errors.items():
            print(f"ERROR in {name}: {error}")
    return 0 if ok else 1
