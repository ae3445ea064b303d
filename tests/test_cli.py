"""``python -m admitgate``: --help for the program and every command, a bare call prints the
help instead of running something, usage errors exit 2, and the demo ends with its reading."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from admitgate import _demo
from admitgate.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_every_command_and_exits_0():
    done = subprocess.run(
        [sys.executable, "-m", "admitgate", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m admitgate ")
    for command, (summary, _) in COMMANDS.items():
        assert f"  {command}" in done.stdout and summary in done.stdout
    assert set(COMMANDS) == {"demo", "check-config", "simulate", "bench", "broker"}


def test_a_bare_call_prints_the_help_and_runs_nothing(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m admitgate ")
    assert "admitgate demo:" not in out and "in_flight" not in out


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_answers_help_with_its_usage(capfd, command, flag):
    assert main([command, flag]) == 0
    out = capfd.readouterr().out
    if command == "broker":
        # The broker's flags are parsed by its Rust crate (clap): usage after a description.
        assert f"\nUsage: python -m admitgate {command} " in out, out
    else:
        assert out.startswith(f"usage: python -m admitgate {command} ")


def test_version(capsys):
    import admitgate

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"admitgate {admitgate.__version__}"


@pytest.mark.parametrize("argv", [["frob"], ["--frob"], ["demo", "--frob"]])
def test_usage_errors_exit_2_and_say_what_was_wrong(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "frob" in err
    if argv[0] == "demo":  # a command's own parser: one line, naming the command
        assert err.startswith("python -m admitgate demo: error: unrecognized arguments: --frob")
        assert len(err.strip().splitlines()) == 1, err
    else:
        assert "usage: python -m admitgate" in err


def test_the_demo_ends_with_a_two_line_reading_of_its_own_figures():
    out = io.StringIO()
    argv = ["--noisy-burst", "40", "--quiet-tenants", "3", "--quiet-turns", "2"]
    result = _demo.main(argv, out=out)
    last = out.getvalue().rstrip("\n").splitlines()[-2:]
    noisy = result["tenants"]["noisy"]
    assert last[0] == (
        f"Reading: the noisy tenant sent 40 turns at once but never ran more than "
        f"{noisy['peak_running']} at a time; {noisy['waited']} waited in its own lane and "
        f"{noisy['rejected']} were refused with a busy reply."
    )
    assert noisy["peak_running"] == 4
    assert last[1].startswith("Meanwhile all 6 turns of the 3 quiet tenants were admitted")


def test_the_reading_says_so_when_quiet_tenants_lost_turns():
    logs = {"noisy": _demo.TenantLog(turns=10, admitted=10, peak_running=4)}
    logs["quiet-00"] = _demo.TenantLog(turns=5, admitted=3, rejected=2, waits_ms=[1.0, 2.0, 3.0])
    first, second = _demo.reading(logs)
    assert "0 were refused" in first
    assert second.startswith("The 1 quiet tenants lost 2 of 5 turns")


def test_bench_help_outside_a_checkout_says_where_it_runs_and_exits_0(tmp_path):
    import os
    import shutil

    import admitgate

    site = tmp_path / "site"
    shutil.copytree(
        Path(admitgate.__file__).parent,
        site / "admitgate",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "admitgate", "bench", "--help"],
        cwd=site,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m admitgate bench ")
    assert "source checkout" in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--noisy-burst", "-5"], "argument --noisy-burst: must be an integer from 1 to 10000"),
        (["--quiet-tenants", "0"], "argument --quiet-tenants: must be an integer from 1 to"),
        (["--quiet-turns", "0"], "argument --quiet-turns: must be an integer from 1 to 100"),
        (["--noisy-burst", "ten"], "argument --noisy-burst: must be an integer, got 'ten'"),
    ],
)
def test_demo_refuses_counts_that_make_no_demo_in_one_line(capsys, argv, message):
    """Issue 27: `--noisy-burst -5` and `--quiet-tenants 0` printed a nonsense summary."""
    assert main(["demo", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert "admitgate demo:" not in captured.out  # nothing ran


def _run_cli(*argv: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"import sys\n{prelude}\nfrom admitgate.__main__ import main\nsys.exit(main({list(argv)!r}))"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_simulate_png_without_matplotlib_says_so_before_running(tmp_path):
    """Issue 27: exit 1 with no message (`__main__` swallowed the SystemExit's text)."""
    done = _run_cli(
        "simulate",
        "--png",
        str(tmp_path / "x.png"),
        prelude="sys.modules['matplotlib'] = None  # as if it were not installed",
    )
    assert done.returncode == 2, done
    assert done.stderr.strip() == (
        "python -m admitgate simulate: error: --png needs matplotlib: "
        "pip install 'admitgate[simulate]'"
    )
    assert "goodput" not in done.stdout  # refused before the run


def test_simulate_png_into_a_missing_folder_is_refused_before_the_run(tmp_path):
    """Issue 27: the whole simulation ran, then a traceback."""
    target = tmp_path / "nonexistent" / "dir" / "x.png"
    done = _run_cli("simulate", "--png", str(target))
    assert done.returncode == 2, done
    assert done.stderr.strip().startswith("python -m admitgate simulate: error: --png: no such")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "goodput" not in done.stdout


def test_a_commands_systemexit_text_is_printed_not_swallowed(capsys, monkeypatch):
    def says_why(argv: list[str]) -> int:
        raise SystemExit("this is why")

    monkeypatch.setitem(COMMANDS, "demo", ("", says_why))
    assert main(["demo"]) == 1
    assert capsys.readouterr().err == "this is why\n"
