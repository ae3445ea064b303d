"""Workload ``priorities``: seeded simulations of priority classes and fair queuing through
the real gate, on a virtual clock.

A discrete-event simulation drives a real :class:`admitgate.AdmissionGate` (its async API on
one event loop): arrivals, completions and callers giving up happen at virtual times in
order, and the loop is settled after each event, so every decision is the gate's own and no
figure depends on the machine's speed. Service times are exponential (mean one time unit),
arrivals Poisson, everything drawn from one seeded generator.

Two scenarios, each against baselines built from the same gate:

* **classes**: capacity 16; batch offered at 10x capacity, interactive at 10% of capacity
  with 2 units of patience (a caller who waited that long leaves). Bars: interactive goodput
  >= 0.99 of its offered load and its p99 wait <= one service time; total goodput >= 0.97 of
  capacity; and, in a second run where interactive alone offers 2x capacity, batch (with
  ``min_share=0.2``) never holds fewer than its 3 slots while it is backlogged. Beside it:
  FIFO, strict priority without shares, and a LiteLLM-style reservation (each priority
  capped at its reserved share, nothing borrowed).
* **fairness**: ten tenants in one class, offered loads 1:...:1:20 (one noisy), each quiet
  tenant at twice its fair share (together 5.8x capacity), so every tenant is backlogged:
  per window of 10 time units, Jain's index over the tenants' started turns >= 0.99
  (max-min fair), beside FIFO.

The overflow policy is ``shed_oldest`` with a queue of 4x capacity throughout.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import admitgate
from admitgate import PriorityClass

from .harness import Result

CAPACITY = 16
PATIENCE = 2.0
DEPTH = 4 * CAPACITY
WINDOW = 10.0


async def _settle(rounds: int = 8) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


@dataclass
class Turn:
    """One simulated turn."""

    kind: str  # its class, or its tenant in the fairness scenario
    arrived: float
    service: float
    started: float | None = None
    ended: bool = False
    gave_up: bool = False
    refused: str | None = None
    finish: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@dataclass
class Sim:
    """The virtual clock, its event heap and the turns."""

    gate: admitgate.AdmissionGate
    priority_of: Callable[[Turn], str | None]
    tenant_of: Callable[[Turn], str]
    now: float = 0.0
    events: list[tuple[float, int, str, Turn]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    order: itertools.count = field(default_factory=itertools.count)
    # (time, batch slots held) whenever batch had a waiter, for the guarantee check
    batch_held: list[tuple[float, int]] = field(default_factory=list)

    def at(self, when: float, what: str, turn: Turn) -> None:
        heapq.heappush(self.events, (when, next(self.order), what, turn))

    async def run_turn(self, turn: Turn) -> None:
        try:
            async with self.gate.admit(
                session_id=self.tenant_of(turn), priority=self.priority_of(turn)
            ):
                turn.started = self.now
                self.at(self.now + turn.service, "end", turn)
                await turn.finish.wait()
                turn.ended = True
        except admitgate.AdmissionRejected as exc:
            turn.refused = exc.reason
        except asyncio.CancelledError:
            turn.gave_up = True

    async def run(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            self.now, _, what, turn = heapq.heappop(self.events)
            if what == "arrive":
                self.turns.append(turn)
                turn.task = asyncio.get_running_loop().create_task(self.run_turn(turn))
            elif what == "end":
                turn.finish.set()
            elif what == "patience" and turn.started is None and turn.refused is None:
                assert turn.task is not None
                turn.task.cancel()
            await _settle()
            classes = self.gate.stats().get("classes")
            if isinstance(classes, dict) and "batch" in classes and classes["batch"]["queued"]:
                self.batch_held.append((self.now, classes["batch"]["in_flight"]))
        for turn in self.turns:
            if turn.task is not None and not turn.task.done():
                turn.task.cancel()
        await _settle(20)


def poisson(rng: random.Random, rate: float, until: float) -> list[float]:
    times: list[float] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t > until:
            return times
        times.append(t)
    return times


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


# -- classes ---------------------------------------------------------------------------------


def _built(gate: admitgate.AdmissionGate | None) -> admitgate.AdmissionGate:
    assert gate is not None, "a gate with a ceiling is always built"
    return gate


def class_gate(variant: str) -> tuple[admitgate.AdmissionGate, bool]:
    """The gate of a variant, and whether turns name their class."""
    common: dict[str, Any] = {
        "max_concurrent_runs": CAPACITY,
        "queue_depth": DEPTH,
        "overflow_policy": "shed_oldest",
    }
    if variant == "fifo":
        return _built(admitgate.build_admission_gate(**common)), False
    classes = {
        "admitgate classes": [
            PriorityClass("interactive"),
            PriorityClass("batch", min_share=0.2),
        ],
        "strict priority": [PriorityClass("interactive"), PriorityClass("batch")],
        # LiteLLM's priority reservation: each priority gets at most its reserved share.
        "litellm-style reserved": [
            PriorityClass("interactive", max_share=0.5),
            PriorityClass("batch", max_share=0.5),
        ],
    }[variant]
    gate = admitgate.build_admission_gate(priorities=classes, fairness="none", **common)
    return _built(gate), True


def simulate_classes(variant: str, seed: int, duration: float, interactive_load: float) -> dict:
    """One run: batch at 10x capacity, interactive at ``interactive_load`` x capacity."""
    rng = random.Random(seed)
    gate, classed = class_gate(variant)
    sim = Sim(
        gate,
        priority_of=(lambda t: t.kind) if classed else (lambda t: None),
        tenant_of=lambda t: "",
    )
    arrivals = [(t, "batch") for t in poisson(rng, 10 * CAPACITY, duration)]
    arrivals += [(t, "interactive") for t in poisson(rng, interactive_load * CAPACITY, duration)]
    for when, kind in sorted(arrivals):
        turn = Turn(kind, when, rng.expovariate(1.0))
        sim.at(when, "arrive", turn)
        if kind == "interactive":
            sim.at(when + PATIENCE, "patience", turn)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(sim.run(duration))
    finally:
        loop.close()
    # Measured over the middle of the run: past the first fill, before the last drain.
    lo, hi = 0.1 * duration, duration - 2 * PATIENCE
    window = [t for t in sim.turns if lo <= t.arrived < hi]
    inter = [t for t in window if t.kind == "interactive"]
    busy = sum(
        min(t.started + t.service, hi) - max(t.started, lo)
        for t in sim.turns
        if t.started is not None and t.started < hi and t.started + t.service > lo
    )
    stats = gate.stats()
    raw = stats.get("classes")
    per_class = raw if isinstance(raw, dict) else {}
    held = [n for when, n in sim.batch_held if lo <= when < hi]
    return {
        "interactive goodput": (
            sum(1 for t in inter if t.started is not None) / len(inter) if inter else 1.0
        ),
        "interactive p99 wait": p99(
            [t.started - t.arrived for t in inter if t.started is not None]
        ),
        "total goodput": busy / (CAPACITY * (hi - lo)),
        "batch min held": min(held) if held else CAPACITY,
        "counters add up": (
            not per_class  # a gate without classes
            or all(
                stats[k] == sum(c[k] for c in per_class.values())
                for k in ("in_flight", "queued", "admitted", "rejected", "shed", "cancelled")
            )
        ),
    }


# -- fairness --------------------------------------------------------------------------------


def jain(xs: list[float]) -> float:
    total = sum(xs)
    squares = sum(x * x for x in xs)
    return total * total / (len(xs) * squares) if squares else 1.0


def simulate_fairness(variant: str, seed: int, duration: float) -> dict:
    rng = random.Random(seed)
    common: dict[str, Any] = {
        "max_concurrent_runs": CAPACITY,
        "queue_depth": DEPTH,
        "overflow_policy": "shed_oldest",
    }
    if variant == "fair queuing":
        common["fairness"] = "tenant"
    gate = _built(admitgate.build_admission_gate(**common))
    sim = Sim(gate, priority_of=lambda t: None, tenant_of=lambda t: t.kind)
    weights = [1] * 9 + [20]
    # Each quiet tenant offers twice its fair share (the noisy one forty times): every tenant
    # stays backlogged, so max-min fairness is an equal share each.
    unit = 2 * CAPACITY / len(weights)
    arrivals = []
    for i, w in enumerate(weights):
        arrivals += [(t, f"tenant-{i}") for t in poisson(rng, w * unit, duration)]
    for when, tenant in sorted(arrivals):
        sim.at(when, "arrive", Turn(tenant, when, rng.expovariate(1.0)))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(sim.run(duration))
    finally:
        loop.close()
    indices = []
    # The first window fills the queue (a short run measures its last window only).
    start = WINDOW if duration >= 2 * WINDOW else max(0.0, duration - WINDOW)
    while start + WINDOW <= duration:
        started = [
            sum(
                1
                for t in sim.turns
                if t.kind == f"tenant-{i}"
                and t.started is not None
                and start <= t.started < start + WINDOW
            )
            for i in range(len(weights))
        ]
        indices.append(jain([float(n) for n in started]))
        start += WINDOW
    return {"worst window Jain index": min(indices) if indices else 1.0, "windows": len(indices)}


CLASS_VARIANTS = ("admitgate classes", "fifo", "strict priority", "litellm-style reserved")


def bench_priorities(size: dict[str, Any]) -> Result:
    """The workload (see the module documentation)."""
    duration = size.get("priorities_duration", 60.0)
    seed = size.get("priorities_seed", 7)
    result = Result("priorities", "priority classes and fair queuing, simulated", "ratio")
    for variant in CLASS_VARIANTS:
        figures = simulate_classes(variant, seed, duration, interactive_load=0.1)
        for name, value in figures.items():
            if name != "counters add up" and name != "batch min held":
                result.rows[f"{variant}: {name}"] = [float(value)]
        result.check(f"{variant}: counters add up", figures["counters add up"])
        if variant == "admitgate classes":
            result.target(
                "interactive goodput", figures["interactive goodput"], 0.99, at_least=True
            )
            result.target(
                "interactive p99 wait (service times)", figures["interactive p99 wait"], 1.0
            )
            result.target(
                "total goodput (of capacity)", figures["total goodput"], 0.97, at_least=True
            )
    starved = simulate_classes("strict priority", seed + 1, duration, interactive_load=2.0)
    result.rows["strict priority, interactive alone at 2x: batch min slots while backlogged"] = [
        float(starved["batch min held"])
    ]
    overloaded = simulate_classes("admitgate classes", seed + 1, duration, interactive_load=2.0)
    result.rows["interactive alone at 2x: batch min slots while backlogged"] = [
        float(overloaded["batch min held"])
    ]
    result.target(
        "batch slots while backlogged, interactive alone at 2x (guarantee 3)",
        overloaded["batch min held"],
        3,
        at_least=True,
    )
    for variant in ("fair queuing", "fifo"):
        figures = simulate_fairness(variant, seed, duration)
        result.rows[f"{variant}: worst 10-unit window Jain index"] = [
            figures["worst window Jain index"]
        ]
        if variant == "fair queuing":
            result.target(
                "Jain's index per 10-unit window (fair queuing)",
                figures["worst window Jain index"],
                0.99,
                at_least=True,
            )
    result.notes.append(
        f"seed {seed}, {duration:g} time units (mean service time 1), capacity {CAPACITY}, "
        f"queue {DEPTH} shed_oldest; interactive patience {PATIENCE:g}"
    )
    return result
