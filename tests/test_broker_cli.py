"""``admitgate.broker``: the broker binary run from Python, its flags, its exit codes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

import admitgate.broker
import pytest
from _broker import build_broker


@pytest.fixture(scope="module")
def binary() -> Any:
    return build_broker()


def test_help_lists_every_flag_and_bad_flags_exit_2(
    binary: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ADMITGATE_BROKER", str(binary))
    assert admitgate.broker.main(["--help"]) == 0
    out = capfd.readouterr().out
    for flag in (
        "--listen",
        "--upstream",
        "--grpc-upstream",
        "--upstream-protocol",
        "--max-in-flight",
        "--queue-depth",
        "--overflow-policy",
        "--max-in-flight-per-tenant",
        "--tenant-from",
        "--fleet",
        "--fleet-key",
        "--metrics-listen",
        "--drain-timeout",
        "--config",
    ):
        assert flag in out
    assert admitgate.broker.main(["--upstream", "http://127.0.0.1:1", "--queue-depth", "-1"]) == 2
    assert "queue_depth must be >= 0, got -1" in capfd.readouterr().err
    monkeypatch.setenv("ADMITGATE_BROKER", "/nonexistent/admitgate-broker")
    with pytest.raises(FileNotFoundError, match="ADMITGATE_BROKER"):
        admitgate.broker.find_binary()
    with pytest.raises(TypeError, match="queue_depth"):
        admitgate.broker.serve(upstream="http://127.0.0.1:1", queue_depth=[1])


def test_serve_runs_until_sigterm_and_exits_0(binary: Any) -> None:
    code = (
        "import admitgate.broker as b; raise SystemExit(b.serve("
        "upstream='http://127.0.0.1:9', listen='127.0.0.1:0', max_in_flight=1, drain_timeout=1))"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stderr=subprocess.PIPE,
        env={**__import__("os").environ, "ADMITGATE_BROKER": str(binary)},
    )
    try:
        assert child.stderr is not None
        first = json.loads(child.stderr.readline())
        assert first["event"] == "listening"
        child.send_signal(signal.SIGTERM)
        assert child.wait(15) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stderr is not None:
            child.stderr.close()
