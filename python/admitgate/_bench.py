"""The admitgate benchmark: ``python -m admitgate bench [--quick] [--json] [--only NAME,...]``.

Every workload runs, in one process and interleaved (A B C, B C A, C A B, ...), on:

* ``admitgate``: this package;
* ``reference``: PraisonAI BotOS's pure-Python gate (``praisonai_bot.bots._admission``),
  when it is installed;
* ``semaphore``: a bare :class:`asyncio.Semaphore` where the workload makes sense for one;
* ``floor``: the same work with nothing in the way (an empty async context manager, a task
  that does nothing, a task rejected at once).

Each variant is measured over several repetitions; the tables show medians and the ratios
of medians. Absolute times are noise on a shared machine; the ratios of one run are the
result. The garbage collector is paused inside timed regions (and collected between them) so
that a collection triggered by one variant's garbage is not charged to another.

Workloads (``--only`` takes these names, comma separated):

``uncontended``
    ``async with gate.admit(session_id=...)`` with a free slot and an empty body, with
    praisonaiagents importable (its ``HUMAN_WAIT_SCOPE`` context variable is bound on every
    admission, as inside BotOS).
``uncontended-nobinding``
    The same in a child process where praisonaiagents cannot be imported (an import blocker
    on ``sys.meta_path`` installed before admitgate is imported); reported back as JSON.
``contended``
    2,000 tasks x 20 turns, body ``await asyncio.sleep(0)``, ceiling 32, ``overflow="queue"``.
``overload``
    Sustained overload under ``shed_oldest`` with a full queue of 1k / 10k / 100k waiters:
    every arrival evicts the oldest waiter. Cost per arrival above the floor (the same
    arrivals as tasks that are rejected at once), per depth, next to a pure-Python O(1)
    FIFO (what waking a long-parked task costs whatever the gate).
``memory``
    Bytes per queued waiter beyond a bare suspended task, from the RSS growth of a fresh
    child process over N waiters (and, separately, from tracemalloc, which sees Python
    allocations only: admitgate's Rust-side records are invisible to it).
``memory-aware``
    Uncontended turns with memory-aware admission on (``max_rss_mb`` huge, built-in
    sampler) against the same gate without it.
``threads``
    4 threads, each with its own event loop, sharing one gate, against one thread alone:
    total turns per second, and exact counters, with free slots and with a contended ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import admitgate

perf = time.perf_counter

WORKLOADS = (
    "uncontended",
    "uncontended-nobinding",
    "contended",
    "overload",
    "memory",
    "memory-aware",
    "threads",
)

# Sizes: (full, quick).
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
    },
}


# --------------------------------------------------------------------------------------
# Shared helpers


def _build(**config: Any) -> admitgate.AdmissionGate:
    """``admitgate.build_admission_gate`` for a configuration that always builds a gate."""
    gate = admitgate.build_admission_gate(**config)
    assert gate is not None
    return gate


def _reference() -> Any | None:
    """PraisonAI's gate module, or None when it is not installed."""
    try:
        from praisonai_bot.bots import _admission  # type: ignore[import-untyped]
    except ImportError:
        return None
    return _admission


def _binding_active() -> bool:
    try:
        import praisonaiagents.approval.registry  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return True


class _EmptyCM:
    """The floor: an async context manager that does nothing."""

    __slots__ = ()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Timed:
    """Pauses the garbage collector for one timed region."""

    def __enter__(self) -> _Timed:
        gc.collect()
        self._was = gc.isenabled()
        gc.disable()
        self.t0 = perf()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = perf() - self.t0
        if self._was:
            gc.enable()


def _rotations(names: list[str], reps: int) -> list[list[str]]:
    """Interleaved order: each repetition runs every variant once, rotated by one."""
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(reps)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


class Result:
    """One workload's figures: rows of samples, ratios, and targets."""

    def __init__(self, name: str, title: str, unit: str) -> None:
        self.name = name
        self.title = title
        self.unit = unit  # "us" (samples in seconds, shown in microseconds), "B", "turns/s", ...
        self.rows: dict[str, list[float]] = {}
        self.ratios: dict[str, float] = {}
        self.targets: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}

    def median(self, variant: str) -> float:
        return _median(self.rows.get(variant, []))

    def ratio(self, label: str, a: str, b: str) -> float:
        value = _ratio(self.median(a), self.median(b))
        self.ratios[label] = value
        return value

    def target(self, what: str, value: float, limit: float, *, at_least: bool = False) -> None:
        met = value >= limit if at_least else value <= limit
        self.targets.append(
            {"target": what, "value": value, "limit": limit, "at_least": at_least, "met": met}
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "unit": self.unit,
            "medians": {k: self.median(k) for k in self.rows},
            "samples": self.rows,
            "ratios": self.ratios,
            "targets": self.targets,
            "notes": self.notes,
            **({"extra": self.extra} if self.extra else {}),
        }


