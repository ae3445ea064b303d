"""``python -m admitgate simulate --class ... --tenants N``: priority classes and tenants in the
overload simulator. Your gate with classes is compared with the same gate without them and
no gate; the table and the PNG show each class's goodput and queue wait."""

from __future__ import annotations

import re

import pytest
from admitgate._simulate import main

CLASSES = [
    "--class",
    "interactive:share=0.05,min=0.5,patience=2",
    "--class",
    "batch:min=0.2",
]
BASE = ["--capacity", "16", "--max-concurrent-runs", "16", "--queue-depth", "64", "--seed", "5"]


def class_rows(out: str) -> dict[tuple[str, str], list[str]]:
    """The class table's rows, by (gate, class)."""
    found = {}
    table = next((part for part in out.split("\n\n") if "offered/s" in part), "")
    for line in table.splitlines():
        match = re.match(r"^(\S.*?)\s{2,}(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%", line)
        if match:
            found[(match.group(1), match.group(2))] = list(match.groups()[2:])
    return found


def test_classes_serve_people_first_and_the_batch_takes_the_rest(capsys, tmp_path):
    png = tmp_path / "classes.png"
    assert main([*BASE, *CLASSES, "--tenants", "20", "--duration", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    rows = class_rows(out)
    yours = "yours (max 16, queue 64)"
    fifo = f"{yours}, fifo"
    # offered/s, turns/s, goodput, served %
    assert float(rows[(yours, "interactive")][3]) >= 95.0, out
    assert float(rows[(fifo, "interactive")][3]) < float(rows[(yours, "interactive")][3]), out
    total = float(rows[(yours, "interactive")][2]) + float(rows[(yours, "batch")][2])
    assert total >= 0.9, out
    assert ("no gate", "batch") in rows
    assert png.stat().st_size > 10_000


def test_a_run_without_classes_prints_no_class_table(capsys):
    assert main([*BASE, "--duration", "2", "--tenants", "4"]) == 0
    assert "offered/s" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--class", "a:share=2"], "--class must look like NAME:share=F"),
        (["--class", "a:weight=1"], "--class must look like"),
        (["--class", "a:min=0.1,min=0.2"], "--class must look like"),
        (["--class", "a b"], "--class must look like"),
        (["--class", "a:min=0.9,max=0.5"], "--class a: min must be <= max"),
        (["--class", "a", "--class", "a"], "--class: a class is named twice"),
        (["--class", "a:min=0.7", "--class", "b:min=0.7"], "min shares sum above 1"),
        (["--class", "a:share=1", "--class", "b"], "leaving nothing for b"),
        (["--class", "a", "--default-priority", "z"], "--default-priority 'z' is not a --class"),
        (["--tenants", "0"], "--tenants: must be an integer from 1 to"),
        (["--fairness", "maybe"], "--fairness: invalid choice"),
    ],
)
def test_bad_class_flags_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err
