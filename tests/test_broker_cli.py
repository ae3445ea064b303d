"""``python -m admitgate broker``: the broker in this process, with the binary's flags, help,
messages and exit codes (compared with the standalone binary's own)."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import admitgate.broker
import pytest
from _broker import BrokerProcess, build_broker


@pytest.fixture(scope="module")
def binary() -> Any:
    return build_broker()


def test_help_and_bad_flags_are_the_binarys(binary: Any, capfd: pytest.CaptureFixture[str]) -> None:
    assert admitgate.broker.main(["--help"], prog="admitgate-broker") == 0
    in_process = capfd.readouterr().out
    standalone = subprocess.run(
        [binary, "--help"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    assert in_process == standalone
    for flag in ("--listen", "--upstream", "--max-in-flight", "--fleet", "--drain-timeout"):
        assert flag in in_process
    bad = ["--upstream", "http://127.0.0.1:1", "--queue-depth", "-1"]
    assert admitgate.broker.main(bad) == 2
    message = capfd.readouterr().err
    assert "queue_depth must be >= 0, got -1" in message
    standalone_bad = subprocess.run([binary, *bad], capture_output=True, text=True, timeout=10)
    assert (standalone_bad.returncode, standalone_bad.stderr) == (2, message)
    assert admitgate.broker.main(["--no-such-flag"], prog="python -m admitgate broker") == 2
    assert "python -m admitgate broker" in capfd.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_python_m_admitgate_broker_drains_on_a_signal_and_exits_0(sig: int) -> None:
    broker = BrokerProcess(
        sys.executable,
        "--upstream",
        "http://127.0.0.1:9",
        "--drain-timeout",
        "1",
        prefix=["-m", "admitgate", "broker"],
    )
    assert broker.stop(sig) == 0
    assert broker.events("drained")[0]["all_requests_finished"] is True