def _show(value: float, unit: str) -> str:
    if value != value:  # NaN
        return "n/a"
    if unit == "us":
        return f"{value * 1e6:10.3f} us"
    if unit == "B":
        return f"{value:10.0f} B"
    if unit == "turns/s":
        return f"{value:10.0f} turns/s"
    return f"{value:10.4g} {unit}"


def _print(result: Result) -> None:
    print(f"\n== {result.name}: {result.title}")
    width = max((len(k) for k in result.rows), default=8)
    for variant, samples in result.rows.items():
        spread = ""
        if len(samples) > 1:
            spread = f"   (min {_show(min(samples), result.unit).strip()}, n={len(samples)})"
        print(f"  {variant:<{width}}  {_show(_median(samples), result.unit)}{spread}")
    for label, value in result.ratios.items():
        print(f"  {label:<{width + 14}} {value:8.3f}x")
    for t in result.targets:
        rel = ">=" if t["at_least"] else "<="
        mark = "MET " if t["met"] else "MISS"
        print(f"  [{mark}] {t['target']}: {t['value']:.3f} ({rel} {t['limit']})")
    for note in result.notes:
        print(f"  note: {note}")


# --------------------------------------------------------------------------------------
# Workload: uncontended


async def _uncontended_gate(gate: Any, n: int) -> float:
    admit = gate.admit
    with _Timed() as t:
        for _ in range(n):
            async with admit(session_id="user-1"):
                pass
    return t.elapsed / n


async def _uncontended_sem(sem: asyncio.Semaphore, n: int) -> float:
    with _Timed() as t:
        for _ in range(n):
            async with sem:
                pass
    return t.elapsed / n


async def _uncontended_floor(n: int) -> float:
    cm = _EmptyCM()
    with _Timed() as t:
        for _ in range(n):
            async with cm:
                pass
    return t.elapsed / n


async def _uncontended_floor_new(n: int) -> float:
    with _Timed() as t:
        for _ in range(n):
            async with _EmptyCM():
                pass
    return t.elapsed / n


def _interleave(
    loop: asyncio.AbstractEventLoop,
    variants: dict[str, Callable[[], Awaitable[float]]],
    reps: int,
    result: Result,
    *,
    warmup: bool = True,
) -> None:
    if warmup:
        for run in variants.values():
            loop.run_until_complete(run())
    for order in _rotations(list(variants), reps):
        for name in order:
            result.rows.setdefault(name, []).append(loop.run_until_complete(variants[name]()))
    # Keep the declared order in the table (after rows of earlier calls).
    result.rows = {
        **{k: v for k, v in result.rows.items() if k not in variants},
        **{name: result.rows[name] for name in variants},
    }


def _uncontended_variants(
    n: int, with_reference: bool
) -> dict[str, Callable[[], Awaitable[float]]]:
    gate = _build(max_concurrent_runs=32, queue_depth=128)
    sem = asyncio.Semaphore(32)
    variants: dict[str, Callable[[], Awaitable[float]]] = {
        "admitgate": lambda: _uncontended_gate(gate, n),
    }
    ref = _reference() if with_reference else None
    if ref is not None:
        rgate = ref.build_admission_gate(max_concurrent_runs=32, queue_depth=128)
        variants["reference"] = lambda: _uncontended_gate(rgate, n)
    variants["semaphore"] = lambda: _uncontended_sem(sem, n)
    variants["floor"] = lambda: _uncontended_floor(n)
    variants["floor (new cm per turn)"] = lambda: _uncontended_floor_new(n)
    return variants


def _uncontended_result(result: Result, nobinding: bool) -> Result:
    result.ratio("admitgate/semaphore", "admitgate", "semaphore")
    result.ratio("admitgate/floor", "admitgate", "floor")
    if "reference" in result.rows:
        result.ratio("admitgate/reference", "admitgate", "reference")
        result.ratio("reference/semaphore", "reference", "semaphore")
    result.target("admitgate/semaphore", result.ratios["admitgate/semaphore"], 1.0)
    if nobinding:
        result.target("admitgate/floor", result.ratios["admitgate/floor"], 1.5)
    return result


