"""Smoke tests of the benchmark harness (``benchmarks/``, run from the repository root).

Benchmarks are not timed tests: nothing here checks a figure. What is checked: every workload
runs to completion and reports, every counter check passes, and the command exits non-zero
when a workload raises or a check fails (shown by breaking a gate on purpose in a child
process), while a missed performance target alone is not an error.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = (
    "uncontended",
    "uncontended-nobinding",
    "contended",
    "overload",
    "memory",
    "memory-aware",
    "threads",
)
CHECKS_LINE = re.compile(r"^(\d+)/(\d+) checks passed, (\d+) errors$", re.MULTILINE)


def _run(
    args: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )


def _checks(out: str) -> tuple[int, int, int]:
    match = CHECKS_LINE.search(out)
    assert match is not None, out
    passed, total, errors = (int(g) for g in match.groups())
    return passed, total, errors


@pytest.mark.timeout(120)
def test_quick_bench_runs_every_workload_and_passes_every_check() -> None:
    proc = _run(["-m", "benchmarks", "--quick"])
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for workload in WORKLOADS:
        assert f"\n== {workload}:" in out, out
    assert "admitgate/semaphore" in out
    assert re.search(r"^\d+/\d+ targets met in ", out, re.MULTILINE), out
    passed, total, errors = _checks(out)
    # Counter checks in every workload: uncontended (2), contended (2), overload (one per
    # depth), memory (admitgate, and the reference when installed), memory-aware (2), threads (4).
    assert total >= 13 and passed == total and errors == 0, out
    assert "[FAIL]" not in out and "ERROR" not in out, out


@pytest.mark.timeout(60)
def test_admitgate_bench_runs_the_checkout_harness() -> None:
    proc = _run(["-m", "admitgate", "bench", "--quick", "--only", "contended"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\n== contended:" in proc.stdout
    assert "[PASS] check: admitgate counters exact" in proc.stdout
    assert "\n== uncontended:" not in proc.stdout


@pytest.mark.timeout(60)
def test_admitgate_bench_outside_a_checkout_exits_2(tmp_path: Path) -> None:
    """An installed admitgate with no checkout around it says where to run the bench."""
    import admitgate

    site = tmp_path / "site"
    shutil.copytree(
        Path(admitgate.__file__).parent,
        site / "admitgate",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    # Nothing but the copy: no PYTHONPATH that could lead to a checkout.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = _run(["-m", "admitgate", "bench", "--quick"], cwd=site, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "source checkout" in proc.stderr
    assert "== " not in proc.stdout


# Each scenario runs the command in a child process after breaking one thing on purpose.
_LEAKED_TURN = """
    import asyncio

    import benchmarks.contended as contended

    real_build = contended.build
    leaked = []

    async def _leak(gate):
        admission = gate.admit(session_id="leaked")
        await admission.__aenter__()
        return admission

    def build(**config):
        # A real gate with one turn that was admitted and never left: a leaked slot.
        gate = real_build(**config)
        leaked.append(asyncio.run(_leak(gate)))
        return gate

    contended.build = build
    ONLY = "contended"
"""
_RAISES = """
    import benchmarks.contended as contended

    def build(**config):
        raise RuntimeError("injected: this gate cannot be built")

    contended.build = build
    ONLY = "contended,memory-aware"
"""
_BOOKKEEPING = """
    from benchmarks import harness, runner

    def broken(size):
        raise harness.CheckFailed("shed 3 of 4, queued 9 of 10")

    runner.WORKLOADS["contended"] = broken
    ONLY = "contended"
"""
_MISSED_TARGET = """
    from benchmarks import harness, runner

    def slow(size):
        result = harness.Result("contended", "a workload that misses its target", "us")
        result.rows["admitgate"] = [2.0]
        result.target("admitgate/semaphore", 2.0, 1.1)
        result.check("counters exact", True)
        return result

    runner.WORKLOADS["contended"] = slow
    ONLY = "contended"
"""
_MAIN = """
    import sys
    from benchmarks import main

    sys.exit(main(["--quick", "--only", ONLY]))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("scenario", "code", "lines"),
    [
        (
            _LEAKED_TURN,
            1,
            [
                "[FAIL] check: admitgate counters exact (admitted 1001, expected 1000; "
                "in_flight 1, expected 0)",
                "[PASS] check: admitgate peak in flight within the ceiling",
                "1/2 checks passed, 0 errors",
                "FAILED check: contended: admitgate counters exact",
            ],
        ),
        (
            _RAISES,
            1,
            [
                "== contended: raised an error",
                "  ERROR: RuntimeError: injected: this gate cannot be built",
                "\n== memory-aware:",  # the next workload still runs
                "[PASS] check: admitgate on counters exact",
                "2/2 checks passed, 1 errors",
                "ERROR in contended: RuntimeError: injected: this gate cannot be built",
            ],
        ),
        (
            _BOOKKEEPING,
            1,
            [
                "[FAIL] check: workload bookkeeping (shed 3 of 4, queued 9 of 10)",
                "0/1 checks passed, 0 errors",
                "FAILED check: contended: workload bookkeeping",
            ],
        ),
        (
            _MISSED_TARGET,
            0,
            [
                "[MISS] admitgate/semaphore: 2.000 (<= 1.1)",
                "0/1 targets met",
                "1/1 checks passed, 0 errors",
            ],
        ),
    ],
    ids=["leaked-turn", "workload-raises", "bookkeeping-off", "target-missed"],
)
def test_exit_code_follows_errors_and_failed_checks(
    scenario: str, code: int, lines: list[str]
) -> None:
    script = textwrap.dedent(scenario) + textwrap.dedent(_MAIN)
    proc = _run(["-c", script])
    assert proc.returncode == code, proc.stdout + proc.stderr
    for line in lines:
        assert line in proc.stdout, proc.stdout
    if code == 0:
        assert "FAILED" not in proc.stdout and "ERROR" not in proc.stdout
    if scenario is _RAISES:
        assert "Traceback" in proc.stderr and "injected" in proc.stderr
