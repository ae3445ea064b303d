"""Every example in examples/ runs as written and prints what its page says it prints.

The examples are the files the documentation includes (``--8<-- "examples/NAME.py"``), so an
example that stops working fails here, and one that no page shows fails too. The one-shot
examples start together in subprocesses (they spend most of their time sleeping or waiting on
a server), each test then reads its own; the servers are started on a free loopback port,
checked to answer, and stopped with Ctrl-C (SIGINT), as a person would, or with SIGTERM, as an
orchestrator would.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs"

#: Each one-shot example and lines (regular expressions) its output must contain.
ONE_SHOT: dict[str, list[str]] = {
    "quickstart.py": [r"^echo: hi 0$", r"reason=queue_full\)$", r"'admitted': 8, 'rejected': 4"],
    "gate_policies.py": [
        r"^while the burst runs: \{'in_flight': 4, 'queued': 36\}",
        r"'admitted': 43, 'rejected': 0",
    ],
    "operating.py": [
        r"^  tenant-\d: you are #1 in line",
        r"^after reconfigure: 4 in flight, 2 queued$",
        r"^sync turn: echo: from a thread$",
        r"^drain: DrainReport\(finished=1, still_running=0, queued_rejected=0\)$",
        r"^after close: echo: last / refused: closing$",
    ],
    "a2a_http_client.py": [
        r"^echo: hello$",
        r"^refusals before it got through: [1-9]\d*$",
    ],
    "grpc_client.py": [
        r"^echo: hello$",
        r"^refusals before it got through: [1-9]\d*$",
    ],
    "metrics.py": [
        r'^broker_admitted_total\{gate="chat",transport="direct"\} 30\.0$',
        r'^broker_rejected_total\{gate="a2a",reason="queue_full",transport="direct"\} 2\.0$',
        r'^broker_limit\{gate="a2a"\} 4\.0$',
    ],
    "broker.py": [
        r"^200 from the agent\n200 from the agent\n(429 queue_full, retry after \d+ s\n){3}"
        r"agent card: any-language agent\nbroker drained and stopped$",
    ],
    "rate_limit_broker.py": [
        r"^key-a: 200 \(usage header: not shown\)\nkey-a: 200 \(usage header: not shown\)\n"
        r'key-a: 429 rate_limited, Retry-After (\d+), RateLimit "tokens-per-min";r=0;t=\1\n'
        r"key-b: 200 \(usage header: not shown\)$",
        r'^RateLimit-Policy: "requests-per-min";q=3;w=60, "tokens-per-min";q=1000;w=60;'
        r'qu="tokens"$',
        r"^broker drained and stopped$",
    ],
    "rate_limit_http.py": [
        r"^key-a: 200 \(usage header: not shown\)\nkey-a: 200 \(usage header: not shown\)\n"
        r'key-a: 429 rate_limited, RateLimit "requests-per-min";r=0;t=\d+\n'
        r'  RateLimit-Policy "requests-per-min";q=2;w=60, "tokens-per-min";q=1000;w=60;'
        r'qu="tokens"\nkey-b: 200 \(usage header: not shown\)\nno key: 200',
        r"^allowed 4, limited 1, tokens settled 480$",
    ],
    "priorities_broker.py": [
        r"^batch-3: 429 shed \(class batch\)$",
        r"^chat-1: 200$",
        r"^the agent ran: batch-1, batch-2, chat-1, batch-4$",
        r'^broker_priority_defaulted_total\{cause="unknown"\} 1$',
        r"^broker drained and stopped$",
    ],
    "fleet.py": [
        r"^20 turns on two replicas, at most [123] at once \(fleet cap 3\)$",
        r"'fleet_backend_up': 1",
    ],
    "botos.py": [
        r"^BotOS's gate: admitgate AdmissionGate$",
        r"^alice runs at most 2 at once: \{'in_flight': 2, 'queued': 3\} bob: \{'in_flight': 1,",
        r"'admitted': 6, 'rejected': 0",
    ],
    "botos_rate_limits.py": [
        r"^t=3: allowed=False retry_after_seconds=300\.0$",
        r"^t=200: allowed=False retry_after_seconds=103\.0$",
        r"^t=303: allowed=True retry_after_seconds=None$",
        r"^6 of 6 passed within 61 s",
        r"^6 attempts over 2 replicas: \[True, True, True, False, False, False\]$",
        r"^WindowLockout \[True, True, True, True, True, False\] retry in 300 s$",
    ],
    "human_approval.py": [
        r"^while the person thinks: 0 in flight, 1 waiting$",
        r"^user-b: done while user-a waited for a person$",
        r"^user-a: approved by alice$",
        r"'admitted': 2, 'rejected': 0",
    ],
    "memory_pressure.py": [
        r"^at 950 MiB: 1 running, 1 waiting$",
        r"^c: refused \(memory_pressure, retry after 5\.0 s\)$",
        r"^a: ran / b: ran$",
    ],
    "overload.py": [
        r"^learned ceiling: [2-5] \(the provider runs 3\)$",
        r"^provider 429s: \d+ of \d+ calls$",
        r"^with every slot taken, 5 ms left: deadline$",
    ],
    "priorities.py": [
        r"^batch-4: refused \(shed, class batch\)$",
        r"^batch-6: refused \(shed, class batch\)$",
        r"^in flight / queued: \{'interactive': \(0, 3\), 'batch': \(4, 5\)\}$",
        r"^the chat turns started \[5, 6, 7\] of 12$",
        r"'interactive': \{'in_flight': 0, 'queued': 0, 'admitted': 3, 'rejected': 0, 'shed': 0",
        r"'batch': \{'in_flight': 0, 'queued': 0, 'admitted': 9, 'rejected': 0, 'shed': 3",
    ],
    "budgets.py": [
        r"^refused: rate_limited, retry in 2\.0 s$",
        r"^after the retry time: admitted$",
        r"^cost 5000 of 1000/min: rate_limited, retry_after=None$",
        r"^3 turns at 1 per 0\.5 s took 1\.\d s$",
        r"'allowed': 4, 'limited': 2, 'tokens_reserved': 700, 'tokens_settled': 250",
    ],
    "budgets_estimator.py": [
        r"^alice: reserved 500, used 1200\nalice: reserved 1200, used 3000\n"
        r"alice: reserved 3000, used 1000\nalice: reserved 1515, used 1000\n",
        r"^bob: reserved 1258, used 800$",
        r"^carol: reserved 50 \(cost=\)$",
        r"^\{'identities': 2, 'reports': 6\}$",
    ],
    "budgets_fleet.py": [
        r"^12 turns on two replicas: 5 admitted, 7 refused \{'rate_limited'\}$",
        r"^the next one fits in 10 s$",
        r"^allowed per replica: \[\d, \d\]$",
    ],
    "check_config.py": [
        r"^ceiling 32 soft RSS 921\.6 MiB$",
        r"^queue_depth from override$",
        r"^refused: max_concurrent_runs -1$",
    ],
}

#: The servers: how to tell each is up once it listens on $ADMITGATE_EXAMPLE_PORT.
SERVERS = {
    "a2a_http_server.py": "http",
    "grpc_server.py": "grpc",
}

ONE_SHOT_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def example_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADMITGATE_EXAMPLE")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def start(name: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / name)],
        cwd=ROOT,
        env=example_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def one_shot_runs(redis_server: Any) -> Any:
    """Every one-shot example, started at once; yields name -> (returncode, stdout, stderr)."""
    redis_url = redis_server.url.rsplit("/", 1)[0] + "/15"  # a database the fleet tests leave be
    running = {name: start(name, ADMITGATE_REDIS_URL=redis_url) for name in ONE_SHOT}
    results: dict[str, tuple[int | None, str, str]] = {}
    deadline = time.monotonic() + ONE_SHOT_TIMEOUT_S
    try:
        for name, process in running.items():
            try:
                out, err = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
                err += f"\n(killed after {ONE_SHOT_TIMEOUT_S} s)"
            results[name] = (process.returncode, out, err)
        yield results
    finally:
        for process in running.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def test_every_example_is_run_here_and_shown_in_the_docs():
    files = {p.name for p in EXAMPLES.glob("*.py")}
    assert files == set(ONE_SHOT) | set(SERVERS)
    included = set()
    for page in DOCS.glob("*.md"):
        included |= set(re.findall(r'--8<-- "examples/([\w.]+)"', page.read_text()))
    missing = files - included - {"quickstart.py"}  # the README's, checked below
    assert not missing, f"examples no docs page includes: {sorted(missing)}"


def test_the_readme_example_is_the_quickstart_file_verbatim():
    # GitHub renders no include, so the README carries a copy; it must not drift.
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", readme, re.MULTILINE | re.DOTALL)
    assert (EXAMPLES / "quickstart.py").read_text() in blocks


@pytest.mark.parametrize("name", ONE_SHOT)
def test_example_runs_as_written(one_shot_runs, name):
    returncode, out, err = one_shot_runs[name]
    assert returncode == 0, f"{name} exited {returncode}\nstdout:\n{out}\nstderr:\n{err}"
    assert "Traceback" not in err and "Warning" not in err, err
    for expected in ONE_SHOT[name]:
        assert re.search(expected, out, re.MULTILINE), f"{name}: no {expected!r} in\n{out}"


def _http_up(port: int) -> bool:
    url = f"http://127.0.0.1:{port}/.well-known/agent-card.json"
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200 and b'"echo"' in response.read()
    except OSError:
        return False


def _grpc_up(port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("name", SERVERS)
def test_server_example_serves_on_loopback_and_stops_on_a_signal(name, signum):
    port = free_port()
    process = start(name, ADMITGATE_EXAMPLE_PORT=str(port))
    try:
        up = _http_up if SERVERS[name] == "http" else _grpc_up
        deadline = time.monotonic() + 15
        while not up(port):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, f"{name} did not answer on port {port}"
            time.sleep(0.05)
        process.send_signal(signum)
        out, err = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    # uvicorn re-raises the signal once its graceful shutdown is done, so its exit status says
    # which signal stopped it.
    assert process.returncode in (0, -signum), f"{name} exited {process.returncode}\n{out}\n{err}"
    assert "Traceback" not in err, err


def console_transcripts() -> list[tuple[str, str, str]]:
    """(page, command, expected output) for each `$ python -m admitgate ...` or `$ cat ...`
    line of the docs' console blocks that shows its output."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"^```console\n(.*?)^```$", page.read_text(), re.M | re.S):
            lines = block.splitlines()
            if all(line.startswith("$ ") for line in lines):
                continue  # commands without their output: nothing to compare
            for i, line in enumerate(lines):
                if line.startswith(("$ python -m admitgate", "$ cat ")):
                    rest = lines[i + 1 :]
                    end = next((j for j, x in enumerate(rest) if x.startswith("$ ")), len(rest))
                    found.append((page.name, line[2:], "\n".join(rest[:end])))
    return found