def bench_uncontended(size: dict[str, Any]) -> Result:
    active = _binding_active()
    result = Result(
        "uncontended",
        "async with gate.admit() with a free slot, empty body, per turn"
        + (" (HUMAN_WAIT_SCOPE binding active)" if active else " (praisonaiagents NOT importable)"),
        "us",
    )
    loop = asyncio.new_event_loop()
    try:
        _interleave(loop, _uncontended_variants(size["uncontended_n"], True), size["reps"], result)
    finally:
        loop.close()
    return _uncontended_result(result, nobinding=not active)


_BLOCKER = """
import sys
class _NoPraisonAI:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('praisonaiagents', 'praisonai_bot', 'praisonai'):
            raise ModuleNotFoundError('blocked by the admitgate benchmark: ' + name, name=name)
        return None
sys.meta_path.insert(0, _NoPraisonAI())
"""


def _child(args: list[str], *, block_praisonai: bool) -> Any:
    """Runs ``_child_main(args)`` in a fresh interpreter and returns its JSON answer."""
    boot = (_BLOCKER if block_praisonai else "") + (
        "import sys, json\n"
        "from admitgate._bench import _child_main\n"
        "print(json.dumps(_child_main(sys.argv[1:])), flush=True)\n"
        # Skip the teardown of thousands of parked tasks: only the answer matters.
        "import os; os._exit(0)\n"
    )
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(admitgate.__file__)))
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", boot, *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {args} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child_main(args: list[str]) -> Any:
    kind = args[0]
    if kind == "uncontended":
        try:
            import praisonaiagents  # type: ignore[import-untyped]  # noqa: F401
        except ImportError:
            pass
        else:  # pragma: no cover - the blocker failed
            raise RuntimeError("praisonaiagents is importable in the no-binding child")
        n, reps = int(args[1]), int(args[2])
        result = Result("", "", "us")
        loop = asyncio.new_event_loop()
        try:
            _interleave(loop, _uncontended_variants(n, False), reps, result)
        finally:
            loop.close()
        return result.rows
    if kind == "memory":
        return _memory_child(args[1], int(args[2]), args[3])
    raise ValueError(kind)


def bench_uncontended_nobinding(size: dict[str, Any]) -> Result:
    result = Result(
        "uncontended-nobinding",
        "as uncontended, in a child where praisonaiagents cannot be imported (no binding)",
        "us",
    )
    result.rows = _child(
        ["uncontended", str(size["uncontended_n"]), str(size["reps"])], block_praisonai=True
    )
    result.notes.append("the reference needs praisonaiagents, so it cannot run here")
    return _uncontended_result(result, nobinding=True)


# --------------------------------------------------------------------------------------
# Workload: contended


async def _contended_run(enter: Callable[[], Any] | None, tasks: int, turns: int) -> float:
    sleep = asyncio.sleep

    if enter is None:

        async def worker() -> None:
            for _ in range(turns):
                await sleep(0)

    else:

        async def worker() -> None:
            for _ in range(turns):
                async with enter():
                    await sleep(0)

    with _Timed() as t:
        await asyncio.gather(*[worker() for _ in range(tasks)])
    return t.elapsed / (tasks * turns)


