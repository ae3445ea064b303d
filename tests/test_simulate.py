"""``python -m admitgate simulate``: the overload simulator as a command."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from admitgate._simulate import main
from hypothesis import given, settings
from hypothesis import strategies as st

CONFIGS = Path(__file__).parent / "configs"


def rows(out: str) -> dict[str, list[str]]:
    """The table's rows, by gate name."""
    found = {}
    for line in out.splitlines():
        match = re.match(r"^(\S.*?)\s{2,}(\d\.\d{3})\s", line)
        if match:
            found[match.group(1)] = line[len(match.group(1)) :].split()
    return found


def test_compares_your_gate_the_adaptive_one_and_no_gate(capsys):
    code = main(
        [
            "--max-concurrent-runs",
            "8",
            "--queue-depth",
            "32",
            "--patience",
            "0.2",
            "--duration",
            "6",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "the most the provider can serve: 160.0 turns/s" in out
    table = rows(out)
    assert set(table) == {"yours (max 8, queue 32)", "adaptive (<= 8)", "no gate"}
    yours, adaptive, no_gate = (float(table[k][0]) for k in table)
    # FIFO serves the oldest, least patient waiters: today's gate loses most of the goodput.
    assert adaptive >= 0.9 > yours
    assert float(table["no gate"][3].rstrip("%")) > 50  # most of its calls are 429s
    assert float(table["adaptive (<= 8)"][3].rstrip("%")) <= 3
    assert no_gate > 0.9


def test_reads_a_gateway_yaml_and_flags_win(capsys):
    code = main(["--config", str(CONFIGS / "good-full-gateway.yaml"), "--duration", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "yours (max 16, queue 64)" in out and "adaptive (<= 16)" in out
    code = main(
        [
            "--config",
            str(CONFIGS / "good-full-gateway.yaml"),
            "--queue-depth",
            "4",
            "--duration",
            "2",
        ]
    )
    assert "yours (max 16, queue 4)" in capsys.readouterr().out


def test_capacity_changes_and_baselines(capsys):
    code = main(["--capacity", "8,4@2,16@4", "--duration", "6", "--baselines"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "provider 8@0s -> 4@2s -> 16@4s" in out
    table = rows(out)
    assert {"aimd (vector arc), fifo", "gradient2 (netflix), fifo"} <= set(table)
    adaptive_row = next(line for line in out.splitlines() if line.startswith("adaptive"))
    learned = [(int(a), int(b)) for a, b in re.findall(r"(\d+) \((\d+)\)", adaptive_row)]
    assert [capacity for _, capacity in learned] == [8, 4, 16]
    assert all(abs(limit - capacity) <= capacity / 4 for limit, capacity in learned), learned


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--capacity", "eight"], "--capacity must look like 8 or 8,4@10,16@20"),
        (["--capacity", "8,4"], "each change with @seconds"),
        (["--capacity", "8,4@10,16@5"], "in time order"),
        (["--capacity", "0"], "capacities from 1 to"),
        (["--patience", "-1"], "must be a positive number, got '-1'"),
        (["--load", "nan"], "must be a positive number, got 'nan'"),
        # Issue 22 item 18: each of these was a traceback, a nonsense result or a run
        # without bound.
        (["--seed", "-1"], "argument --seed: must be an integer from 0 to"),
        (["--seed", "18446744073709551616"], "argument --seed: must be an integer from 0 to"),
        (["--max-concurrent-runs", "5000000000"], "argument --max-concurrent-runs: must be"),
        (["--queue-depth", "5000000000"], "argument --queue-depth: must be"),
        (["--service-sigma", "nan"], "argument --service-sigma: must be a number from 0 to 2"),
        (["--service-sigma", "-5"], "argument --service-sigma: must be a number from 0 to 2"),
        (["--service-sigma", "5"], "argument --service-sigma: must be a number from 0 to 2"),
        (["--service-ms", "1e-300"], "would simulate about"),
        (["--service-ms", "0.001"], "would simulate about"),
        (["--service-ms", "1e300"], "argument --service-ms: must be at most"),
        (["--load", "1e6"], "would simulate about"),
        (["--duration", "1e9"], "argument --duration: must be at most"),
        (["--patience", "1e300"], "argument --patience: must be at most"),
        (["--queue-timeout-s", "1e300"], "argument --queue-timeout-s: must be at most"),
        (["--capacity", "99999999999"], "--capacity must look like"),
        (["--capacity", "8,4@1e300"], "--capacity must look like"),
    ],
)
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err  # one line, never a traceback


def test_a_config_that_cannot_be_read_exits_2(capsys, tmp_path):
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--max-concurrent-runs", "-3"])
    assert exit_.value.code == 2
    assert "--max-concurrent-runs: must be an integer from 0 to" in capsys.readouterr().err


def test_the_timeline_has_the_share_of_provider_429s_the_png_draws():
    """Issue 27: the picture did not show provider 429s, the figure the page is about."""
    from admitgate import _admitgate
    from admitgate._simulate import candidates

    yours = {"name": "yours", "ceiling": "none", "max_concurrent_runs": 0, "queue_depth": 0,
             "overflow_policy": "reject", "queue_timeout_s": None, "queue_discipline": "fifo"}  # fmt: skip
    scenario = {"capacity": [(0.0, 8)], "duration_s": 4.0, "seed": 3}
    reports = _admitgate._simulate(scenario, candidates(yours, False))
    for report in reports:
        shares = [point[4] for point in report["timeline"]]
        assert all(0.0 <= share <= 1.0 for share in shares)
        overall = report["provider_429s"] / max(report["provider_calls"], 1)
        mean = sum(shares) / len(shares)
        assert abs(mean - overall) < 0.1, (report["gate"], mean, overall)
    no_gate, adaptive = reports[2], reports[1]
    assert sum(p[4] for p in no_gate["timeline"]) > 5 * sum(p[4] for p in adaptive["timeline"])


def test_png_of_goodput_and_the_ceiling(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out.png"
    assert main(["--duration", "2", "--png", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


#: A run's bounds, whatever its flags: its address space (a run that grew past it would fail
#: to allocate and end with neither 0 nor 2) and its wall time, generous for a loaded host.
RUN_MEMORY_BYTES = 2 << 30
RUN_BOUND_S = 60


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (RUN_MEMORY_BYTES, RUN_MEMORY_BYTES))


FLAG_TEXT = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["0", "1", "-1", "1e-300", "1e300", "nan", "inf", "-0", "0.001", "x", ""]),
)
NUMERIC_FLAGS = [
    "--max-concurrent-runs",
    "--queue-depth",
    "--queue-timeout-s",
    "--service-ms",
    "--service-sigma",
    "--patience",
    "--load",
    "--duration",
    "--seed",
    "--capacity",
]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(NUMERIC_FLAGS), FLAG_TEXT, max_size=4))
def test_any_flag_values_exit_0_or_2_with_one_line_in_bounded_time_and_memory(flags):
    """Whatever the flags, a run ends 0, or 2 with one line naming a flag, within a bound of
    time and memory (the simulated arrivals are bounded: MAX_ARRIVALS)."""
    argv = [part for flag, value in flags.items() for part in (flag, value)]
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-m", "admitgate", "simulate", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_limit_memory,
    )
    try:
        out, err = child.communicate(timeout=RUN_BOUND_S)
    finally:
        child.kill()
        child.wait()
    elapsed = time.monotonic() - started
    assert child.returncode in (0, 2), (argv, child.returncode, err[-2000:])
    if child.returncode == 2:
        assert len(err.strip().splitlines()) == 1, (argv, err)
        assert "--" in err, (argv, err)  # it names a flag
    else:
        assert "goodput" in out and err == "", (argv, err)
    assert elapsed < RUN_BOUND_S, (argv, elapsed)