def _machine_neutral(text: str) -> str:
    # The memory line names this machine's RAM, which differs from the machine the docs show.
    return re.sub(r"\(\d+% of this machine's \d+ MiB\)", "(N% of this machine's M MiB)", text)


@pytest.mark.parametrize(
    "page, command, expected",
    [pytest.param(*t, id=f"{t[0]}: {t[1]}") for t in console_transcripts()],
)
def test_console_transcripts_in_the_docs_print_what_they_show(page, command, expected):
    import shlex

    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    done = subprocess.run(
        argv,
        cwd=ROOT,
        env=example_env(COLUMNS="100"),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    shown = _machine_neutral((done.stdout + done.stderr).rstrip("\n"))
    assert shown == _machine_neutral(expected), f"{page}: `{command}` printed\n{shown}"


def shown_outputs() -> list[tuple[str, str, str]]:
    """(page, example, output) for each ```text title="prints"``` block that follows an
    example's include: what the page says the example prints."""
    pattern = re.compile(
        r'^--8<-- "examples/([\w.]+)"\n```\n\n```text title="prints"\n(.*?)^```$', re.M | re.S
    )
    return [
        (page.name, name, output.rstrip("\n"))
        for page in sorted(DOCS.glob("*.md"))
        for name, output in pattern.findall(page.read_text())
    ]


@pytest.mark.parametrize(
    "page, name, shown", [pytest.param(*s, id=f"{s[0]}: {s[1]}") for s in shown_outputs()]
)
def test_an_example_prints_what_its_page_shows(one_shot_runs, page, name, shown):
    returncode, out, err = one_shot_runs[name]
    assert returncode == 0, err
    assert out.rstrip("\n") == shown, f"{page} shows a different output of {name}:\n{out}"


def test_the_pages_show_the_output_of_the_examples_that_have_one():
    assert len(shown_outputs()) >= 10
