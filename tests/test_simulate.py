"""``python -m admitgate simulate``: the overload simulator as a command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from admitgate._simulate import main

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
        (["--capacity", "0"], "capacities >= 1"),
        (["--patience", "-1"], "must be a positive number, got '-1'"),
        (["--load", "nan"], "must be a positive number, got 'nan'"),
    ],
)
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_config_that_cannot_be_read_exits_2(capsys, tmp_path):
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert main(["--max-concurrent-runs", "-3"]) == 2
    assert "max_concurrent_runs must be >= 0, got -3" in capsys.readouterr().err


def test_png_of_goodput_and_the_ceiling(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out.png"
    assert main(["--duration", "2", "--png", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
