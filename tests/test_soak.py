"""A short run of the soak (scripts/soak.py) as part of the normal test command.

The full soak (1,000,000 turns) is run by hand: ``python scripts/soak.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("admitgate_soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_short_soak_holds_every_invariant(soak):
    bound = soak.rss_mb() + 128.0
    summary = soak.run_soak(turns=20_000, threads=4, seed=20240601, rss_bound_mb=bound)
    assert summary["violations"] == [], summary["violations"]
    assert not summary["wedged"]
    totals = summary["totals"]
    # The run exercised every path it claims to.
    assert totals["reached"] > 18_000
    assert totals["admitted"] > 0 and totals["rejected"] > 0
    assert totals["shed"] > 0 and totals["cancelled"] > 0
    assert summary["raised"] > 0 and summary["task_cancels"] > 0 and summary["timeouts"] > 0
    assert len(summary["gates"]) == 6
    for row in summary["gates"]:
        assert 0 < row["peak_in_flight"] <= soak.CEILING
        assert row["admitted"] + row["rejected"] + row["shed"] + row["cancelled"] == row["reached"]


def test_soak_reports_a_violated_bound(soak):
    """The checks can fail: an impossible RSS bound is reported, not ignored."""
    summary = soak.run_soak(turns=400, threads=2, seed=1, rss_bound_mb=1.0)
    assert any("RSS peaked" in v for v in summary["violations"])


def test_soak_command_line_json_and_exit_code():
    ok = subprocess.run(
        [sys.executable, str(SCRIPT), "--turns", "2000", "--threads", "2", "--seed", "5", "--json"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    summary = json.loads(ok.stdout)
    assert summary["violations"] == [] and summary["turns"] == 2000

    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--turns", "200", "--threads", "1", "--rss-bound-mb", "1"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert bad.returncode == 1
    assert "VIOLATIONS" in bad.stdout
