"""The bars of priority classes and fair queuing, as short seeded simulations through the real
gate (``benchmarks/priorities.py``; ``python -m benchmarks --only priorities`` runs them long
and prints the baselines beside them)."""

from __future__ import annotations

import pytest

from benchmarks.priorities import simulate_classes, simulate_fairness

DURATION = 20.0


@pytest.mark.timeout(120)
def test_interactive_is_served_and_batch_takes_the_rest():
    got = simulate_classes("admitgate classes", seed=11, duration=DURATION, interactive_load=0.1)
    assert got["interactive goodput"] >= 0.99
    assert got["interactive p99 wait"] <= 1.0  # one mean service time
    assert got["total goodput"] >= 0.97
    assert got["counters add up"]
    # FIFO beside it: interactive callers give up behind the batch backlog.
    fifo = simulate_classes("fifo", seed=11, duration=DURATION, interactive_load=0.1)
    assert fifo["interactive goodput"] < 0.9


@pytest.mark.timeout(120)
def test_batch_keeps_its_guarantee_when_interactive_alone_overloads():
    got = simulate_classes("admitgate classes", seed=12, duration=DURATION, interactive_load=2.0)
    assert got["batch min held"] >= 3  # floor(0.2 * 16)
    strict = simulate_classes("strict priority", seed=12, duration=DURATION, interactive_load=2.0)
    assert strict["batch min held"] < 3, "without a share, strict priority starves batch"


@pytest.mark.timeout(120)
def test_ten_tenants_one_noisy_share_fairly_per_window():
    fair = simulate_fairness("fair queuing", seed=13, duration=DURATION)
    assert fair["worst window Jain index"] >= 0.99
    fifo = simulate_fairness("fifo", seed=13, duration=DURATION)
    assert fifo["worst window Jain index"] < 0.5
