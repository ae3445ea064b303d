"""``python -m admitgate broker``: the broker in this process, with the binary's flags, help,
messages and exit codes (compared with the standalone binary's own)."""

from __future__ import annotations

import signal
import socket
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
    for flag in ("--listen", "--upstream", "--upstream-protocol", "--max-in-flight", "--fleet"):
        assert flag in in_process
    bad = ["--upstream", "http://127.0.0.1:1", "--queue-depth", "-1"]
    assert admitgate.broker.main(bad) == 2
    message = capfd.readouterr().err
    assert "--queue-depth must be >= 0, got -1" in message
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


def _python_m_broker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "admitgate", "broker", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_busy_port_is_one_line_and_exit_2_not_a_traceback() -> None:
    """Issue 27: `python -m admitgate broker` on a busy port printed a Python traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = _python_m_broker("--upstream", "http://127.0.0.1:9", "--listen", address)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"python -m admitgate broker: error: --listen {address}: ")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-in-flight", "-1"], "--max-in-flight must be >= 0, got -1"),
        (["--queue-depth", "-2"], "--queue-depth must be >= 0, got -2"),
        (["--overflow-policy", "drop"], "--overflow-policy must be one of"),
        (["--queue-timeout", "-1"], "--queue-timeout must be a number of seconds > 0"),
        (["--drain-timeout", "nan"], "--drain-timeout must be a number of seconds >= 0"),
        (["--memory-soft-ratio", "2"], "--memory-soft-ratio must be a fraction"),
        (["--tenant-from", "cookie:x"], "--tenant-from must be header:NAME or path"),
        (["--max-in-flight-per-tenant", "2"], "--max-in-flight-per-tenant needs --tenant-from"),
        (["--upstream-protocol", "h3"], "--upstream-protocol must be http1, h2 or auto"),
        (["--jsonrpc-path", "rpc"], "--jsonrpc-path must start with /"),
        (["--threads", "0"], "--threads must be between 1 and 1024, got 0"),
        (["--threads", "1025"], "--threads must be between 1 and 1024, got 1025"),
        (["--max-inflight", "3"], "tip: a similar argument exists: '--max-in-flight'"),
    ],
)
def test_messages_name_the_flag_as_typed(binary: Any, flags: list[str], message: str) -> None:
    """Issue 27: the messages named settings in snake_case (`max_in_flight must be >= 0`),
    and `--max-inflight` got no suggestion."""
    for command in ([binary], [sys.executable, "-m", "admitgate", "broker"]):
        done = subprocess.run(
            [*command, "--upstream", "http://127.0.0.1:9", *flags],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 2, done
        assert message in done.stderr, done.stderr


def test_a_setting_from_the_config_file_is_named_as_its_key(tmp_path: Any) -> None:
    config = tmp_path / "broker.yaml"
    config.write_text("upstream: http://127.0.0.1:9\nmax_in_flight: -1\n")
    done = _python_m_broker("--config", str(config))
    assert done.returncode == 2
    assert f"max_in_flight (in {config}) must be >= 0, got -1" in done.stderr, done.stderr
    # The flag wins, and is named as the flag.
    done = _python_m_broker("--config", str(config), "--max-in-flight", "-3")
    assert "--max-in-flight must be >= 0, got -3" in done.stderr, done.stderr


def test_a_broker_without_a_cap_warns_in_plain_words_at_start(binary: Any) -> None:
    """Issue 27: with no --max-in-flight (default 0) the broker gates nothing, and said so
    only in an info-level JSON field."""
    uncapped = BrokerProcess(binary, "--upstream", "http://127.0.0.1:9", metrics=False)
    capped = BrokerProcess(
        binary, "--upstream", "http://127.0.0.1:9", "--max-in-flight", "2", metrics=False
    )
    assert (uncapped.stop(), capped.stop()) == (0, 0)  # every line read
    warning = uncapped.events("no_cap")
    assert [line["level"] for line in warning] == ["warn"], uncapped.raw
    assert "gates nothing" in warning[0]["message"]
    assert "--max-in-flight" in warning[0]["message"]
    assert capped.events("no_cap") == [], capped.raw