def bench_contended(size: dict[str, Any]) -> Result:
    tasks, turns, ceiling = size["contended"]
    result = Result(
        "contended",
        f"{tasks} tasks x {turns} turns, body await asyncio.sleep(0), ceiling {ceiling}, "
        "overflow queue; time per turn",
        "us",
    )
    gate = _build(max_concurrent_runs=ceiling, queue_depth=tasks, overflow_policy="queue")
    sem = asyncio.Semaphore(ceiling)
    variants: dict[str, Callable[[], Awaitable[float]]] = {
        "admitgate": lambda: _contended_run(lambda: gate.admit(session_id="s"), tasks, turns),
    }
    ref = _reference()
    if ref is not None:
        rgate = ref.build_admission_gate(
            max_concurrent_runs=ceiling, queue_depth=tasks, overflow_policy="queue"
        )
        variants["reference"] = lambda: _contended_run(
            lambda: rgate.admit(session_id="s"), tasks, turns
        )
    variants["semaphore"] = lambda: _contended_run(lambda: sem, tasks, turns)
    variants["floor (no gate)"] = lambda: _contended_run(None, tasks, turns)
    loop = asyncio.new_event_loop()
    try:
        _interleave(loop, variants, size["contended_reps"], result)
    finally:
        loop.close()
    stats = gate.stats()
    runs = (size["contended_reps"] + 1) * tasks * turns
    exact = (
        stats["admitted"] == runs
        and stats["in_flight"] == 0
        and stats["queued"] == 0
        and stats["rejected"] == stats["shed"] == stats["cancelled"] == 0
    )
    result.extra["admitgate_counters_exact"] = exact
    result.extra["admitgate_peak_in_flight"] = gate.peak_in_flight
    result.ratio("admitgate/semaphore", "admitgate", "semaphore")
    if "reference" in result.rows:
        result.ratio("reference/semaphore", "reference", "semaphore")
        result.ratio("admitgate/reference", "admitgate", "reference")
    result.ratio("admitgate/floor", "admitgate", "floor (no gate)")
    result.target("admitgate/semaphore", result.ratios["admitgate/semaphore"], 1.1)
    result.notes.append(f"admitgate counters exact: {exact}; peak in flight {gate.peak_in_flight}")
    return result


# --------------------------------------------------------------------------------------
# Workload: sustained overload under shed_oldest


async def _park(enter: Callable[[], Any], release: asyncio.Future[None]) -> None:
    """Holds the only slot until `release` resolves."""
    async with enter():
        await release


async def _arrival(enter: Callable[[], Any], rejected: tuple[type[BaseException], ...]) -> None:
    try:
        async with enter():
            pass
    except rejected:
        pass


async def _rejected_at_once(rejected: type[BaseException]) -> None:
    try:
        raise rejected()
    except rejected:
        pass


# Arrivals per event-loop iteration in the overload workload: traffic arrives in bursts, and
# one loop iteration (an epoll_wait call) per arrival would drown the gate in loop overhead.
BURST = 50
FIFO = "python O(1) FIFO"


