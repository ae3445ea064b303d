"""Smoke test of the benchmark command: it runs (tiny sizes) and prints ratios.

Benchmarks are not timed tests: nothing here checks a figure, only that every workload runs
to completion and reports.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_bench_quick_runs_and_prints_ratios() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "admitgate._bench", "--quick"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for workload in (
        "uncontended",
        "uncontended-nobinding",
        "contended",
        "overload",
        "memory",
        "memory-aware",
        "threads",
    ):
        assert f"== {workload}:" in out, out
    assert "admitgate/semaphore" in out
    assert "targets met" in out
