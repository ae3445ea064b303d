"""The curl commands of docs/http.md and docs/broker.md, run as written (only their ports
moved to free ones) with the curl CLI against the real servers they name: the HTTP example's
server (``examples/a2a_http_server.py``, uvicorn and the A2A SDK), and the broker in front of
it. curl is Debian's; the test installs it with apt-get when missing, as the redis tests do."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _broker import BrokerProcess, wait_until

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_PORT = "127.0.0.1:8000"  # where the docs' commands find the example's server
BROKER_PORT = "127.0.0.1:8080"  # and the broker


def _curl() -> str:
    found = shutil.which("curl")
    if found is None:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "curl"], check=True, capture_output=True, timeout=300
        )
        found = shutil.which("curl")
    assert found is not None, "curl (Debian package curl) is needed"
    return found


def commands(page: str) -> list[str]:
    """The page's ``$ curl ...`` commands (with their continuation lines), as shell text."""
    found: list[str] = []
    text = (ROOT / "docs" / page).read_text()
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        command: list[str] = []
        for line in block.splitlines():
            if line.startswith("$ curl ") or command:
                command.append(line.removeprefix("$ "))
                if not line.endswith("\\"):
                    found.append("\n".join(command))
                    command = []
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def example_server() -> Iterator[str]:
    """``python examples/a2a_http_server.py`` on a free port: its ``host:port``."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "a2a_http_server.py")],
        env={**os.environ, "ADMITGATE_EXAMPLE_PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    try:
        wait_until(up, timeout=30)
        yield f"127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


def run(command: str, replacements: dict[str, str]) -> dict:
    for documented, real in replacements.items():
        command = command.replace(documented, real)
    done = subprocess.run(
        ["bash", "-c", command.replace("curl ", f"{_curl()} ", 1)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, (command, done.stderr)
    return json.loads(done.stdout)


def echo_text(answer: dict) -> str:
    """The reply's text, from a JSON-RPC result or a REST body."""
    reply = answer.get("result", answer)
    message = reply.get("message") or reply.get("task", {}).get("status", {}).get("message")
    assert message is not None, answer
    return "".join(part.get("text", "") for part in message["parts"])


def test_the_http_pages_curl_commands_get_the_agents_reply(example_server: str) -> None:
    found = commands("http.md")
    assert len(found) == 2 and "message:send" in found[1]
    for command in found:
        assert "-H 'A2A-Version: 1.0'" in command
        answer = run(command, {EXAMPLE_PORT: example_server})
        assert "error" not in answer, answer
        assert echo_text(answer) == "echo: hello"


def test_without_the_version_header_the_sdk_answers_the_documented_error(
    example_server: str,
) -> None:
    jsonrpc = commands("http.md")[0].replace(" -H 'A2A-Version: 1.0'", "")
    answer = run(jsonrpc, {EXAMPLE_PORT: example_server})
    assert answer["error"]["code"] == -32009, answer


def test_the_broker_pages_curl_commands_pass_the_broker(example_server: str) -> None:
    broker = BrokerProcess(
        sys.executable,
        "--upstream",
        f"http://{example_server}",
        "--max-in-flight",
        "2",
        prefix=["-m", "admitgate", "broker"],
    )
    try:
        found = commands("broker.md")
        assert len(found) == 2 and "message:send" in found[1]
        for command in found:
            answer = run(command, {BROKER_PORT: broker.address})
            assert "error" not in answer, answer
            assert echo_text(answer) == "echo: hello"
        assert broker.metrics()['broker_admitted_total{transport="jsonrpc"}'] == 1
        assert broker.metrics()['broker_admitted_total{transport="rest"}'] == 1
    finally:
        assert broker.stop() == 0