class _FifoShedGate:
    """Informative baseline: the least a ``shed_oldest`` FIFO can do in Python.

    One future per waiter in a deque; evicting the oldest is ``popleft`` + ``set_exception``
    (O(1)). Its cost per arrival shows what waking a long-parked (cache-cold) task costs,
    whatever the gate.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.held = False
        self.shed = 0

    @property
    def queued(self) -> int:
        return len(self.waiters)

    def admit(self, session_id: str = "") -> _FifoShedAdmission:
        return _FifoShedAdmission(self)


class _FifoShedAdmission:
    __slots__ = ("gate",)

    def __init__(self, gate: _FifoShedGate) -> None:
        self.gate = gate

    async def __aenter__(self) -> None:
        gate = self.gate
        if not gate.held:
            gate.held = True
            return
        if len(gate.waiters) >= gate.depth:
            gate.waiters.popleft().set_exception(admitgate.AdmissionRejected())
            gate.shed += 1
        fut = asyncio.get_running_loop().create_future()
        gate.waiters.append(fut)
        await fut

    async def __aexit__(self, *exc: object) -> None:
        gate = self.gate
        if gate.waiters:
            gate.waiters.popleft().set_result(None)
        else:
            gate.held = False


class _Overloaded:
    """A gate at ceiling 1 (held) with a full queue of `depth` waiters, oldest first."""

    def __init__(self, gate: Any, depth: int, rejected: tuple[type[BaseException], ...]) -> None:
        self.gate = gate
        self.depth = depth
        self.rejected = rejected
        self.waiters: deque[asyncio.Task[None]] = deque()
        self.holder: asyncio.Task[None] | None = None
        self.release: asyncio.Future[None] | None = None

    async def fill(self) -> None:
        loop = asyncio.get_running_loop()
        self.release = loop.create_future()
        self.holder = loop.create_task(_park(self.gate.admit, self.release))
        await asyncio.sleep(0)
        chunk = 2_000
        while len(self.waiters) < self.depth:
            for _ in range(min(chunk, self.depth - len(self.waiters))):
                self.waiters.append(loop.create_task(_arrival(self.gate.admit, self.rejected)))
            await asyncio.sleep(0)
        while self.gate.queued < self.depth:
            await asyncio.sleep(0)
        for _ in range(5):  # let the reference's helper tasks start
            await asyncio.sleep(0)

    async def batch(self, m: int) -> float:
        loop = asyncio.get_running_loop()
        sleep = asyncio.sleep
        admit = self.gate.admit
        rejected = self.rejected
        shed0 = self.gate.shed
        waiters = self.waiters
        with _Timed() as t:
            for i in range(m):
                waiters.append(loop.create_task(_arrival(admit, rejected)))
                if i % BURST == BURST - 1:
                    await sleep(0)
            victims = [waiters.popleft() for _ in range(m)]
            await asyncio.wait(victims)
        if self.gate.shed - shed0 != m or self.gate.queued != self.depth:
            raise RuntimeError(
                f"overload bookkeeping off: shed {self.gate.shed - shed0} of {m}, "
                f"queued {self.gate.queued} of {self.depth}"
            )
        return t.elapsed / m

    async def drain(self) -> None:
        for task in self.waiters:
            task.cancel()
        await asyncio.gather(*self.waiters, return_exceptions=True)
        self.waiters.clear()
        if self.release is not None and not self.release.done():
            self.release.set_result(None)
        if self.holder is not None:
            await self.holder


async def _floor_batch(m: int) -> float:
    loop = asyncio.get_running_loop()
    sleep = asyncio.sleep
    rejected = admitgate.AdmissionRejected
    tasks = []
    with _Timed() as t:
        for i in range(m):
            tasks.append(loop.create_task(_rejected_at_once(rejected)))
            if i % BURST == BURST - 1:
                await sleep(0)
        await asyncio.wait(tasks)
    return t.elapsed / m


def bench_overload(size: dict[str, Any]) -> Result:
    result = Result(
        "overload",
        "sustained overload, shed_oldest, ceiling 1 (held), full queue; every arrival evicts "
        "the oldest waiter; time per arrival",
        "us",
    )
    ref = _reference()
    m = size["overload_m"]
    above: dict[str, dict[int, float]] = {"admitgate": {}, "reference": {}, FIFO: {}}
    for depth in size["overload_depths"]:
        loop = asyncio.new_event_loop()
        gates: dict[str, tuple[_Overloaded, int]] = {
            f"admitgate @{depth}": (
                _Overloaded(
                    _build(max_concurrent_runs=1, queue_depth=depth, overflow_policy="shed_oldest"),
                    depth,
                    (admitgate.AdmissionRejected,),
                ),
                m,
            )
        }
        if ref is not None:
            gates[f"reference @{depth}"] = (
                _Overloaded(
                    ref.build_admission_gate(
                        max_concurrent_runs=1, queue_depth=depth, overflow_policy="shed_oldest"
                    ),
                    depth,
                    (ref.AdmissionRejected,),
                ),
                size["overload_m_ref"][depth],
            )
        variants: dict[str, Callable[[], Awaitable[float]]] = {}
        gates[f"{FIFO} @{depth}"] = (
            _Overloaded(_FifoShedGate(depth), depth, (admitgate.AdmissionRejected,)),
            m,
        )
        try:
            for state, _ in gates.values():
                loop.run_until_complete(state.fill())
            gc.collect()
            gc.freeze()  # the waiters are long-lived: keep them out of the collections
            variants = {name: functools.partial(st.batch, k) for name, (st, k) in gates.items()}
            variants[f"floor @{depth}"] = lambda: _floor_batch(m)
            _interleave(loop, variants, size["overload_reps"], result, warmup=False)
        finally:
            # admitgate's waiters are cancelled (O(1) each). The reference's are abandoned
            # with their loop and collected silently: cancelling them is quadratic (each
            # cancelled Semaphore.acquire removes itself from the semaphore's deque).
            state = gates[f"admitgate @{depth}"][0]
            loop.run_until_complete(state.drain())
            loop.set_exception_handler(lambda _loop, _context: None)
            del gates, variants, state
            loop.close()
            del loop
            gc.unfreeze()
            hook = sys.unraisablehook
            sys.unraisablehook = lambda _unraisable: None
            try:
                gc.collect()
            finally:
                sys.unraisablehook = hook
        # Paired: each repetition's arrival cost minus the floor measured in the same round.
        floors = result.rows[f"floor @{depth}"]
        for who in above:
            key = f"{who} @{depth}"
            if key in result.rows:
                above[who][depth] = _median(
                    [g - f for g, f in zip(result.rows[key], floors, strict=True)]
                )
    depths = size["overload_depths"]
    for who, by_depth in above.items():
        for depth, value in by_depth.items():
            result.extra[f"{who} above floor @{depth} (s)"] = value
    ours_above = above["admitgate"]
    spread = max(ours_above.values()) / min(ours_above.values())
    result.ratios[f"admitgate above-floor max/min over depths {list(depths)}"] = spread
    # O(1) eviction means no growth with the depth: the deepest queue against the shallowest.
    growth = _ratio(ours_above[depths[-1]], ours_above[depths[0]])
    result.ratios[f"admitgate above-floor @{depths[-1]} / @{depths[0]}"] = growth
    mid = 10_000 if 10_000 in ours_above else depths[-1]
    if mid in above["reference"]:
        result.ratios[f"reference/admitgate above floor @{mid}"] = _ratio(
            above["reference"][mid], ours_above[mid]
        )
    for depth in depths:
        line = f"above floor @{depth}: admitgate {ours_above[depth] * 1e6:.3f} us"
        if depth in above["reference"]:
            line += f", reference {above['reference'][depth] * 1e6:.3f} us"
        line += f", {FIFO} {above[FIFO][depth] * 1e6:.3f} us"
        result.notes.append(line)
    result.target(f"admitgate above-floor growth @{depths[-1]} / @{depths[0]}", growth, 1.5)
    if mid in above["reference"]:
        result.target(
            f"reference/admitgate above floor @{mid}",
            result.ratios[f"reference/admitgate above floor @{mid}"],
            5.0,
            at_least=True,
        )
    return result


# --------------------------------------------------------------------------------------
# Workload: memory per queued waiter


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux: peak RSS, which only grows here
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _memory_child(kind: str, n: int, mode: str) -> float:
    import tracemalloc

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def never_waiter(fut: asyncio.Future[None]) -> None:
        await fut

    async def sem_waiter(sem: asyncio.Semaphore) -> None:
        async with sem:
            pass

    async def run() -> float:
        never: asyncio.Future[None] = loop.create_future()
        rejected: tuple[type[BaseException], ...] = (admitgate.AdmissionRejected,)
        if kind == "task":

            def make() -> Any:
                return never_waiter(never)

        elif kind == "semaphore":
            sem = asyncio.Semaphore(1)
            await sem.acquire()

            def make() -> Any:
                return sem_waiter(sem)

        else:
            if kind == "admitgate":
                gate = _build(max_concurrent_runs=1, queue_depth=n + 1_000, overflow_policy="queue")
            else:
                ref = _reference()
                assert ref is not None
                gate = ref.build_admission_gate(
                    max_concurrent_runs=1, queue_depth=n + 1_000, overflow_policy="queue"
                )
                rejected = (ref.AdmissionRejected,)
            loop.create_task(_park(gate.admit, never))
            await asyncio.sleep(0)

            def make() -> Any:
                return _arrival(gate.admit, rejected)

        # Warm up: lazy imports, interned strings, free lists, the first slab chunk.
        warm = [loop.create_task(make()) for _ in range(200)]
        for _ in range(10):
            await asyncio.sleep(0)
        tasks: list[Any] = [None] * n  # allocated before the baseline
        gc.collect()
        if mode == "tracemalloc":
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
        else:
            base = _rss_bytes()
        for i in range(n):
            tasks[i] = loop.create_task(make())
        for _ in range(10):
            await asyncio.sleep(0)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else _rss_bytes()
        if kind in ("admitgate", "reference") and gate.queued != n + len(warm):
            raise RuntimeError(f"{kind}: {gate.queued} queued, expected {n + len(warm)}")
        return (after - base) / n

    return loop.run_until_complete(run())


def bench_memory(size: dict[str, Any]) -> Result:
    n = size["memory_n"]
    result = Result(
        "memory",
        f"bytes per queued waiter, {n} waiters in a fresh child process (RSS growth; "
        "tracemalloc shown separately)",
        "B",
    )
    kinds = ["task", "semaphore", "admitgate"]
    if _reference() is not None:
        kinds.append("reference")
    modes = size["memory_modes"]
    raw: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    for mode in modes:
        for order in _rotations(kinds, size["memory_reps"]):
            for kind in order:
                value = _child(["memory", kind, str(n), mode], block_praisonai=False)
                raw[mode].setdefault(kind, []).append(value)
    for mode in modes:
        task = _median(raw[mode]["task"])
        for kind in kinds:
            label = f"{kind} ({mode})" if kind == "task" else f"{kind} beyond task ({mode})"
            values = raw[mode][kind]
            result.rows[label] = values if kind == "task" else [v - task for v in values]
    if "reference" in kinds:
        result.ratio(
            "admitgate/reference beyond task (rss)",
            "admitgate beyond task (rss)",
            "reference beyond task (rss)",
        )
        result.ratio(
            "admitgate/reference beyond task (tracemalloc)",
            "admitgate beyond task (tracemalloc)",
            "reference beyond task (tracemalloc)",
        )
    if "reference" in kinds:
        result.target(
            "admitgate/reference memory beyond the task (rss)",
            result.ratios["admitgate/reference beyond task (rss)"],
            0.25,
        )
    result.notes.append(
        "tracemalloc sees Python allocations only; admitgate's Rust slab records and wakers "
        "are in the RSS figure"
    )
    return result


# --------------------------------------------------------------------------------------
# Workload: memory-aware admission on vs off


def bench_memory_aware(size: dict[str, Any]) -> Result:
    n = size["uncontended_n"]
    result = Result(
        "memory-aware",
        "uncontended turns, memory-aware admission on (max_rss_mb=1e9, built-in sampler) vs "
        "off; per turn",
        "us",
    )
    off = _build(max_concurrent_runs=32, queue_depth=128)
    on = _build(
        max_concurrent_runs=32,
        queue_depth=128,
        resource_policy=admitgate.build_memory_pressure_policy(max_rss_mb=1e9),
    )
    variants: dict[str, Callable[[], Awaitable[float]]] = {
        "admitgate on": lambda: _uncontended_gate(on, n),
        "admitgate off": lambda: _uncontended_gate(off, n),
    }
    ref = _reference()
    if ref is not None:
        ron = ref.build_admission_gate(
            max_concurrent_runs=32,
            queue_depth=128,
            resource_policy=ref.build_memory_pressure_policy(max_rss_mb=1e9),
        )
        roff = ref.build_admission_gate(max_concurrent_runs=32, queue_depth=128)
        variants["reference on"] = lambda: _uncontended_gate(ron, n)
        variants["reference off"] = lambda: _uncontended_gate(roff, n)
    loop = asyncio.new_event_loop()
    try:
        _interleave(loop, variants, size["reps"], result)
    finally:
        loop.close()
    result.ratio("admitgate on/off", "admitgate on", "admitgate off")
    if ref is not None:
        result.ratio("reference on/off", "reference on", "reference off")
        result.ratio("admitgate on/reference on", "admitgate on", "reference on")
    result.target("admitgate on/off", result.ratios["admitgate on/off"], 1.25)
    return result


# --------------------------------------------------------------------------------------
# Workload: several threads, one gate


def _threads_run(gate: Any, threads: int, tasks: int, turns: int) -> tuple[float, int]:
    """Wall time for `threads` threads, each running its own loop of `tasks` x `turns`."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    async def worker() -> None:
        sleep = asyncio.sleep
        if gate is None:
            for _ in range(turns):
                await sleep(0)
        else:
            admit = gate.admit
            for _ in range(turns):
                async with admit(session_id="s"):
                    await sleep(0)

    async def main() -> None:
        await asyncio.gather(*[worker() for _ in range(tasks)])

    def thread_main() -> None:
        loop = asyncio.new_event_loop()
        try:
            barrier.wait()
            loop.run_until_complete(main())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            loop.close()

    pool = [threading.Thread(target=thread_main) for _ in range(threads)]
    for th in pool:
        th.start()
    with _Timed() as t:
        barrier.wait()
        for th in pool:
            th.join()
    if errors:
        raise errors[0]
    return t.elapsed, threads * tasks * turns


def bench_threads(size: dict[str, Any]) -> Result:
    nthreads, tasks, turns = size["threads"]
    result = Result(
        "threads",
        f"{nthreads} threads x own event loop x {tasks} tasks x {turns} turns (body sleep(0)) "
        "sharing one gate, vs 1 thread alone; total turns/s",
        "turns/s",
    )
    exact = True
    configs = {"free slots": 100_000, "ceiling 32": 32}
    gates = {
        name: _build(max_concurrent_runs=ceiling, queue_depth=100_000, overflow_policy="queue")
        for name, ceiling in configs.items()
    }
    expected = {name: 0 for name in configs}
    variants: dict[str, Callable[[], tuple[float, int]]] = {}
    for name, gate in gates.items():
        variants[f"admitgate {name}, 1 thread"] = functools.partial(
            _threads_run, gate, 1, tasks, turns
        )
        variants[f"admitgate {name}, {nthreads} threads"] = functools.partial(
            _threads_run, gate, nthreads, tasks, turns
        )
    variants["floor (no gate), 1 thread"] = lambda: _threads_run(None, 1, tasks, turns)
    variants[f"floor (no gate), {nthreads} threads"] = lambda: _threads_run(
        None, nthreads, tasks, turns
    )
    for order in _rotations(list(variants), size["threads_reps"]):
        for label in order:
            elapsed, turns_done = variants[label]()
            result.rows.setdefault(label, []).append(turns_done / elapsed)
            for name in configs:
                if label.startswith(f"admitgate {name},"):
                    expected[name] += turns_done
    result.rows = {label: result.rows[label] for label in variants}
    for name, gate in gates.items():
        s = gate.stats()
        ok = (
            s["admitted"] == expected[name]
            and s["in_flight"] == 0
            and s["queued"] == 0
            and s["rejected"] == s["shed"] == s["cancelled"] == 0
        )
        exact = exact and ok
        result.notes.append(
            f"admitgate {name}: admitted {s['admitted']} of {expected[name]}, exact={ok}"
        )
        ratio = result.ratio(
            f"admitgate {name}: {nthreads} threads/1 thread",
            f"admitgate {name}, {nthreads} threads",
            f"admitgate {name}, 1 thread",
        )
        result.target(f"{nthreads}T/1T turns/s ({name})", ratio, 0.8, at_least=True)
    result.ratio(
        f"floor: {nthreads} threads/1 thread",
        f"floor (no gate), {nthreads} threads",
        "floor (no gate), 1 thread",
    )
    result.extra["counters_exact"] = exact
    result.targets.append(
        {
            "target": "counters exact",
            "value": float(exact),
            "limit": 1.0,
            "at_least": True,
            "met": exact,
        }
    )
    result.notes.append(
        "the reference cannot be shared across event loops (its semaphore binds to one)"
    )
    return result


# --------------------------------------------------------------------------------------
# Entry point

BENCHES: dict[str, Callable[[dict[str, Any]], Result]] = {
    "uncontended": bench_uncontended,
    "uncontended-nobinding": bench_uncontended_nobinding,
    "contended": bench_contended,
    "overload": bench_overload,
    "memory": bench_memory,
    "memory-aware": bench_memory_aware,
    "threads": bench_threads,
}


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover - not Linux
        pass
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "admitgate": getattr(admitgate, "__version__", "?"),
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m admitgate bench",
        description="Benchmark admitgate against PraisonAI's gate, asyncio.Semaphore and the floor.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repetition")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--only", metavar="NAME", help=f"comma-separated workloads: {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--reps", type=int, help="override the repetition count")
    args = parser.parse_args(argv)
    names = list(WORKLOADS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BENCHES]
        if unknown:
            parser.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.reps:
        for key in ("reps", "contended_reps", "overload_reps", "memory_reps", "threads_reps"):
            size[key] = args.reps
    machine = _machine()
    if not args.json:
        print(
            f"admitgate {machine['admitgate']} bench ({'quick' if args.quick else 'full'}) on "
            f"{machine['cpus']} x {machine['cpu']}, Python {machine['python']}"
        )
        if _reference() is None:
            print("note: praisonai-bot is not installed; the reference gate is skipped")
    results = []
    started = perf()
    for name in names:
        t0 = perf()
        result = BENCHES[name](size)
        result.extra["seconds"] = perf() - t0
        results.append(result)
        if not args.json:
            _print(result)
            sys.stdout.flush()
    if args.json:
        print(
            json.dumps(
                {
                    "machine": machine,
                    "mode": "quick" if args.quick else "full",
                    "seconds": perf() - started,
                    "results": [r.as_dict() for r in results],
                },
                indent=2,
            )
        )
    else:
        met = sum(t["met"] for r in results for t in r.targets)
        total = sum(len(r.targets) for r in results)
        print(f"\n{met}/{total} targets met in {perf() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
